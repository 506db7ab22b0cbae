"""Drafting round r+1 while round r verifies (scheduler/overlap.py, hetero_sd/ahead.py).

Lossless first: greedy output equals target-only for every drafter kind and
k = 1..8 with the overlap forced on (scheduler.overlap: on runs the pre-draft
path on any target, this host's synchronous ones included), and sampled output
keeps the target's distribution (chi-square on the 4-token table model, as
tests/hetero_sd/test_sampling.py). Then the fake backend's asynchronous device:
submit returns before the device is done, the overlap is decided as auto says
and hides drafting; a failure inside a submitted verify moves the target and
loses nothing. The rollback across devices: after every round the target's
cache holds the history but its newest token, the drafter's at least that with
the overlap (one less without it: the last draft is never fed to it).
"""
from __future__ import annotations

import numpy as np
import pytest

from hetero_sd.drafting import ModelDrafter, NgramDrafter, SuffixDrafter
from hetero_sd.drafting.base import common_prefix
from hetero_sd.drafting.cascade import CascadeDrafter
from hetero_sd.drafting.hybrid import HybridDrafter
from hetero_sd.drafting.specs import NgramSpec
from hetero_sd.engine import Engine
from hetero_sd.failover import RankedFallback
from hetero_sd.ir import load_model_ir
from hetero_sd.ir.work import DraftRequest, DraftResult
from hetero_sd.sampling import SamplingParams
from hetero_sd.testing.controlled import ControlledDrafter
from hetero_sd.testing.fake_backend import FakeBackend, FakeCosts, FakeDeviceSpec, FakeFailure
from helpers.table_model import TableRunner, chi_square_p, exact_joint
from helpers.tiny_models import random_prompt
from helpers.workers import remote

V = 12
PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 7, 1, 2]  # repeats, so lookups draft too


class _ReadsFeatures(NgramDrafter):
    """Declares a head's need (the target's hidden states): it cannot pre-draft."""
    feature_layers = (0,)


def _drafter(kind: str):
    noisy = lambda seed: TableRunner(V, seed=0, noise=0.6, noise_seed=seed)  # noqa: E731
    return {"ngram": lambda: NgramDrafter(1, 3),
            "suffix": lambda: SuffixDrafter(),
            "model": lambda: ModelDrafter(noisy(7), V),
            "model-same": lambda: ModelDrafter(TableRunner(V, seed=0), V),
            "hybrid": lambda: HybridDrafter(SuffixDrafter(), ModelDrafter(noisy(5), V), min_match=2,
                                            min_head_rate=None),
            "cascade": lambda: CascadeDrafter(ModelDrafter(noisy(3), V), TableRunner(V, seed=0, noise=0.2), V, k=3),
            "head": lambda: _ReadsFeatures(1, 3),
            "worker": lambda: remote(NgramSpec(1, 3), V, transport="inproc")}[kind]()


class _TargetArgmax(NgramDrafter):
    """A one-hot drafter (q one-hot: probs None) of the table target's own argmax tokens, so
    sampled rounds accept often and pre-drafts hit."""

    def __init__(self, table: TableRunner):
        super().__init__(1, 1)
        self.table = table

    def draft(self, req, rnd=None):
        ctx, out = list(self.context_for(req)), []
        for _ in range(req.k):
            out.append(int(np.argmax(self.table.logits_for(ctx + out))))
        return DraftResult(req.seq_id, out)


KINDS = ["ngram", "suffix", "model", "model-same", "hybrid", "cascade", "head", "worker"]


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equals_target_only_for_every_drafter_and_k(kind):
    target = TableRunner(V, seed=0)
    expected = Engine(target, None).generate_ids(PROMPT, 40, target_only=True).token_ids
    predrafted = hits = 0
    for k in range(1, 9):
        drafter = _drafter(kind)
        engine = Engine(target, drafter, k=k, overlap="on")
        try:
            got = engine.generate_ids(PROMPT, 40)
        finally:
            engine.close()
        assert got.token_ids == expected, f"{kind} k={k}"
        predrafted += got.stats.predraft_s > 0
        hits += got.stats.predraft_hits
    decision = Engine(target, _drafter("head" if kind == "head" else "ngram"), overlap="on").overlap()
    if kind == "head":  # drafts from the verify's hidden states: serial, and said why
        assert not decision.on and "hidden states" in decision.why and predrafted == 0
    else:
        assert decision.on and predrafted == 8, f"{kind}: pre-drafted in {predrafted} of 8 runs"
    if kind == "model-same":  # the target drafting for itself: round r+1's drafts were ready
        assert hits > 20


