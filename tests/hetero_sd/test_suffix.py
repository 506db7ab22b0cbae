"""SuffixDrafter (suffix decoding): its configuration, and the engine: greedy
output equals target-only, and earlier requests' outputs raise acceptance on
later ones. The drafting rules and rollback: test_suffix_rules.py; the trees
against a brute-force reference: test_suffix_trees.py."""
from __future__ import annotations

from collections import deque

from pathlib import Path

import pytest

from hetero_sd.config import load_config
from hetero_sd.drafting.build import build_drafter
from hetero_sd.drafting.specs import SuffixSpec, WorkerSpec, has_distributions
from hetero_sd.drafting.suffix import SuffixDrafter
from hetero_sd.errors import ConfigError
from hetero_sd.spec import spec_from_config


# ------------------------------------------------------------------ configuration
def _yaml(tmp_path, drafter: str, model=None) -> Path:
    path = tmp_path / "suffix.yaml"
    path.write_text(f"target: {{model: {model or tmp_path}, precision: fp32}}\ndrafter: {drafter}\n"
                    "memory: {kv_budget: 4MiB}\ngeneration: {max_new_tokens: 16, chat_template: false}\n")
    return path


def test_yaml_suffix_drafter_becomes_its_spec_and_drafter(tmp_path):
    cfg = load_config(_yaml(tmp_path, "{kind: suffix, k: 6, suffix_max_depth: 32, suffix_factor: 1.5, "
                                      "suffix_min_prob: 0.2, suffix_cache_requests: 9}"))
    spec = spec_from_config(cfg).drafter
    assert spec == SuffixSpec(32, 1.5, 0.2, 9) and spec.label == "suffix"
    drafter = build_drafter(spec, target_vocab=100)
    assert isinstance(drafter, SuffixDrafter)
    assert (drafter.max_depth, drafter.factor, drafter.min_token_prob, drafter.max_cached_requests) == (32, 1.5, 0.2, 9)
    assert spec_from_config(load_config(_yaml(tmp_path, "{kind: suffix}"))).drafter == SuffixSpec()
    worker = spec_from_config(load_config(_yaml(tmp_path, "{kind: suffix, process: worker, transport: pipe}")))
    assert worker.drafter == WorkerSpec(SuffixSpec(), "pipe") and not has_distributions(worker.drafter)


@pytest.mark.parametrize("drafter, words", [
    ("{kind: suffix, suffix_factr: 2}", ["suffix.yaml", "drafter.suffix_factr", "unknown key", "suffix_factor"]),
    ("{kind: suffix, suffix_min_prob: 2}", ["suffix.yaml", "drafter.suffix_min_prob", "less than or equal to 1"]),
    ("{kind: suffix, suffix_max_depth: 0}", ["drafter.suffix_max_depth", "greater than or equal to 1"]),
    ("{kind: suffix, suffix_factor: 0}", ["drafter.suffix_factor", "greater than 0"]),
    ("{kind: ngram, suffix_factor: 2}", ["suffix.yaml", "drafter.suffix_factor", "drafter.kind: suffix", "'ngram'"]),
    ("{kind: sufix}", ["drafter.kind", "'suffix'"]),
])
def test_yaml_suffix_errors_name_the_key_and_file(tmp_path, drafter, words):
    with pytest.raises(ConfigError) as err:
        load_config(_yaml(tmp_path, drafter))
    for word in words:
        assert word in str(err.value)


# ------------------------------------------------------------------ the engine
def _torch_target(folder):
    from hetero_sd.backends.torch_backend import TorchBackend
    from hetero_sd.ir import load_model_ir

    return TorchBackend().load(load_model_ir(folder), "cpu", "fp32", 4 << 20)


def _prompts(count: int, seed: int) -> list[list[int]]:
    """Random prompts of several lengths, every other one with a repeated stretch."""
    from helpers.tiny_models import random_prompt

    out = []
    for i in range(count):
        head = random_prompt(4 + 5 * i, seed=seed + i)
        out.append(head + head if i % 2 else head)
    return out


