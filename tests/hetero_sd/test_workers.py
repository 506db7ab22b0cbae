"""Drafters in worker processes (hetero_sd/drafting/remote.py): lossless over every
transport and mode, sampling state and distributions that cross processes,
and failures (kill -9, hangs, malformed replies, load errors) that cost speed
but never output, and never leave a shared-memory segment behind."""
from __future__ import annotations

import os
import random
import signal
import time

import numpy as np
import pytest

from hetero_sd.backends.torch_backend import TorchBackend
from hetero_sd.config import load_config
from hetero_sd.drafting import ModelDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import ConfigError, ModelLoadError
from hetero_sd.ir import DraftRequest, load_model_ir
from hetero_sd.sampling import SamplingParams
from hetero_sd.transport.segment import SHM_DIR
from hetero_sd.drafting.specs import ModelSpec, NgramSpec
from hetero_sd.drafting.worker import Lookahead
from hetero_sd.drafting.wire import AHEAD, FRESH
from hetero_sd.drafting.remote import RemoteDrafter
from helpers.drafters import ProxyDrafter, kill_at_random_points
from helpers.near import YAML as NEAR_YAML, near_spec
from helpers.tiny_models import random_prompt
from helpers.workers import FaultSpec, remote as make_remote

BUDGET = 4 << 20


def our_segments() -> list[str]:
    """Shared-memory segments this test process created and has not unlinked."""
    if not os.path.isdir(SHM_DIR):
        return []
    return [n for n in os.listdir(SHM_DIR) if n.startswith("hsd-") and f"-{os.getpid()}-" in n]


@pytest.fixture(scope="module")
def paths(tiny_model_dir):
    return {"target": tiny_model_dir("llama"), "other": tiny_model_dir("llama", seed=1)}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module")
def target(paths):
    return TorchBackend().load(load_model_ir(paths["target"]), "cpu", "fp32", BUDGET)


PROMPTS = [(random_prompt(6, seed=50), 18), (random_prompt(17, seed=51), 24)]


@pytest.fixture(scope="module")
def baselines(target):
    return [expected(target, prompt, new) for prompt, new in PROMPTS]


@pytest.fixture
def remote(target):
    """Factory for RemoteDrafters that are closed (and checked for leaks) after the test."""
    made = []

    def make(spec, **kw) -> RemoteDrafter:
        kw.setdefault("threads", 1)  # two OpenMP threads per process thrash a busy 2-core host
        kw.setdefault("timeout_s", 30.0)
        drafter = make_remote(spec, target.vocab_size, **kw)
        made.append(drafter)
        return drafter

    yield make
    for drafter in made:
        drafter.close()
    assert our_segments() == []


def model_spec(path, precision="fp32") -> ModelSpec:
    return ModelSpec(str(path), "torch", "cpu", precision, BUDGET)


def expected(target, prompt, new):
    return Engine(target, None).generate_ids(prompt, new, target_only=True).token_ids


# ------------------------------------------------------------------ lossless
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("transport", ["inproc", "shm", "tcp", "pipe"])
def test_remote_model_drafter_is_lossless(target, paths, remote, baselines, transport, mode):
    drafted = accepted = 0
    for draft in ("target", "other"):  # mostly accepted / mostly rejected (rollbacks)
        drafter = remote(near_spec(paths[draft], BUDGET) if draft == "target" else model_spec(paths[draft]),
                         transport=transport, mode=mode)
        for k in (2, 5):
            engine = Engine(target, drafter, k=k)
            for (prompt, new), want in zip(PROMPTS, baselines):
                got = engine.generate_ids(prompt, new)
                assert got.token_ids == want, f"{draft} k={k} prompt of {len(prompt)}"
                assert got.stats.events == []
                drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
        assert drafter.stats.starts == 1  # one model load serves every request
        assert drafter.stats.rounds == drafter.stats.fresh + drafter.stats.partial + drafter.stats.ahead
    assert 0 < accepted < drafted


def test_remote_ngram_drafter_is_lossless(target, remote):
    drafter = remote(NgramSpec(1, 3), transport="shm", mode="async")
    engine = Engine(target, drafter, k=4)
    for seed in range(3):
        head = random_prompt(9, seed=seed)
        prompt = head + head
        got = engine.generate_ids(prompt, 30)
        assert got.token_ids == expected(target, prompt, 30) and got.stats.drafted > 0


class _SlowTarget:
    """The target with a pause in every call, so a worker has time to draft ahead."""

    def __init__(self, runner, pause_s):
        self._runner, self._pause = runner, pause_s

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def greedy(self, *args):
        time.sleep(self._pause)
        return self._runner.greedy(*args)


