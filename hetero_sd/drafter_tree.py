"""From the drafter section to a drafter tree: the drafter, cascade stages
around it, and at most one worker process holding the innermost part.

    drafter: {kind: ngram, stages: [{precision: int4}]}          ngram -> int4 -> target
    -> CascadeDrafter(NgramDrafter(), int4 runner)

    drafter: {kind: model, precision: int4, process: worker, stages: [{precision: bf16}]}
    -> CascadeDrafter(RemoteDrafter(ModelSpec(int4)), bf16 runner)

Levels from the inside out: the drafter (`kind`), then stages from the last
listed to `stages.0` (closest to the target). A level with `process: worker`
runs itself and every level inside it in one worker process (built there from
picklable specs); the levels outside it run here, wrapping a RemoteDrafter.
The worker starts before the target loads, so the two loads overlap.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from hetero_sd.cascade import CascadeDrafter
from hetero_sd.config import Config, resolve_model
from hetero_sd.drafters import ModelDrafter, NgramDrafter
from hetero_sd.ir.model import ModelIR, load_model_ir
from hetero_sd.worker_specs import CascadeSpec, ModelSpec, NgramSpec
from hetero_sd.workers import RemoteDrafter


def build_drafter_tree(cfg: Config, base: Path | None, target_ir: ModelIR, load_target: Callable,
                       loader: Callable) -> tuple:
    """(target runner, drafter, the draft-side model IRs for the tokenizer check).
    loader(placement, ir, role) loads a runner here, load_target() the target."""
    d = cfg.drafter
    irs: dict[Path, ModelIR] = {}

    def ir_for(model: str | None) -> ModelIR:
        path = resolve_model(model or cfg.target.model, base)
        if path.resolve() == target_ir.source.resolve():
            return target_ir
        if path not in irs:
            irs[path] = load_model_ir(path)
        return irs[path]

    def model_spec(place) -> ModelSpec:
        ir = ir_for(place.model)
        return ModelSpec(str(ir.source), place.backend, place.device, place.precision, cfg.memory.kv_budget)

    default_k = d.k if isinstance(d.k, int) else d.k_max
    places = [d] + [d.stages[i] for i in reversed(range(len(d.stages)))]
    roles = ["draft model"] + [f"drafter.stages.{i}" for i in reversed(range(len(d.stages)))]
    specs = [NgramSpec(d.min_ngram, d.max_ngram) if d.kind == "ngram" else model_spec(d)]
    for place in places[1:]:
        specs.append(CascadeSpec(specs[-1], model_spec(place), k=place.k or default_k))

    vocab = target_ir.config.vocab_size
    w = max((j for j, place in enumerate(places) if place.process == "worker"), default=None)
    remote = None
    if w is not None:
        p = places[w]
        remote = RemoteDrafter(specs[w], vocab, transport=p.transport, mode=p.mode, timeout_s=p.timeout_s,
                               start_timeout_s=p.start_timeout_s, threads=p.threads)
    try:
        target = load_target()
        if remote is not None:
            drafter, first = remote, w + 1
        elif d.kind == "ngram":
            drafter, first = NgramDrafter(d.min_ngram, d.max_ngram), 1
        else:
            ir = ir_for(d.model)
            drafter, first = ModelDrafter(loader(d, ir, "draft model"), target.vocab_size,
                                          f"draft model {ir.source.name}"), 1
        for j in range(first, len(places)):
            runner = loader(places[j], ir_for(places[j].model), roles[j])
            drafter = CascadeDrafter(drafter, runner, target.vocab_size, k=specs[j].k, desc=specs[j].stage.label)
        if remote is not None:
            remote.wait_ready()
    except BaseException:
        if remote is not None:
            remote.close()
        raise
    return target, drafter, list(irs.values())
