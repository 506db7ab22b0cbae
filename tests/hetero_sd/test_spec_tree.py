"""The drafter spec tree's one traversal (walk) and one rebuild (rebuilt), and the
functions over them: every node declares its spec fields (`children`), nothing else
knows the tree's shape."""
import pytest

from hetero_sd.cluster import RayPlacement
from hetero_sd.cluster.placing import ray_worker
from hetero_sd.drafting.specs import (CascadeSpec, HeadSpec, HybridSpec, ModelSpec, NgramSpec, SuffixSpec,
                                      WorkerSpec, has_distributions, model_specs, rebuilt, translated, walk)
from hetero_sd.errors import ConfigError
from hetero_sd.spec import head_features

DRAFT, STAGE, OUTER = ModelSpec("/m/draft"), ModelSpec("/m/stage", role="drafter.stages.1"), ModelSpec("/m/outer")
TREE = WorkerSpec(CascadeSpec(CascadeSpec(DRAFT, STAGE), OUTER), "ray", ray=RayPlacement())


def test_walk_visits_children_first_in_declared_order():
    inner = TREE.inner.inner
    assert list(walk(TREE)) == [DRAFT, STAGE, inner, OUTER, TREE.inner, TREE]
    assert list(walk(None)) == []
    assert list(model_specs(TREE)) == [DRAFT, STAGE, OUTER]  # innermost first
    hybrid = HybridSpec(SuffixSpec(), DRAFT)
    assert list(walk(hybrid)) == [hybrid.suffix, DRAFT, hybrid] and list(model_specs(hybrid)) == [DRAFT]


def test_rebuilt_changes_nodes_and_keeps_the_shape():
    bigger = rebuilt(TREE, lambda n: ModelSpec(n.model + "-x") if isinstance(n, ModelSpec) else n)
    assert [m.model for m in model_specs(bigger)] == ["/m/draft-x", "/m/stage-x", "/m/outer-x"]
    assert bigger.transport == "ray" and bigger.inner.k == TREE.inner.k
    assert rebuilt(TREE, lambda n: n) == TREE and rebuilt(None, lambda n: n) is None


def test_translated_marks_foreign_drafts_and_refuses_a_foreign_stage():
    hybrid = HybridSpec(SuffixSpec(), DRAFT)
    assert translated(hybrid, "/t", lambda m: True).head.translate == "/t"
    assert translated(WorkerSpec(DRAFT), "/t", lambda m: m is DRAFT).inner.translate == "/t"
    assert translated(TREE, "/t", lambda m: False) == TREE
    with pytest.raises(ConfigError, match="drafter.stages.1 stage has another tokenizer"):
        translated(TREE, "/t", lambda m: m is STAGE)
    with pytest.raises(ConfigError, match="outer"):  # the outermost cascade's stage is named first
        translated(TREE, "/t", lambda m: m is not DRAFT)


def test_declared_distributions_features_and_ray_worker():
    head = HeadSpec("/h", "/t", features=(1, 2))
    assert [has_distributions(s) for s in (DRAFT, head, HybridSpec(SuffixSpec(), head), NgramSpec(),
                                           SuffixSpec(), TREE.inner, WorkerSpec(DRAFT), WorkerSpec(NgramSpec()))] \
        == [True, True, True, False, False, False, True, False]
    assert head_features(HybridSpec(SuffixSpec(), head)) == (1, 2) and head_features(head) == (1, 2)
    assert head_features(TREE) == () and head_features(None) == ()
    assert ray_worker(TREE) is TREE and ray_worker(WorkerSpec(DRAFT, "shm")) is None and ray_worker(None) is None


def test_reserve_places_puts_the_reserved_placement_on_the_worker(monkeypatch):
    from dataclasses import replace

    from hetero_sd.cluster import ray_env
    from hetero_sd.cluster.placing import release_places, reserve_places
    from hetero_sd.spec import EngineSpec

    given = RayPlacement(strategy="PACK")
    monkeypatch.setattr(ray_env, "reserve", lambda ps: [replace(p, group="g", bundle=i) for i, p in enumerate(ps)])
    released = []
    monkeypatch.setattr(ray_env, "release_group", released.append)
    spec = EngineSpec(ModelSpec("/t", role="target"), replace(TREE, ray=given), target_ray=given)
    got = reserve_places(spec)
    assert (got.target_ray.bundle, got.drafter.ray.bundle) == (0, 1) and got.drafter.inner == TREE.inner
    release_places(got)
    assert released == ["g", "g"]
    plain = EngineSpec(ModelSpec("/t", role="target"), TREE)
    assert reserve_places(plain) is plain