def test_async_serves_rounds_from_pre_drafted_tokens(target, paths, remote):
    drafter = remote(near_spec(paths["target"], BUDGET), transport="shm", mode="async")
    engine = Engine(_SlowTarget(target, 0.05), drafter, k=3)
    prompt = random_prompt(10, seed=7)
    got = engine.generate_ids(prompt, 40)
    assert got.token_ids == expected(target, prompt, 40)
    st = drafter.stats
    assert st.ahead > 0 and st.ahead_s > 0, st  # a cheaper copy of the target: most drafts are kept
    assert st.rounds == st.fresh + st.partial + st.ahead
    assert got.stats.rounds - 1 <= st.rounds <= got.stats.rounds  # the last round may draft nothing


@pytest.mark.parametrize("transport", ["inproc", "pipe"])
def test_a_worker_reports_its_catch_up(target, paths, remote, transport):
    """A draft model in a worker takes in the prompt with its first draft: that call's
    seconds come back in the round's record (Round.catch_up_s), as in process; a steady round's are 0."""
    from hetero_sd.scheduler import Round

    drafter = remote(model_spec(paths["target"]), transport=transport, mode="sync")
    drafter.begin(64)
    prompt = random_prompt(17, seed=51)
    first_round, steady_round = Round(), Round()
    first = drafter.draft(DraftRequest(0, 0, 3, prompt), first_round)
    assert len(first.tokens) == 3 and 0 < first_round.catch_up_s <= drafter.stats.compute_s
    ctx = prompt + first.tokens + [0]  # all accepted, and a bonus token
    steady = drafter.draft(DraftRequest(0, len(prompt), 3, ctx[len(prompt):]), steady_round)
    assert len(steady.tokens) == 3 and steady_round.catch_up_s == 0.0
    drafter.reset()


def test_a_reply_claiming_more_catch_up_than_compute_is_refused():
    from hetero_sd.drafting.wire import DRAFT, OK, Reply, decode_reply, encode_reply
    from hetero_sd.transport import CorruptRecord

    class Plain:  # a transport channel without an arena or side tensors
        tx_arena = rx_arena = None

        @staticmethod
        def take_tensor():
            return None

    good = Reply(OK, DRAFT, b"", FRESH, compute_s=0.5, catch_up_s=0.25)
    assert decode_reply(Plain, encode_reply(Plain, good), 8).catch_up_s == 0.25
    with pytest.raises(CorruptRecord, match="catch-up"):
        decode_reply(Plain, encode_reply(Plain, Reply(OK, DRAFT, b"", FRESH, compute_s=0.5, catch_up_s=0.75)), 8)


def test_lookahead_answers_equal_synchronous_drafts(paths):
    """The async path answers every request with exactly the tokens a synchronous
    drafter would give, across accepted rounds (served ahead) and rejections
    (rolled back), however far it drafted ahead in between."""
    def load():
        return TorchBackend().load(load_model_ir(paths["other"]), "cpu", "fp32", BUDGET)

    sync, ahead = ModelDrafter(load(), 384), ModelDrafter(load(), 384)
    sync.begin(128)
    ahead.begin(128)
    look, rng = Lookahead(ahead, 128, lookahead=None, step=1), random.Random(3)
    context, synced, sources = random_prompt(8, seed=9), 0, []
    while len(context) < 100:
        k = rng.randint(1, 5)
        req = DraftRequest(0, synced, k, context[synced:])
        ref = sync.draft(DraftRequest(0, synced, k + 1, context[synced:])).tokens  # + the bonus guess
        got, source = look.answer(req)
        assert got == ref[:k], f"at {len(context)} tokens"
        sources.append(source)
        for _ in range(rng.randint(0, 6)):  # the time the target takes to verify
            if look.pending:
                look.extend(look.bound)
        synced = len(context)
        if rng.random() < 0.6:  # every draft kept, and the bonus is the guessed one
            context += ref
        else:
            a = rng.randint(0, k - 1)
            context += ref[:a] + [(ref[a] + 1 + rng.randint(0, 300)) % 384]
    assert {AHEAD, FRESH} <= set(sources)


