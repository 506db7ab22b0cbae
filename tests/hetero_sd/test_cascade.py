"""k-stage cascades (hetero_sd/drafting/cascade.py): a CascadeDrafter proposes its
intermediate model's greedy continuation, computed by speculative decoding of
the stage inside it. Lossless at every depth, with stages in-process or in
workers, greedy and sampled; a failing inner stage costs speed, not output."""
from __future__ import annotations

import os
import random

import pytest


from hetero_sd.backends.torch_backend import TorchBackend
from hetero_sd.drafting import CascadeDrafter
from hetero_sd.config import load_config
from hetero_sd.drafting import ModelDrafter, NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import BackendError, ConfigError
from hetero_sd.ir import DraftRequest, load_model_ir
from hetero_sd.sampling import SamplingParams
from hetero_sd.transport.segment import SHM_DIR
from hetero_sd.drafting.remote import RemoteDrafter
from hetero_sd.drafting.specs import CascadeSpec, ModelSpec, NgramSpec
from helpers.drafters import ProxyDrafter
from helpers.table_model import TableRunner, chi_square_p, exact_joint
from helpers.near import PRECISION as NEAR_PRECISION, YAML as NEAR_YAML, load_near, near_spec
from helpers.tiny_models import random_prompt
from helpers.workers import FaultSpec, remote as make_remote

BUDGET = 4 << 20


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


@pytest.fixture(scope="module")
def paths(tiny_model_dir):
    return {"target": tiny_model_dir("llama"), "other": tiny_model_dir("llama", seed=1)}


def load(path, precision="fp32"):
    return TorchBackend().load(load_model_ir(path), "cpu", precision, BUDGET)


@pytest.fixture(scope="module")
def target(paths):
    return load(paths["target"])