SETTINGS = [SamplingParams(1.0), SamplingParams(1.3, top_k=3, top_p=0.9)]


@pytest.mark.parametrize("params", SETTINGS, ids=SamplingParams.describe)
@pytest.mark.parametrize("kind", ["model", "one-hot"])
def test_sampled_output_keeps_the_target_distribution(params, kind):
    target, prompt, new, n = TableRunner(4, seed=0), [0, 1, 2, 0, 1], 6, 3000
    drafter = ModelDrafter(TableRunner(4, seed=0, noise=0.8, noise_seed=7), 4) if kind == "model" \
        else _TargetArgmax(target)
    engine = Engine(target, drafter, k=2, overlap="on")
    counts, hits = {}, 0
    for seed in range(n):
        res = engine.generate_ids(prompt, new, sampling=SamplingParams(params.temperature, params.top_k,
                                                                       params.top_p, seed))
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        hits += res.stats.predraft_hits
    assert chi_square_p(counts, exact_joint(target, params, prompt, new), n) > 1e-3
    assert hits > 100  # pre-drafted drafts were verified, not only drawn


def _fake(ir, asynchronous=True, verify_s=0.0, failure=None, device="fake:0"):
    costs = FakeCosts(decode_per_token_s=verify_s, verify_base_s=verify_s)
    spec = FakeDeviceSpec(device=device, costs=costs, asynchronous=asynchronous, failure=failure)
    return FakeBackend(devices=[spec], simulate_time=verify_s > 0).load(ir, device, "fp32", 4 << 20)


@pytest.fixture(scope="module")
def ir(tiny_model_dir):
    return load_model_ir(tiny_model_dir("llama"))


def test_the_asynchronous_fake_device_returns_before_it_is_done(ir):
    slow, plain = _fake(ir, verify_s=1.0), _fake(ir, asynchronous=False)
    prompt = random_prompt(12, seed=1)
    a, b = slow.allocate(32), plain.allocate(32)
    slow.greedy(a, prompt, 0, 1), plain.greedy(b, prompt, 0, 1)
    pending = slow.submit(a, [5, 6, 7], 12, 3)
    assert pending.done_at is None  # the device still sleeps its declared 1 s
    assert pending.wait() == plain.greedy(b, [5, 6, 7], 12, 3) and pending.done_at is not None
    assert plain.submit(b, [8], 15, 1).done_at is not None  # a synchronous runner's is done at once


def test_auto_overlaps_an_asynchronous_target_with_a_drafter_elsewhere(ir):
    prompt = random_prompt(12, seed=2)
    target = _fake(ir, verify_s=0.05)
    oracle = Engine(target, None).generate_ids(prompt, 24, target_only=True).token_ids
    drafter = ControlledDrafter(prompt, oracle, target.vocab_size, a=0.9, step_s=0.002)
    engine = Engine(target, drafter, k=3)  # overlap: auto
    assert engine.overlap().on, engine.overlap().why
    got = engine.generate_ids(prompt, 24)
    assert got.token_ids == oracle
    st = got.stats
    assert st.predraft_hits > 0 and st.hidden_draft_s > 0 and "of drafting hidden" in st.summary()
    # the same drafter declared on the target's device, or a synchronous target: serial, said why
    same = Engine(target, ControlledDrafter(prompt, oracle, 512, 0.9, device="fake:0"), k=3).overlap()
    sync = Engine(_fake(ir, asynchronous=False), drafter, k=3).overlap()
    assert not same.on and "share fake:0" in same.why
    assert not sync.on and "synchronous" in sync.why
    off = Engine(target, drafter, k=3, overlap="off")
    assert not off.overlap().on and off.generate_ids(prompt, 24).stats.predraft_s == 0