# ------------------------------------------------------------------ sampling
class _Recorder(ProxyDrafter):
    """A drafter proxy that keeps a copy of every proposal and where its rows lived."""

    def __init__(self, inner):
        super().__init__(inner)
        self.calls = []

    def seen(self, req, result):
        probs = result.probs
        self.calls.append((list(result.tokens), None if probs is None else np.array(probs),
                           None if probs is None else probs.__array_interface__["data"][0]))
        return result


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sampled_drafts_match_an_in_process_drafter(target, paths, remote, transport):
    spec = model_spec(paths["other"])
    params = SamplingParams(0.9, top_k=40, top_p=0.95, seed=11)
    prompt = random_prompt(12, seed=3)
    local = _Recorder(ModelDrafter(TorchBackend().load(load_model_ir(paths["other"]), "cpu", "fp32", BUDGET),
                                   target.vocab_size))
    want = Engine(target, local, k=4).generate_ids(prompt, 30, sampling=params)
    drafter = remote(spec, transport=transport, mode="async")  # async falls back to sync under sampling
    rec = _Recorder(drafter)
    engine = Engine(target, rec, k=4)
    got = engine.generate_ids(prompt, 30, sampling=params)
    assert got.token_ids == want.token_ids and got.stats.events == []
    assert len(rec.calls) == len(local.calls) > 3
    arena = drafter._w.channel.rx_arena
    for (tokens, probs, address), (l_tokens, l_probs, _) in zip(rec.calls, local.calls):
        assert tokens == l_tokens
        assert probs.shape == (len(tokens), target.vocab_size) and probs.dtype == np.float64
        np.testing.assert_array_equal(probs, l_probs)
        if transport == "shm":  # a view of the shared arena, not a copy
            assert arena.base_address <= address < arena.base_address + arena.n_regions * arena.stride
    assert drafter.stats.ahead == drafter.stats.partial == 0 and drafter.stats.ahead_s == 0
    again = engine.generate_ids(prompt, 30, sampling=params)
    assert again.token_ids == got.token_ids  # a seed reproduces the run
    other = engine.generate_ids(prompt, 30, sampling=SamplingParams(0.9, top_k=40, top_p=0.95, seed=12))
    assert other.token_ids != got.token_ids


# ------------------------------------------------------------------ failures
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_kill_9_at_random_points(target, paths, remote, mode):
    """20 runs, each with the worker SIGKILLed at a random draft call: every
    output equals the undisturbed run, and no segment outlives its worker."""
    drafter = remote(near_spec(paths["target"], BUDGET), transport="shm", mode=mode)

    def only_a_live_workers_channel():
        assert len(our_segments()) <= 1

    kill_at_random_points(target, drafter, 20, seed=1234, after_run=only_a_live_workers_channel)
    drafter.begin(64)
    drafter.reset()
    assert drafter.stats.starts == 21  # every killed worker was replaced at the next request
    drafter.close()
    assert our_segments() == []


@pytest.mark.parametrize("kind, after", [("exit", 0), ("exit", 3), ("hang", 1), ("hang", 4),
                                         ("malformed", 0), ("malformed", 2), ("error", 2)])
def test_dead_hung_or_malformed_worker_is_dropped(target, paths, remote, kind, after):
    drafter = remote(near_spec(paths["target"], BUDGET), transport="shm", timeout_s=0.5,
                     fault=FaultSpec(after=after, kind=kind))
    engine = Engine(target, drafter, k=3)
    prompt = random_prompt(9, seed=5)
    got = engine.generate_ids(prompt, 24)
    assert got.token_ids == expected(target, prompt, 24)
    failures = [e for e in got.stats.events if "failed" in e]
    assert len(failures) == 1, got.stats.events
    errors = {"exit": ("PeerClosed", "exited"), "hang": ("TransportTimeout",), "malformed": ("CorruptRecord",),
              "error": ("injected worker failure",)}[kind]
    assert any(e in failures[0] for e in errors), failures[0]
    assert drafter.pid is None and our_segments() == []  # killed, channel closed, segment unlinked
    assert got.stats.drafted == 3 * after  # rounds before the fault kept their drafts


def test_a_failed_worker_is_replaced_at_the_next_request(target, paths, remote):
    drafter = remote(near_spec(paths["target"], BUDGET), transport="tcp")
    engine = Engine(target, drafter, k=3)
    prompt = random_prompt(9, seed=6)
    engine.generate_ids(prompt, 10)
    first = drafter.pid
    os.kill(first, signal.SIGKILL)
    got = engine.generate_ids(prompt, 20)
    assert got.stats.events == [] and got.stats.drafted > 0  # restarted in begin, before any draft
    assert drafter.pid != first and drafter.stats.starts == 2


def test_load_errors_are_reported_as_such(target, paths, remote, tmp_path):
    missing = remote(model_spec(tmp_path / "nope"), transport="shm")
    with pytest.raises(ModelLoadError, match="does not exist"):  # the worker's error, as that class
        missing.wait_ready()
    small = remote(NgramSpec(3, 2), transport="pipe")  # min_ngram > max_ngram
    with pytest.raises(ConfigError, match="min_ngram"):
        small.wait_ready()
    assert our_segments() == []
    # As a drafter, a worker that cannot start is dropped: the target carries on.
    engine = Engine(target, missing, k=3)
    prompt = random_prompt(8, seed=2)
    got = engine.generate_ids(prompt, 8)
    assert got.token_ids == expected(target, prompt, 8) and "failed" in got.stats.events[0]