@pytest.mark.parametrize("variant, ks", [("llama", range(1, 9)), ("qwen2", (2, 5, 8))])
def test_greedy_output_equals_target_only(tiny_model_dir, variant, ks):
    """k = 1..8, prompts of several lengths and seeds, one engine per k: each
    drafts three requests, the third a repeat of the first, so the global tree
    (earlier outputs) drafts as well as the request's own."""
    from hetero_sd.engine import Engine

    target = _torch_target(tiny_model_dir(variant))
    prompts = _prompts(4, seed=11)
    new = [16, 20, 18, 22]
    want = [Engine(target, None).generate_ids(p, n, target_only=True) for p, n in zip(prompts, new)]
    drafted = accepted = 0
    for k in ks:
        drafter = SuffixDrafter()
        engine = Engine(target, drafter, k=k, eos_ids=())
        for i in (k % 4, (k + 1) % 4, k % 4):
            got = engine.generate_ids(prompts[i], new[i])
            assert got.token_ids == want[i].token_ids, f"{variant} k={k} prompt {i}: diverged"
            assert got.stats.finish_reason == want[i].stats.finish_reason and got.stats.lossless == "exact"
            drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
        assert len(drafter.global_tree.order) == 3
    assert 0 < accepted < drafted  # both accepted and rejected drafts were exercised


def _pass(engine, prompts, new=20) -> list[tuple]:
    out = []
    for prompt in prompts:
        res = engine.generate_ids(prompt, new)
        out.append((tuple(res.token_ids), res.stats.drafted, res.stats.accepted, res.stats.rounds))
    return out


def test_earlier_outputs_raise_acceptance_and_clear_global_forgets_them(tiny_model_dir):
    from hetero_sd.engine import Engine

    target = _torch_target(tiny_model_dir("llama"))
    drafter = SuffixDrafter()
    engine = Engine(target, drafter, k=4, eos_ids=())
    prompts = _prompts(4, seed=3)
    first = _pass(engine, prompts)
    second = _pass(engine, prompts)
    for prompt, (ids1, drafted1, accepted1, _), (ids2, drafted2, accepted2, _) in zip(prompts, first, second):
        assert ids1 == ids2 == tuple(engine.generate_ids(prompt, 20, target_only=True).token_ids)
        assert accepted2 >= accepted1 and accepted2 / drafted2 >= accepted1 / max(drafted1, 1)
    # The same prompt again: its output is in the global tree, found from the prompt's tail.
    assert all(a2 > a1 for (_, _, a1, _), (_, _, a2, _) in zip(first, second))
    drafter.clear_global()
    assert _pass(engine, prompts) == first  # deterministic: what pass 1 saw, pass 3 sees


def test_yaml_suffix_drafter_in_a_worker_keeps_its_global_tree(tiny_model_dir, tmp_path, one_torch_thread):
    from hetero_sd.drafting.remote import RemoteDrafter
    from hetero_sd.engine import Engine

    cfg = load_config(_yaml(tmp_path, "{kind: suffix, k: 4, process: worker, transport: pipe, mode: async, "
                                      "threads: 1}", model=tiny_model_dir("llama")))
    engine = Engine.from_config(cfg)
    try:
        assert isinstance(engine.drafter, RemoteDrafter)
        prompt = _prompts(2, seed=5)[1]
        want = engine.generate_ids(prompt, 24, target_only=True).token_ids
        runs = [engine.generate_ids(prompt, 24) for _ in range(2)]
        assert [r.token_ids for r in runs] == [want, want]
        assert runs[0].stats.mode == "suffix@pipe-async" and runs[0].stats.events == []
        assert runs[1].stats.accepted > runs[0].stats.accepted  # the worker's global tree saw run 0
        assert engine.drafter.stats.starts == 1
    finally:
        engine.close()


def test_yaml_suffix_drafter_in_process_persists_across_requests(tiny_model_dir, tmp_path):
    from hetero_sd.engine import Engine

    engine = Engine.from_config(load_config(_yaml(tmp_path, "{kind: suffix, k: 4, suffix_cache_requests: 1}",
                                            model=tiny_model_dir("llama"))))
    drafter = engine.drafter
    assert isinstance(drafter, SuffixDrafter)
    for prompt in _prompts(3, seed=8):
        engine.generate_ids(prompt, 12)
    assert engine.drafter is drafter and len(drafter.global_tree.order) == 1


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, "auto"])
def test_a_seeded_sample_with_one_hot_drafts_is_target_only_sampling(k):
    """One-hot drafts (n-gram, suffix decoding: Drafter.one_hot) are coupled to the target's
    own draws (hetero_sd/sampling.py): a seeded sampled output is, token for token, what
    target-only sampling with that seed gives, whatever the drafter drafts from (its own
    text, earlier requests' outputs, a corpus), at any k, after any other requests."""
    import random

    from hetero_sd.drafting.ngram import NgramDrafter
    from hetero_sd.engine import Engine
    from hetero_sd.sampling import SamplingParams
    from hetero_sd.scheduler import AdaptiveDraftLength
    from helpers.table_model import TableRunner

    rng = random.Random(7)
    corpus = [[rng.randrange(4) for _ in range(30)] for _ in range(4)]
    drafters = {"suffix": SuffixDrafter(), "suffix-corpus": SuffixDrafter(corpus=corpus),
                "ngram": NgramDrafter(1, 3)}
    for name, drafter in drafters.items():
        policy = AdaptiveDraftLength(8) if k == "auto" else None
        engine = Engine(TableRunner(4, seed=0), drafter, k=3 if k == "auto" else k, policy=policy)
        drafted = 0
        for seed in range(6):
            prompt = [seed % 4, 1, 2, 0, 1, 3]
            params = SamplingParams(0.9, top_p=0.95, seed=seed)
            alone = engine.generate_ids(prompt, 28, target_only=True, sampling=params).token_ids
            engine.generate_ids(prompt, 28, sampling=SamplingParams(1.0, seed=100 + seed))  # other requests
            engine.generate_ids(prompt, 28)
            res = engine.generate_ids(prompt, 28, sampling=params)
            assert res.token_ids == alone, (name, k, seed)
            drafted += res.stats.drafted
        assert drafted > 0, name  # (drafts were made and verified)