@pytest.mark.parametrize("after", [1, 4, 9])
def test_a_failure_inside_a_submitted_verify_loses_nothing(ir, after):
    prompt = random_prompt(12, seed=3)
    healthy = _fake(ir, asynchronous=False, device="fake:1")
    expected = Engine(healthy, None).generate_ids(prompt, 24, target_only=True).token_ids
    failing = _fake(ir, failure=FakeFailure(after_calls=after, kind="runtime_error"))
    fallback = RankedFallback(targets=[("fake:1", lambda: _fake(ir, asynchronous=False, device="fake:1"))])
    engine = Engine(failing, NgramDrafter(1, 3), k=4, fallback=fallback, overlap="on")
    got = engine.generate_ids(prompt, 24)
    assert got.token_ids == expected and any("target moved" in e for e in got.stats.events)


def test_a_worker_killed_during_a_pre_draft_loses_nothing(ir):
    """A drafter worker (its own process, shm) SIGKILLed at random draft calls, pre-drafts
    during an asynchronous verify among them: every output equals the undisturbed run."""
    from helpers.drafters import kill_at_random_points

    target = _fake(ir)
    drafter = remote(NgramSpec(1, 3), target.vocab_size, transport="shm")
    try:
        kill_at_random_points(target, drafter, runs=4, seed=5, overlap="on")
    finally:
        drafter.close()


@pytest.mark.parametrize("draft", ["same", "other"])  # every draft accepted / most rejected
@pytest.mark.parametrize("overlap", ["on", "off"])
def test_rollback_across_devices_off_by_one(ir, tiny_model_dir, overlap, draft):
    """Target on the asynchronous fake device, a draft model on the torch CPU runner: after
    each round the target's cache holds every committed token but the newest (it is fed
    with the next step); the draft cache shares at least that prefix with the overlap (the
    pre-draft fed round r's last draft), one token less without it (a round's last draft is
    proposed, never fed to the drafter), and both end equal to target-only's output."""
    from hetero_sd.backends.torch_backend import TorchBackend

    prompt = random_prompt(12, seed=4)
    target = _fake(ir)
    expected = Engine(target, None).generate_ids(prompt, 30, target_only=True).token_ids
    source = ir.source if draft == "same" else tiny_model_dir("llama", seed=1)
    draft_runner = TorchBackend().load(load_model_ir(source), "cpu", "fp32", 4 << 20)
    drafter = ModelDrafter(draft_runner, target.vocab_size)
    engine = Engine(target, drafter, k=4, overlap=overlap)
    req = engine.request(prompt, 30)
    slack = 0 if overlap == "on" else 1
    done, rounds = req.start(), 0
    while not done:
        step = req.propose()
        done = req.accept(step, req.verify(step))
        rounds += 1
        n = len(req.history.ids)
        if not done:
            assert engine.target_runner.length(req.seq) == n - 1
            assert common_prefix(drafter._cached, req.history.ids) >= n - 1 - slack
    assert req.close().token_ids == expected
    assert rounds < 30 if draft == "same" else req.stats.drafted > req.stats.accepted


def test_ngram_rollback_undoes_its_index():
    """A rollback past a pre-draft's tokens undoes the index writes: the same drafts as an
    index built afresh over the rolled-back context, at every rollback depth."""
    rng = np.random.default_rng(0)
    ctx = [int(t) for t in rng.integers(0, 6, 60)]
    for cut in range(1, 30):
        rolled, fresh = NgramDrafter(1, 3), NgramDrafter(1, 3)
        rolled.draft(DraftRequest(0, 0, 4, ctx[:40] + ctx[:cut], context=ctx[:40] + ctx[:cut]))
        keep = ctx[:40 - cut % 7] + [int(t) for t in rng.integers(0, 6, 5)]
        a = rolled.draft(DraftRequest(0, 40 - cut % 7, 4, keep[40 - cut % 7:], context=keep))
        b = fresh.draft(DraftRequest(0, 0, 4, keep, context=keep))
        assert a.tokens == b.tokens and rolled._index == fresh._index, cut


