"""Issue 17, points 1 and 2: the target on one node and the draft model on
another of a real three-node Ray cluster (conftest.py), placed by resource and
label; greedy output token-identical to target-only; seeded sampling equal to
the in-process drafter, tokens and q rows; a drafter actor killed at random
points, its node killed, and the target's node killed with a spare placement:
the output never changes and the event is in stats.events."""
from __future__ import annotations


import numpy as np
import pytest

from hetero_sd.backends.torch_backend import TorchBackend
from hetero_sd.cluster import RayPlacement
from hetero_sd.config import load_config
from hetero_sd.drafting import ModelDrafter
from hetero_sd.drafting.build import worker_entry
from hetero_sd.drafting.remote import RemoteDrafter
from hetero_sd.build import engine_arguments
from hetero_sd.drafting.specs import ModelSpec
from hetero_sd.engine import Engine
from hetero_sd.ir import load_model_ir
from hetero_sd.sampling import SamplingParams
from helpers.drafters import ProxyDrafter, kill_at_random_points
from helpers.near import YAML as NEAR_YAML, near_spec
from helpers.tiny_models import random_prompt

BUDGET = 4 << 20
DRAFT_NODE = RayPlacement(resources=(("draft_node", 1.0),), labels=(("role", "draft"),))
PROMPTS = [(random_prompt(6, seed=70), 24), (random_prompt(19, seed=71), 30), (random_prompt(33, seed=72), 16)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def local(model):
    """The target in this process: what target-only decoding gives."""
    return TorchBackend().load(load_model_ir(model), "cpu", "fp32", BUDGET)


def expected(local, prompt, new):
    return Engine(local, None).generate_ids(prompt, new, target_only=True).token_ids


def write(tmp_path, model, mode: str = "sync", spare: bool = False, draft=None) -> str:
    """Target on the target node; a draft model on the draft node: the target's own
    weights in a cheaper precision (`draft` None: mostly accepted) or another model."""
    fallback = ", fallback: [{resources: {spare: 1}}]" if spare else ""
    placement = NEAR_YAML if draft is None else f"model: {draft}, precision: fp32"
    path = tmp_path / f"ray-{mode}{'-spare' if spare else ''}{'-other' if draft else ''}.yaml"
    path.write_text(f"""
target: {{model: {model}, precision: fp32, process: ray, ray: {{resources: {{target_node: 1}}{fallback}}}}}
drafter: {{kind: model, {placement}, k: 4, process: ray, mode: {mode}, threads: 1, timeout_s: 30,
          ray: {{resources: {{draft_node: 1}}, labels: {{role: draft}}}}}}
generation: {{chat_template: false}}
""")
    return str(path)


def engine_from(built: dict, k: int = 3, **changes) -> Engine:
    """An engine on the config's runners and drafter, with the oracle's (no) EOS ids."""
    return Engine(**dict(built, policy=None, eos_ids=(), **changes), k=k)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_target_and_draft_on_their_nodes_are_lossless(ray_cluster, model, local, tiny_model_dir, tmp_path, mode):
    import ray

    drafted = accepted = 0
    for draft in (None, tiny_model_dir("llama", seed=1)):  # mostly accepted / mostly rejected (rollbacks)
        built = engine_arguments(load_config(write(tmp_path, model, mode, draft=draft)))
        target, drafter = built["target"], built["drafter"]
        try:
            assert ray.get(target.actor.where.remote()).split()[1] == ray_cluster.node_id("target")[:8]
            assert ray.get(drafter._w.actor.node_id.remote()) == ray_cluster.node_id("draft")
            for k in (1, 3, 5, 8):
                engine = engine_from(built, k=k)
                for prompt, new in PROMPTS:
                    got = engine.generate_ids(prompt, new)
                    assert got.token_ids == expected(local, prompt, new), f"{draft} k={k} prompt of {len(prompt)}"
                    assert got.stats.events == []
                    drafted, accepted = drafted + got.stats.drafted, accepted + got.stats.accepted
            assert drafter.stats.starts == 1 and drafter.stats.failures == 0
        finally:
            drafter.close()
            target.close()
    assert 0 < accepted < drafted


class _Recorder(ProxyDrafter):
    def __init__(self, inner):
        super().__init__(inner)
        self.calls = []

    def seen(self, req, result):
        self.calls.append((list(result.tokens), None if result.probs is None else np.array(result.probs)))
        return result


def test_seeded_sampling_equals_the_in_process_drafter(ray_cluster, tiny_model_dir, local):
    other = tiny_model_dir("llama", seed=1)
    params = SamplingParams(0.9, top_k=40, top_p=0.95, seed=11)
    prompt = random_prompt(12, seed=3)
    here = _Recorder(ModelDrafter(TorchBackend().load(load_model_ir(other), "cpu", "fp32", BUDGET), local.vocab_size))
    want = Engine(local, here, k=4).generate_ids(prompt, 30, sampling=params)
    remote = RemoteDrafter(ModelSpec(str(other), "torch", "cpu", "fp32", BUDGET), local.vocab_size, entry=worker_entry(), transport="ray", ray=DRAFT_NODE,
                           timeout_s=30, threads=1)
    try:
        rec = _Recorder(remote)
        got = Engine(local, rec, k=4).generate_ids(prompt, 30, sampling=params)
        assert got.token_ids == want.token_ids and got.stats.events == []
        assert len(rec.calls) == len(here.calls) > 3
        for (tokens, probs), (l_tokens, l_probs) in zip(rec.calls, here.calls):
            assert tokens == l_tokens
            assert probs.shape == (len(tokens), local.vocab_size) and probs.dtype == np.float64
            np.testing.assert_array_equal(probs, l_probs)  # the same q rows, bit for bit
    finally:
        remote.close()


def test_drafter_actor_killed_at_random_points(ray_cluster, model, local):
    drafter = RemoteDrafter(near_spec(model, BUDGET), local.vocab_size, entry=worker_entry(), transport="ray",
                            ray=DRAFT_NODE, timeout_s=30, threads=1)
    try:
        kill_at_random_points(local, drafter, 10, seed=17)
        assert drafter.stats.failures == 10
    finally:
        drafter.close()


class _NodeKillAt(ProxyDrafter):
    """Kills a whole node (its raylet and every worker on it) at a chosen draft call."""

    def __init__(self, inner, call: int, kill):
        super().__init__(inner)
        self.call, self.kill, self.calls = call, kill, 0

    def draft(self, req, rnd=None):
        self.calls += 1
        if self.calls == self.call:
            self.kill()
        return self.inner.draft(req)


def test_draft_node_death_keeps_the_output(ray_cluster, model, local, tmp_path):
    built = engine_arguments(load_config(write(tmp_path, model)))
    prompt, new = random_prompt(10, seed=22), 40
    try:
        want = expected(local, prompt, new)
        assert engine_from(built).generate_ids(prompt, new).token_ids == want
        killer = _NodeKillAt(built["drafter"], 3, lambda: ray_cluster.kill("draft"))
        got = engine_from(built, drafter=killer).generate_ids(prompt, new)
        assert got.token_ids == want
        assert any("failed" in e for e in got.stats.events), got.stats.events
        assert got.stats.drafted > 0  # drafts came before the node died
    finally:
        built["drafter"].close()
        built["target"].close()
        ray_cluster.revive("draft")


def test_target_node_death_moves_the_target_to_the_spare(ray_cluster, model, local, tmp_path):
    import ray

    built = engine_arguments(load_config(write(tmp_path, model, spare=True)))
    prompt, new = random_prompt(10, seed=23), 40
    engine = None
    try:
        want = expected(local, prompt, new)
        killer = _NodeKillAt(built["drafter"], 3, lambda: ray_cluster.kill("target"))
        engine = engine_from(built, drafter=killer)
        got = engine.generate_ids(prompt, new)
        assert got.token_ids == want
        events = " | ".join(got.stats.events)
        assert "target" in events and "failed" in events and "moved to" in events and "spare" in events, events
        assert ray.get(engine.target.actor.where.remote()).split()[1] == ray_cluster.node_id("head")[:8]
        again = engine.generate_ids(prompt, new)  # the spare serves later requests too
        assert again.token_ids == want and again.stats.events == []
    finally:
        built["drafter"].close()
        (engine.target if engine is not None else built["target"]).close()
        ray_cluster.revive("target")


def test_a_strict_spread_group_puts_target_and_draft_on_two_nodes(ray_cluster, model, local, tmp_path):
    import ray

    config = tmp_path / "spread.yaml"  # no resources named: the strategy alone separates them
    config.write_text(f"""
target: {{model: {model}, precision: fp32, process: ray, ray: {{strategy: STRICT_SPREAD}}}}
drafter: {{kind: model, {NEAR_YAML}, k: 4, process: ray, threads: 1, timeout_s: 30}}
""")
    built = engine_arguments(load_config(config))
    try:
        target_node = ray.get(built["target"].actor.where.remote()).split()[1]
        draft_node = ray.get(built["drafter"]._w.actor.node_id.remote())[:8]
        assert target_node != draft_node
        assert "STRICT_SPREAD bundle 1" in built["drafter"].placement.label
        for prompt, new in PROMPTS:
            assert engine_from(built, k=4).generate_ids(prompt, new).token_ids == expected(local, prompt, new)
    finally:
        built["drafter"].close()
        built["target"].close()


def test_a_group_the_cluster_cannot_hold_is_a_clear_error(ray_cluster, model, tmp_path, monkeypatch):
    from hetero_sd.cluster import ray_env
    from hetero_sd.errors import ConfigError

    monkeypatch.setattr(ray_env, "RESERVE_TIMEOUT_S", 3.0)
    config = tmp_path / "pack.yaml"  # the two resources live on two different nodes
    config.write_text(f"""
target: {{model: {model}, process: ray, ray: {{strategy: STRICT_PACK, resources: {{target_node: 1}}}}}}
drafter: {{kind: ngram, process: ray, ray: {{resources: {{draft_node: 1}}}}}}
""")
    with pytest.raises(ConfigError) as err:
        engine_arguments(load_config(config))
    for words in ("ray.strategy STRICT_PACK", "cannot place bundles", "target_node", "draft_node", "live nodes offering"):
        assert words in str(err.value), (words, str(err.value))


@pytest.mark.parametrize("drafter", [
    "{kind: ngram, min_ngram: 1, max_ngram: 3, k: 4, process: ray, ray: {resources: {draft_node: 1}}}",
    "{kind: ngram, k: 4, stages: [{model: MODEL, NEAR, k: 3, process: ray, threads: 1, timeout_s: 30, "
    "ray: {resources: {draft_node: 1}}}]}",
])
def test_an_ngram_drafter_and_a_cascade_stage_on_the_draft_node(ray_cluster, model, local, tmp_path, drafter):
    config = tmp_path / "kinds.yaml"
    config.write_text(f"target: {{model: {model}, precision: fp32}}\n"
                      f"drafter: {drafter.replace('MODEL', str(model)).replace('NEAR', NEAR_YAML)}\n")
    built = engine_arguments(load_config(config))
    try:
        import ray

        assert ray.get(built["drafter"]._w.actor.node_id.remote()) == ray_cluster.node_id("draft")
        drafted = 0
        for prompt, new in PROMPTS:
            got = engine_from(built, k=4).generate_ids(prompt + prompt, new)  # repeats: n-gram matches
            assert got.token_ids == expected(local, prompt + prompt, new) and got.stats.events == []
            drafted += got.stats.drafted
        assert drafted > 0
    finally:
        built["drafter"].close()