def test_a_seeded_sampled_request_drafts_from_the_corpus_and_stays_reproducible():
    """A corpus is fixed with the drafter, so a pinned request (seeded, where the suffix
    drafter's lookups decide drafts with distributions, as inside a hybrid: scheduler/mode.py)
    drafts from it (a tree of the pinned sequences alone) and still never depends on earlier
    requests, whose outputs join the global tree beside the corpus."""
    import random

    from hetero_sd.engine import Engine
    from hetero_sd.sampling import Sampler, SamplingParams
    from helpers.table_model import TableRunner

    rng = random.Random(3)
    corpus = [[rng.randrange(4) for _ in range(40)] for _ in range(6)]
    prompt, seeded = [0, 1, 2, 3, 1], SamplingParams(1.0, seed=5)
    drafter = SuffixDrafter(corpus=corpus)
    drafter.one_hot = False  # (declared so, its seeded requests are pinned)
    engine = Engine(TableRunner(4, seed=0), drafter, k=3)
    runs = []
    for other_seed in range(8):
        res = engine.generate_ids(prompt, 24, sampling=seeded)
        runs.append((res.token_ids, res.stats.drafted, res.stats.accepted))
        engine.generate_ids(prompt, 24, sampling=SamplingParams(1.0, seed=100 + other_seed))
        engine.generate_ids(prompt, 24)  # greedy: drafts from the global tree, its output joins it
    assert all(run == runs[0] for run in runs)  # tokens, drafts and acceptances alike
    assert len(drafter.global_tree.order) > 0 and drafter._corpus_only["tree"].order == deque()
    bare_drafter = SuffixDrafter()
    bare_drafter.one_hot = False
    bare = Engine(TableRunner(4, seed=0), bare_drafter, k=3).generate_ids(prompt, 24, sampling=seeded)
    assert runs[0][1] > bare.stats.drafted  # the corpus drafts where the request's own text cannot yet
    forked = drafter.fork()
    forked.begin(64, sampler=Sampler(seeded))
    assert forked._global is drafter._corpus_only["tree"]  # indexed once, shared by the forks


class _Dear:
    """A table target whose verify costs can turn dear (rows squared) between requests."""

    def __init__(self):
        from helpers.table_model import TableRunner

        class Timed(TableRunner):
            dear = False

            def forward(self, seq_id, tokens, start, num_logits):
                import time
                time.sleep(0.0005 * len(tokens) ** (2 if Timed.dear else 1))
                return super().forward(seq_id, tokens, start, num_logits)

        self.cls = Timed