@pytest.mark.parametrize("overlap, says", [("off", "overlap: serial: scheduler.overlap is off"),
                                           ("auto", "overlap: serial: the target's runner on cpu is synchronous"),
                                           ("on", "overlap: on: scheduler.overlap is on")])
def test_explain_says_whether_rounds_overlap(tiny_model_dir, tmp_path, capsys, overlap, says):
    from hetero_sd.cli import main

    path = tmp_path / "c.yaml"
    path.write_text(f"target: {{model: {tiny_model_dir('llama')}, backend: torch}}\n"
                    f"drafter: {{kind: ngram}}\nscheduler: {{overlap: {overlap}}}\n")
    assert main(["generate", "--config", str(path), "--prompt", "hi", "-n", "4", "--explain"]) == 0
    assert says in capsys.readouterr().err


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs two CPUs")
@pytest.mark.parametrize("overlap, mode, threaded", [("auto", "sync", True), ("auto", "async", False),
                                                     ("off", "sync", False)])
def test_a_cpu_target_beside_a_pinned_worker_overlaps(tiny_model_dir, tmp_path, overlap, mode, threaded):
    """A synchronous CPU target with its drafter in a worker on a core of its own: auto runs the
    target's calls on a thread (ThreadedRunner) so the worker pre-drafts meanwhile; a worker
    drafting ahead by itself (mode async) keeps its lookahead; off stays serial. Output equals
    target-only's either way."""
    import os

    from hetero_sd.backends.threaded import ThreadedRunner

    cpu = max(os.sched_getaffinity(0))
    path = tmp_path / "c.yaml"
    path.write_text(f"target: {{model: {tiny_model_dir('llama')}, backend: torch}}\n"
                    f"drafter: {{kind: ngram, min_ngram: 1, max_ngram: 3, k: 3, process: worker, mode: {mode}, "
                    f"cpus: [{cpu}]}}\nscheduler: {{overlap: {overlap}}}\n")
    prompt = random_prompt(10, seed=9) * 2
    engine = Engine.from_config(path)
    try:
        assert isinstance(engine.target, ThreadedRunner) == threaded
        assert engine.overlap().on == threaded, engine.overlap().why
        got = engine.generate_ids(prompt, 24)
        assert got.token_ids == engine.generate_ids(prompt, 24, target_only=True).token_ids
        assert (got.stats.predraft_s > 0) == threaded
    finally:
        engine.close()


def test_generate_chat_and_serve_answer_alike_with_the_overlap():
    """The embedded model on the default config (its suffix drafter) with the overlap forced on:
    generate, a chat turn (a prefix-cached conversation) and the batching server give the
    target-only answer to the same conversation; two turns, so the chat's second reuses KV."""
    from hetero_sd.chat import ChatSession
    from hetero_sd.serve.batch import BatchEngine, Submission
    from serve.test_batch import _Collector

    engine = Engine.from_config(None, **{"scheduler.overlap": "on", "generation.max_new_tokens": 16})
    assert engine.overlap().on
    chat = ChatSession(engine, max_new_tokens=16)
    batch = BatchEngine(engine, max_running=2, max_waiting=4)
    batch.start()
    try:
        for text in ("Name three primary colors.", "And three secondary ones?"):
            said = chat.reply(text, lambda delta: None)
            ids = engine.encode_chat(chat.messages[:-1])
            alone = engine.generate_ids(ids, 16, target_only=True)
            spoken = engine.generate_ids(ids, 16)
            got = _Collector()
            batch.submit(Submission(ids, 16, speculate=True), got)
            assert got.done.wait(120)
            assert spoken.token_ids == alone.token_ids and spoken.stats.predraft_s > 0
            assert said == alone.text and got.result.token_ids == alone.token_ids, text
    finally:
        batch.shutdown(drain_s=30)