def test_bad_options_are_config_errors(target):
    for kw, word in (({"transport": "udp"}, "transport"), ({"mode": "eager"}, "mode"),
                     ({"timeout_s": 0}, "timeouts")):
        with pytest.raises(ConfigError, match=word):
            make_remote(NgramSpec(), target.vocab_size, start=False, **kw)


# ------------------------------------------------------------------ YAML
def _yaml(tmp_path, model, drafter: str):
    path = tmp_path / "w.yaml"
    path.write_text(f"target: {{model: {model}, precision: fp32}}\n"
                    f"drafter: {drafter}\n"
                    "memory: {kv_budget: 4MiB}\ngeneration: {max_new_tokens: 16, chat_template: false}\n")
    return path


def test_yaml_worker_drafter_builds_and_is_lossless(paths, tmp_path):
    cfg = load_config(_yaml(tmp_path, paths["target"], f"{{kind: model, {NEAR_YAML}, k: 3, process: worker, "
                                                        "transport: tcp, mode: async, threads: 1}"))
    engine = Engine.from_config(cfg)
    try:
        assert isinstance(engine.drafter, RemoteDrafter) and engine.drafter.mode == "async"
        prompt = random_prompt(10, seed=4)
        got = engine.generate_ids(prompt, 16)
        assert got.token_ids == engine.generate_ids(prompt, 16, target_only=True).token_ids
        assert got.stats.drafted > 0 and got.stats.mode.endswith("@tcp-async")
    finally:
        engine.drafter.close()


@pytest.mark.parametrize("drafter, words", [
    ("{kind: model, mode: async}", ["drafter.mode", "process: worker"]),
    ("{kind: ngram, transport: tcp}", ["drafter.transport", "process: worker"]),
    ("{kind: none, process: worker}", ["drafter.process", "ngram or model"]),
    ("{kind: model, process: worker, transport: udp}", ["drafter.transport", "'shm'", "'tcp'", "'pipe'"]),
    ("{kind: model, process: worker, timeout_s: 0}", ["drafter.timeout_s", "greater than 0"]),
    ("{kind: model, process: worker, stages: [{precision: fp32, process: worker}]}",
     ["drafter.process: worker inside the worker of drafter.stages.0"]),
])
def test_yaml_worker_errors_name_the_key(paths, tmp_path, drafter, words):
    with pytest.raises(ConfigError) as err:
        load_config(_yaml(tmp_path, paths["target"], drafter))
    for word in words:
        assert word in str(err.value)


def test_cpus_split_the_cores_between_worker_and_target(paths, tmp_path):
    """drafter.cpus: the worker runs on those CPUs and this process (the
    target) on the others; the output is still the target's own."""
    import os

    mine = os.sched_getaffinity(0)
    if len(mine) < 2:
        pytest.skip("one CPU: nothing to split (the error path is tested below)")
    worker_cpu = max(mine)
    cfg = load_config(_yaml(tmp_path, paths["target"], f"{{kind: model, {NEAR_YAML}, k: 3, process: worker, "
                                                        f"cpus: [{worker_cpu}]}}"))
    engine = Engine.from_config(cfg)
    try:
        assert os.sched_getaffinity(0) == mine - {worker_cpu}
        assert os.sched_getaffinity(engine.drafter.pid) == {worker_cpu}
        prompt = random_prompt(10, seed=6)
        assert engine.generate_ids(prompt, 16).token_ids == \
            engine.generate_ids(prompt, 16, target_only=True).token_ids
    finally:
        engine.drafter.close()
        os.sched_setaffinity(0, mine)


def test_cpus_that_leave_the_target_nothing_are_refused(paths, tmp_path):
    import os

    mine = sorted(os.sched_getaffinity(0))
    for cpus, words in ((mine, "leave no CPU for the target"), ([max(mine) + 64], "not all available")):
        cfg = load_config(_yaml(tmp_path, paths["target"], f"{{kind: model, {NEAR_YAML}, process: worker, "
                                                            f"cpus: {cpus}}}"))
        with pytest.raises(ConfigError, match=words):
            Engine.from_config(cfg)
        assert sorted(os.sched_getaffinity(0)) == mine
    with pytest.raises(ConfigError, match="drafter.cpus applies to a drafter in its own process"):
        load_config(_yaml(tmp_path, paths["target"], "{kind: model, cpus: [0]}"))