def test_a_seeded_request_drafts_by_the_policy_as_built_not_by_learnt_timings():
    """k: auto learns costs from greedy requests' timings; a seeded sampled request whose
    drafts carry a distribution (a draft model's) has its draws used as its draft lengths
    say, so it drafts by the policy as built."""
    from hetero_sd.drafting import ModelDrafter
    from hetero_sd.engine import Engine
    from hetero_sd.sampling import SamplingParams
    from hetero_sd.scheduler import AdaptiveDraftLength
    from helpers.table_model import TableRunner

    timed = _Dear().cls
    prompt, seeded = [0, 1, 2, 0, 1, 2, 0, 1], SamplingParams(1.0, seed=9)
    drafter = ModelDrafter(TableRunner(4, seed=0, noise=0.3, noise_seed=2), 4)
    engine = Engine(timed(4, seed=0), drafter, policy=AdaptiveDraftLength(6))
    first = engine.generate_ids(prompt, 32, sampling=seeded)
    before = engine.policy.round_cost().verify(7) / engine.policy.round_cost().verify(1)
    timed.dear = True
    try:
        for _ in range(3):  # greedy requests teach dear wide verifies
            engine.generate_ids(prompt, 32)
    finally:
        timed.dear = False
    after = engine.policy.round_cost().verify(7) / engine.policy.round_cost().verify(1)
    assert after > 2 * before  # (the scenario has teeth: the engine's policy learnt other costs)
    again = engine.generate_ids(prompt, 32, sampling=seeded)
    assert (again.token_ids, again.stats.drafted) == (first.token_ids, first.stats.drafted)


def test_a_seeded_request_gates_a_hybrid_s_head_on_its_own_rounds():
    """A gated head (min_head_rate) is picked by running rates learnt across requests;
    a seeded sampled request gates on rates of its own, so earlier requests change nothing."""
    from hetero_sd.drafting import ModelDrafter
    from hetero_sd.drafting.hybrid import HybridDrafter
    from hetero_sd.engine import Engine
    from hetero_sd.sampling import Sampler, SamplingParams
    from helpers.table_model import TableRunner

    hybrid = HybridDrafter(SuffixDrafter(), ModelDrafter(TableRunner(4, seed=3, noise=0.8, noise_seed=1), 4),
                           min_match=3, min_head_rate=0.35)
    engine = Engine(TableRunner(4, seed=0), hybrid, k=3)
    prompt, seeded = [0, 1, 2, 3, 1], SamplingParams(1.0, seed=4)
    first = engine.generate_ids(prompt, 32, sampling=seeded)
    rates = dict(hybrid.rate)
    for n in range(6):  # greedy requests move the engine's running rates
        engine.generate_ids([n % 4, 2, 1, 3, 0], 32)
    assert hybrid.rate != rates
    engine_rates, engine_rounds = dict(hybrid.rate), hybrid._rounds
    again = engine.generate_ids(prompt, 32, sampling=seeded)
    assert (again.token_ids, again.stats.drafted) == (first.token_ids, first.stats.drafted)
    assert hybrid._engine_gate is None  # the engine's rates are back, untouched by the seeded request
    assert (hybrid.rate, hybrid._rounds) == (engine_rates, engine_rounds)
    # a fork made while the engine's own seeded request runs starts from the engine's rates
    hybrid.begin(64, sampler=Sampler(seeded))
    fork = hybrid.fork()
    assert fork.rate == engine_rates and fork.rate is not engine_rates and fork._engine_gate is None
    hybrid.reset()
    assert hybrid.rate == engine_rates


def test_batched_requests_fork_the_drafter_and_share_its_global_tree(tiny_model_dir):
    """The batching server forks the drafter per request: every output equals
    target-only, the forks' outputs join the one global tree, and a prompt that
    arrives after its twin finished drafts from the twin's output."""
    import threading

    from hetero_sd.backends.registry import discover
    from hetero_sd.engine import Engine
    from hetero_sd.ir import load_model_ir
    from hetero_sd.serve.batch import BatchEngine, Submission
    from helpers.tiny_models import make_tokenizer

    target = discover().get("onnxruntime").load(load_model_ir(tiny_model_dir("llama")), "cpu", "fp32", 8 << 20)
    drafter = SuffixDrafter()
    engine = Engine(target, drafter, k=4, tokenizer=make_tokenizer())
    prompts = _prompts(4, seed=21)

    def serve(requests):
        batch, done = BatchEngine(engine, max_running=8, max_waiting=16).start(), []
        try:
            for req in requests:
                finished, events = threading.Event(), []
                batch.submit(req, lambda e, f=finished, ev=events: (ev.append(e), e.finish_reason and f.set()))
                done.append((finished, events))
            for finished, _ in done:
                assert finished.wait(120)
        finally:
            batch.shutdown(drain_s=60)
        return [events[-1].result for _, events in done]

    first = serve([Submission(p, 20) for p in prompts])
    assert len(drafter.global_tree.order) == 4  # every fork's output joined the shared tree
    again = serve([Submission(p, 20) for p in prompts])
    for prompt, a, b in zip(prompts, first, again):
        want = engine.generate_ids(prompt, 20, target_only=True).token_ids
        assert a.token_ids == b.token_ids == want
    assert sum(r.stats.accepted for r in again) > sum(r.stats.accepted for r in first)
