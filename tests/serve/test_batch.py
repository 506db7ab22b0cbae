"""Continuous batching (hetero_sd/serve/batch.py) is lossless: every request's
output equals the same request run alone, whatever runs beside it, with mixed
prompt lengths, budgets, arrival times, greedy and seeded sampling, on the
torch and onnxruntime backends (both with a batched forward) and on a runner
without one (one call per sequence)."""
from __future__ import annotations

import random
import threading

import pytest

from hetero_sd.backends.registry import discover
from hetero_sd.drafting import NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.ir import load_model_ir
from hetero_sd.sampling import SamplingParams
from hetero_sd.serve.batch import BatchEngine, QueueFull, Submission
from hetero_sd.errors import GenerationError
from helpers.tiny_models import make_tokenizer, random_prompt

REGISTRY = discover()


def _engine(folder, backend="torch", precision="fp32", budget=8 << 20, drafter=True, device="cpu"):
    target = REGISTRY.get(backend).load(load_model_ir(folder), device, precision, budget)
    return Engine(target, NgramDrafter(1, 3) if drafter else None, k=4, tokenizer=make_tokenizer())


def _prompt(rng: random.Random, i: int) -> list[int]:
    """Grounded (a repeated stretch, so drafts are accepted) or open (random)."""
    n = rng.randint(3, 40)
    head = random_prompt(max(3, n // 2), seed=1000 + i)
    return (head + head)[:n] if i % 2 else random_prompt(n, seed=2000 + i)


class _Collector:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def __call__(self, event):
        self.events.append(event)
        if event.finish_reason is not None:
            self.done.set()

    @property
    def result(self):
        return self.events[-1].result


def _serve(engine, requests, max_running=32, stagger=3, gate=None):
    """Submit in waves of `stagger` (later waves arrive while earlier ones run)."""
    batch = BatchEngine(engine, max_running=max_running, max_waiting=64)
    if gate is not None:
        batch.gate = gate
    batch.start()
    collectors = []
    try:
        for i, req in enumerate(requests):
            c = _Collector()
            batch.submit(req, c)
            collectors.append(c)
            if i % stagger == stagger - 1:  # let this wave run a few steps before the next arrives
                steps = batch.steps
                while batch.steps < steps + 2 and not collectors[-1].done.is_set():
                    threading.Event().wait(0.005)
        for c in collectors:
            assert c.done.wait(120), "a request never finished"
    finally:
        batch.shutdown(drain_s=60)
    return batch, collectors


@pytest.mark.parametrize("backend,precision", [("torch", "fp32"), ("onnxruntime", "fp32"), ("onnxruntime", "int4")])
def test_batched_greedy_equals_solo_target_only(tiny_model_dir, backend, precision):
    engine = _engine(tiny_model_dir("llama"), backend, precision)
    rng = random.Random(5)
    requests = [Submission(_prompt(rng, i), rng.randint(4, 30)) for i in range(16)]
    batch, collectors = _serve(engine, requests)
    assert batch.steps < sum(r.max_new_tokens for r in requests)  # rounds were shared
    drafted = accepted = 0
    for req, c in zip(requests, collectors):
        solo = engine.generate_ids(req.prompt_ids, req.max_new_tokens, target_only=True)
        res = c.result
        assert res.token_ids == solo.token_ids
        assert res.stats.finish_reason == solo.stats.finish_reason
        # the stream adds up: its tokens and text are the result's
        assert [t for e in c.events for t in e.token_ids] == res.token_ids
        assert "".join(e.text for e in c.events) == res.text
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    assert drafted > 0 and 0 < accepted < drafted  # both accepted and rejected drafts ran


def test_batched_on_the_cuda_backend(tiny_model_dir):
    """The server's batches on the exact cuda target (its kernels interpreted here: a
    few short requests) equal each request alone."""
    from hetero_sd.backends.cuda.backend import interpreting

    engine = _engine(tiny_model_dir("qwen2"), "cuda", "fp32", device="cpu" if interpreting() else "cuda:0")
    rng = random.Random(7)
    requests = [Submission(_prompt(rng, i)[:12], rng.randint(3, 6)) for i in range(6)]
    batch, collectors = _serve(engine, requests, stagger=2)
    assert batch.steps < sum(r.max_new_tokens for r in requests)  # rounds were shared
    for req, c in zip(requests, collectors):
        assert c.result.token_ids == engine.generate_ids(req.prompt_ids, req.max_new_tokens,
                                                         target_only=True).token_ids


def test_seeded_sampling_reproduces_whatever_runs_beside_it(tiny_model_dir):
    engine = _engine(tiny_model_dir("llama"), "onnxruntime", "fp32")
    rng = random.Random(9)
    sampled = [Submission(_prompt(rng, i), 20, SamplingParams(temperature=0.9, top_k=20, seed=i)) for i in range(6)]
    alone = [_serve(engine, [r])[1][0].result.token_ids for r in sampled]
    others = [Submission(_prompt(rng, 50 + i), rng.randint(5, 25)) for i in range(10)]
    _, together = _serve(engine, sampled[:3] + others + sampled[3:], stagger=4)
    got = [c.result.token_ids for c in together[:3] + together[-3:]]
    assert got == alone
    # a target-only sampled request equals `generate --target-only` with the same seed
    plain = Submission(_prompt(rng, 99), 20, SamplingParams(temperature=0.8, seed=3), speculate=False)
    _, served = _serve(engine, [plain] + others[:4])
    solo = engine.generate_ids(plain.prompt_ids, 20, target_only=True, sampling=plain.sampling)
    assert served[0].result.token_ids == solo.token_ids


class _Always:
    """A speculation gate with a fixed verdict, recording what it was told."""

    def __init__(self, verdict: bool):
        self.verdict, self.seen = verdict, []

    def decide(self, batch: int) -> bool:
        return self.verdict

    def observe(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        self.seen.append((batch, drafted, tokens))


def test_the_gate_turns_greedy_drafting_off_not_sampled(tiny_model_dir):
    """Gate off: greedy requests run target-only rounds (no drafts) and still equal their solo
    output; seeded sampled requests keep drafting by their own policy and reproduce. Steps
    of two or more sequences are reported to the gate with the tokens they committed (a
    request stepped alone is not gated: a long companion keeps the others company)."""
    engine = _engine(tiny_model_dir("llama"), "onnxruntime", "fp32")
    rng = random.Random(11)
    companion = Submission(_prompt(rng, 0), 80)
    greedy = [Submission(_prompt(rng, 2 * i + 1), 20) for i in range(4)]  # grounded: drafts would be accepted
    sampled = [Submission(_prompt(rng, 2 * i + 1), 20, SamplingParams(temperature=0.9, top_k=20, seed=i))
               for i in range(2)]
    alone = [_serve(engine, [r])[1][0].result.token_ids for r in sampled]
    gate = _Always(False)
    _, collectors = _serve(engine, [companion] + greedy + sampled, stagger=8, gate=gate)
    assert len(collectors[0].result.token_ids) == 80  # it outlived the others
    for req, c in zip(greedy, collectors[1:5]):
        assert c.result.stats.drafted == 0
        assert c.result.token_ids == engine.generate_ids(req.prompt_ids, 20, target_only=True).token_ids
    assert [c.result.token_ids for c in collectors[5:]] == alone
    assert sum(c.result.stats.drafted for c in collectors[5:]) > 0
    assert gate.seen and all(batch > 1 and not drafted for batch, drafted, _ in gate.seen)
    assert 0 < sum(t for _, _, t in gate.seen) <= sum(len(c.result.token_ids) - 1 for c in collectors)
    on = _Always(True)
    _, collectors = _serve(engine, greedy, stagger=8, gate=on)
    assert sum(c.result.stats.drafted for c in collectors) > 0 and all(d for _, d, _ in on.seen)


def test_runner_without_batched_forward_is_served_one_call_per_sequence(tiny_model_dir):
    engine = _engine(tiny_model_dir("llama"), "openvino", "fp32")
    rng = random.Random(3)
    requests = [Submission(_prompt(rng, i), 12) for i in range(5)]
    _, collectors = _serve(engine, requests)
    for req, c in zip(requests, collectors):
        assert c.result.token_ids == engine.generate_ids(req.prompt_ids, 12, target_only=True).token_ids


def test_admission_errors_and_queue_bound(tiny_model_dir):
    engine = _engine(tiny_model_dir("llama"), budget=64 * 1024)
    batch = BatchEngine(engine, max_running=1, max_waiting=2)  # not started: requests stay queued
    cap = engine.target.usage().capacity_tokens
    with pytest.raises(GenerationError, match="empty"):
        batch.submit(Submission([], 5), _Collector())
    with pytest.raises(GenerationError, match="context"):
        batch.submit(Submission([1, 2, 3], engine.target.max_context), _Collector())
    with pytest.raises(GenerationError, match="pool"):
        batch.submit(Submission([1, 2, 3], cap), _Collector())
    batch.submit(Submission([1, 2, 3], 4), _Collector())
    batch.submit(Submission([1, 2, 3], 4), _Collector())
    with pytest.raises(QueueFull) as full:
        batch.submit(Submission([1, 2, 3], 4), _Collector())
    assert full.value.retry_after >= 1


def test_draft_model_forks_per_request(tiny_model_dir):
    """A draft model serves concurrent requests: each fork holds its own sequence
    in the shared draft runner, and outputs still equal target-only."""
    from hetero_sd.drafting import ModelDrafter

    folder = tiny_model_dir("llama")
    engine = _engine(folder, "onnxruntime", "fp32", drafter=False)
    draft_runner = REGISTRY.get("torch").load(load_model_ir(folder), "cpu", "fp32", 8 << 20)
    engine = Engine(engine.target, ModelDrafter(draft_runner, engine.target.vocab_size), k=3,
                    tokenizer=engine.tokenizer)
    rng = random.Random(11)
    requests = [Submission(_prompt(rng, i), rng.randint(5, 20)) for i in range(6)]
    _, collectors = _serve(engine, requests, gate=_Always(True))  # every step drafts: forks are the point
    for req, c in zip(requests, collectors):
        assert c.result.token_ids == engine.generate_ids(req.prompt_ids, req.max_new_tokens,
                                                         target_only=True).token_ids
        assert c.result.stats.accepted > 0  # the same weights draft: its drafts are accepted
    assert draft_runner.usage().sequences == 0  # every fork released its sequence


def test_constrained_requests_batched_equal_solo(tiny_model_dir):
    """Requests under a grammar (response_format) beside plain ones: each equals
    its constrained solo target-only output."""
    from hetero_sd.constraint import Constraint

    engine = _engine(tiny_model_dir("llama"), "onnxruntime", "fp32")
    schema = {"type": "object", "additionalProperties": False, "required": ["ok", "n"],
              "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}}}
    constraints = [Constraint.json_schema(schema), Constraint.regex(r"[a-z]{3}-[0-9]{2}"), None]
    rng = random.Random(13)
    requests = [Submission(_prompt(rng, i), 30, constraint=constraints[i % 3]) for i in range(9)]
    _, collectors = _serve(engine, requests)
    for req, c in zip(requests, collectors):
        solo = engine.generate_ids(req.prompt_ids, 30, target_only=True, constraint=req.constraint)
        assert c.result.token_ids == solo.token_ids
        assert c.result.stats.finish_reason == solo.stats.finish_reason
        if req.constraint is not None:
            assert c.result.stats.constraint


def test_prefix_cache_reuses_kv_exactly(tiny_model_dir):
    """Later prompts that begin like earlier ones (the same prompt again, a longer turn
    of it) copy the cached prefix; every output still equals its solo target-only one,
    also when the pool is so small that cached prefixes must be evicted to admit."""
    for budget, evicts in ((8 << 20, False), (None, True)):
        engine = _engine(tiny_model_dir("llama"), "onnxruntime", "fp32",
                         budget=budget or 4 * 90 * load_model_ir(tiny_model_dir("llama")).config.kv_bytes_per_token(4))
        firsts = [random_prompt(40, seed=700 + i) for i in range(4)]
        waves = [firsts, [p + random_prompt(5, seed=800 + i) for i, p in enumerate(firsts)] + firsts[:2]]
        # solo outputs first: the cache will hold pool room that a solo run would need
        solo = {tuple(p): engine.generate_ids(p, 12, target_only=True).token_ids for w in waves for p in w}
        batch = BatchEngine(engine, max_running=4, prefix_cache=8).start()
        cached = []
        try:
            for wave in waves:
                collectors = [_Collector() for _ in wave]
                for prompt, c in zip(wave, collectors):
                    batch.submit(Submission(prompt, 12), c)
                for prompt, c in zip(wave, collectors):
                    assert c.done.wait(120)
                    assert c.result.token_ids == solo[tuple(prompt)]
                    cached.append(c.result.stats.cached_tokens)
        finally:
            batch.shutdown()
        assert cached[:4] == [0, 0, 0, 0], cached
        if evicts:  # room for running requests came first: some prefixes were gone when asked for
            assert 0 < batch.prefix.hits < 6 and any(n >= 39 for n in cached[4:]), cached
        else:
            assert all(n >= 39 for n in cached[4:]) and batch.prefix.hits == 6, cached
        assert len(batch.prefix) == 0 and engine.target.usage().sequences == 0  # shutdown released them


def test_no_prefix_cache_where_the_copy_would_not_be_exact(tiny_model_dir):
    """torch's prefill takes shape-dependent fast kernels: no copy_prefix, no cache."""
    engine = _engine(tiny_model_dir("llama"), "torch", "fp32")
    assert BatchEngine(engine).prefix is None


def test_pricing_a_batch_leaves_the_engines_policy_alone(tiny_model_dir):
    """The server prices each speculating request's own copy of the draft-length
    policy; a request that does not speculate shares the engine's policy and must
    not reprice it (later generate() calls and forks would inherit the batch's costs)."""
    from hetero_sd.scheduler import AdaptiveDraftLength

    engine = _engine(tiny_model_dir("llama"))
    engine.policy = AdaptiveDraftLength(6)
    before = engine.policy.round_cost()
    rng = random.Random(3)
    requests = [Submission(_prompt(rng, i), 12, speculate=i % 2 == 0) for i in range(6)]
    _, collectors = _serve(engine, requests, gate=_Always(True))  # (the gate's own turns are not the point)
    assert all(c.events[-1].finish_reason in ("length", "eos") for c in collectors)
    assert any(c.result.stats.drafted for c in collectors)  # the speculating ones were priced and drafted
    assert engine.policy.round_cost() == before