def repetitive(n: int, seed: int) -> list[int]:
    head = random_prompt(max(4, n // 2), seed=seed)
    return (head + head)[:n]


def assert_lossless(target, drafter, ks=(2, 4, 7), seeds=range(2)) -> tuple[int, int]:
    drafted = accepted = 0
    for k in ks:
        engine = Engine(target, drafter, k=k)
        for seed in seeds:
            prompt, new = repetitive(8 + 5 * seed + k, 30 + seed + k), 20 + 4 * seed
            want = engine.generate_ids(prompt, new, target_only=True).token_ids
            got = engine.generate_ids(prompt, new)
            assert got.token_ids == want, f"{drafter.name} k={k} seed={seed}"
            assert got.stats.events == []
            drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
    assert 0 < accepted < drafted
    return drafted, accepted


# ------------------------------------------------------------------ proposals
class _Noisy(ProxyDrafter):
    """A drafter that proposes a good drafter's tokens, one in three of them replaced."""

    def __init__(self, inner, seed=1):
        super().__init__(inner, "noisy")
        self.rng = random.Random(seed)

    def seen(self, req, result):
        result.tokens = [t if self.rng.random() > 0.33 else (t + 1) % 384 for t in result.tokens]
        return result


def test_proposals_are_the_intermediate_models_greedy_continuation(paths):
    """Whatever the inner stage proposes, and across rollbacks, the cascade
    proposes exactly the tokens the intermediate model alone would choose."""
    inner = _Noisy(ModelDrafter(load(paths["target"]), 384))
    cascade = CascadeDrafter(inner, load_near(paths["target"]), 384, k=3)
    reference = ModelDrafter(load_near(paths["target"]), 384)
    cascade.begin(128)
    reference.begin(128)
    rng, context, synced = random.Random(0), random_prompt(7, seed=8), 0
    while len(context) < 90:
        k = rng.randint(1, 8)
        req = DraftRequest(0, synced, k, context[synced:])
        got, want = cascade.draft(req).tokens, reference.draft(req).tokens
        assert got == want, f"at {len(context)} tokens"
        synced = len(context)
        a = rng.randint(0, k)  # the target keeps a prefix and adds one token of its own
        context += got[:a] + [rng.randrange(4, 384)]
    assert cascade.stage_calls > 0 and 0 < cascade.inner_accepted < cascade.inner_drafted


# ------------------------------------------------------------------ lossless
@pytest.mark.parametrize("inner_kind", ["ngram", "model"])
def test_three_model_cascade_is_lossless(target, paths, inner_kind):
    """draft -> intermediate -> target."""
    inner = NgramDrafter(1, 3) if inner_kind == "ngram" else ModelDrafter(load(paths["other"]), 384)
    assert_lossless(target, CascadeDrafter(inner, load_near(paths["target"]), 384, k=3))


def test_four_model_cascade_is_lossless(target, paths):
    """ngram -> other model -> a cheaper copy of the target -> target: stages nest."""
    middle = CascadeDrafter(NgramDrafter(1, 3), load(paths["other"]), 384, k=2)
    outer = CascadeDrafter(middle, load_near(paths["target"]), 384, k=4)
    assert_lossless(target, outer)
    assert middle.stage_calls > 0 and outer.inner_drafted > 0


@pytest.mark.parametrize("placement", ["inner-in-worker", "cascade-in-worker"])
def test_cascade_with_worker_stages_is_lossless(target, paths, placement):
    inner_spec = ModelSpec(str(paths["other"]), "torch", "cpu", "fp32", BUDGET)
    stage_spec = near_spec(paths["target"], BUDGET)
    if placement == "inner-in-worker":
        remote = make_remote(inner_spec, 384, transport="shm", mode="async", threads=1)
        drafter = CascadeDrafter(remote, load_near(paths["target"]), 384, k=3)
    else:
        remote = make_remote(CascadeSpec(inner_spec, stage_spec, k=3), 384, transport="shm", threads=1)
        drafter = remote
    try:
        assert_lossless(target, drafter, ks=(3, 6))
        assert remote.stats.rounds > 0 and remote.stats.starts == 1
    finally:
        remote.close()


def test_a_failing_inner_stage_leaves_the_stage_drafting_alone(target, paths):
    spec = ModelSpec(str(paths["other"]), "torch", "cpu", "fp32", BUDGET)
    remote = make_remote(spec, 384, transport="shm", threads=1, fault=FaultSpec(after=2, kind="exit"))
    cascade = CascadeDrafter(remote, load_near(paths["target"]), 384, k=3)
    try:
        prompt = random_prompt(9, seed=4)
        engine = Engine(target, cascade, k=5)
        got = engine.generate_ids(prompt, 30)
        assert got.token_ids == engine.generate_ids(prompt, 30, target_only=True).token_ids
        assert got.stats.events == []  # the engine kept the cascade: only its inner stage failed
        assert len(cascade.events) == 1 and "failed" in cascade.events[0]
        assert got.stats.drafted > 10 and remote.stats.rounds == 2  # inner replies before the fault
    finally:
        remote.close()
    assert not [n for n in os.listdir(SHM_DIR) if f"-{os.getpid()}-" in n]


# ------------------------------------------------------------------ sampling
VOCAB, NEW = 4, 4
PROMPT = [0, 1, 2, 0, 1]


def test_sampling_through_a_cascade_keeps_the_target_distribution():
    """Proposals are deterministic (q one-hot, probs None): the emitted
    continuations follow the target's exact distribution (chi-square), and a
    seed reproduces a run."""
    target = TableRunner(VOCAB, seed=0)
    stage = TableRunner(VOCAB, seed=0, noise=0.6, noise_seed=3)
    inner = ModelDrafter(TableRunner(VOCAB, seed=0, noise=1.2, noise_seed=9), VOCAB)
    cascade = CascadeDrafter(inner, stage, VOCAB, k=2)
    engine = Engine(target, cascade, k=3)
    params, n = SamplingParams(1.0, top_p=0.95), 3000
    counts: dict[tuple, int] = {}
    drafted = accepted = 0
    for seed in range(n):
        res = engine.generate_ids(PROMPT, NEW, sampling=SamplingParams(1.0, top_p=0.95, seed=seed))
        counts[tuple(res.token_ids)] = counts.get(tuple(res.token_ids), 0) + 1
        drafted, accepted = drafted + res.stats.drafted, accepted + res.stats.accepted
    assert 0 < accepted < drafted
    assert chi_square_p(counts, exact_joint(target, params, PROMPT, NEW), n) > 1e-3
    cascade.begin(16, None)
    assert cascade.draft(DraftRequest(0, 0, 3, PROMPT)).probs is None
    runs = {tuple(engine.generate_ids(PROMPT, 30, sampling=SamplingParams(1.0, seed=77)).token_ids)
            for _ in range(3)}
    assert len(runs) == 1


# ------------------------------------------------------------------ YAML
def _yaml(tmp_path, target, drafter: str):
    path = tmp_path / "c.yaml"
    path.write_text(f"target: {{model: {target}, precision: fp32}}\ndrafter: {drafter}\n"
                    "memory: {kv_budget: 4MiB}\ngeneration: {max_new_tokens: 16, chat_template: false}\n")
    return path


def test_yaml_cascade_builds_the_stages_in_order(paths, tmp_path):
    text = (f"{{kind: model, model: {paths['other']}, precision: fp32, k: 5, "
            f"stages: [{{{NEAR_YAML}, k: 4}}, {{model: {paths['other']}, {NEAR_YAML}, k: 2}}]}}")
    engine = Engine.from_config(load_config(_yaml(tmp_path, paths["target"], text)))
    outer = engine.drafter
    assert isinstance(outer, CascadeDrafter) and outer.k_inner == 4  # stages.0: next to the target
    assert isinstance(outer.inner, CascadeDrafter) and outer.inner.k_inner == 2
    assert isinstance(outer.inner.inner, ModelDrafter)
    assert outer.runner.precision.name == outer.inner.runner.precision.name == NEAR_PRECISION
    prompt = repetitive(12, 3)
    got = engine.generate_ids(prompt, 16)
    assert got.token_ids == engine.generate_ids(prompt, 16, target_only=True).token_ids
    assert got.stats.drafted > 0 and got.stats.mode.startswith("cascade(cascade(")


def test_yaml_cascade_with_a_worker_stage(paths, tmp_path):
    text = f"{{kind: ngram, min_ngram: 1, k: 4, stages: [{{{NEAR_YAML}, k: 3, process: worker, threads: 1}}]}}"
    engine = Engine.from_config(load_config(_yaml(tmp_path, paths["target"], text)))
    try:
        assert isinstance(engine.drafter, RemoteDrafter)
        assert isinstance(engine.drafter.spec, CascadeSpec) and isinstance(engine.drafter.spec.inner, NgramSpec)
        prompt = repetitive(12, 5)
        got = engine.generate_ids(prompt, 16)
        assert got.token_ids == engine.generate_ids(prompt, 16, target_only=True).token_ids
        assert got.stats.drafted > 0
    finally:
        engine.drafter.close()


@pytest.mark.parametrize("drafter, words", [
    ("{kind: ngram, stages: [{k: 0}]}", ["drafter.stages.0.k", "greater than or equal to 1"]),
    ("{kind: ngram, stages: [{precison: bf16}]}", ["drafter.stages.0.precison", "unknown key",
                                                   "allowed: model, backend, device, precision, k, process"]),
    ("{kind: ngram, stages: [{backend: nope}]}", ["drafter.stages.0", "unknown backend 'nope'"]),
    ("{kind: none, stages: [{precision: bf16}]}", ["drafter.stages", "ngram or model"]),
    ("{kind: ngram, stages: [{mode: async}]}", ["drafter.stages.0.mode", "process: worker"]),
    ("{kind: ngram, stages: {precision: bf16}}", ["drafter.stages", "list"]),
])
def test_yaml_cascade_errors_name_the_key(paths, tmp_path, drafter, words):
    with pytest.raises((ConfigError, BackendError)) as err:
        Engine.from_config(load_config(_yaml(tmp_path, paths["target"], drafter)))
    for word in words:
        assert word in str(err.value), str(err.value)


def test_stage_vocabulary_must_match(paths):
    with pytest.raises(ConfigError, match="vocabulary"):
        CascadeDrafter(NgramDrafter(), load(paths["other"]), 500)
