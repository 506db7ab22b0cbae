"""Our runs: target-only and each YAML configuration, through the public
config -> build -> Engine path a user takes.

Every configuration is built once; on that engine, prompt by prompt, the
target-only run (once per distinct target placement) goes right before the
speculative one, so the ratio that matters most (speculative / target-only)
compares generations made seconds apart on a noisy machine.
"""
from __future__ import annotations

import gc
import time
from pathlib import Path

from hetero_sd.bench.common import Progress, RunResult, Sample, Workload
from hetero_sd.config import Config, GenerationConfig, load_config, resolve_model
from hetero_sd.errors import HeteroSDError

TARGET_ONLY = "ours target-only"


def load_configs(paths: list[str], model: str, max_new_tokens: int, draft_model: str | None = None) -> list[Config]:
    """Validate every configuration before anything loads; the model is forced to `model`,
    and every draft model to `draft_model` when one is given (so ours and the peers draft alike)."""
    out = []
    for path in paths:
        overrides = {"target.model": model, "generation.max_new_tokens": max_new_tokens}
        if "temperature" in GenerationConfig.model_fields:
            overrides["generation.temperature"] = 0.0  # the bench compares greedy outputs
        raw = load_config(path)
        # A draft that is the target's own weights (another precision) follows --model too.
        if raw.drafter.kind == "model" and draft_model is not None:
            overrides["drafter.model"] = draft_model
        elif raw.drafter.kind == "model" and raw.drafter.model in (None, raw.target.model):
            overrides["drafter.model"] = model
        out.append(load_config(path, overrides))
    return out


def config_name(cfg: Config, taken: set[str]) -> str:
    stem = Path(cfg.source).stem if cfg.source != "<defaults>" else "defaults"
    name, i = f"ours {stem}", 2
    while name in taken:
        name, i = f"ours {stem} #{i}", i + 1
    return name


def _placement(cfg: Config) -> tuple:
    base = Path(cfg.source).parent if cfg.source != "<defaults>" else None
    t = cfg.target
    return str(resolve_model(t.model, base).resolve()), t.backend, t.device, t.precision


def planned_runs(configs: list[Config]) -> int:
    """How many runs run_ours makes: one per drafter, each with a target-only beside it
    (the first of a placement is its public baseline, later ones are paired baselines)."""
    with_drafter = sum(c.drafter.kind != "none" for c in configs)
    return with_drafter * 2 + len({_placement(c) for c in configs if c.drafter.kind == "none"})


def _drafter_label(cfg: Config) -> str:
    d = cfg.drafter
    if d.kind == "ngram":
        return f"n-gram drafter k={d.k} (n {d.min_ngram}..{d.max_ngram})"
    if d.kind == "model":
        # named: --draft-model replaces a configuration's own draft
        return f"draft model {Path(d.model or cfg.target.model).name} on {d.backend}:{d.device} {d.precision}, k={d.k}"
    if d.kind == "suffix":
        return f"suffix decoding k={d.k}"
    if d.kind in ("head", "hybrid"):
        other = "head" if d.hybrid_with == "head" else f"draft model {Path(d.model or cfg.target.model).name}"
        what = "EAGLE-3 head" if d.kind == "head" else \
            f"hybrid (suffix on matches >= {d.hybrid_min_match}, else {other})"
        return f"{what} on {d.backend}:{d.device}, k={d.k}"
    return "no drafter"


def _sample(engine, prompt, ids: list[int], work: Workload, target_only: bool) -> Sample:
    res = engine.generate_ids(ids, work.max_new_tokens, target_only=target_only, stop=[])
    s = res.stats
    return Sample(prompt.id, prompt.kind, len(ids), list(res.token_ids), s.total_s, s.prefill_s,
                  s.finish_reason, None if target_only else s.drafted, None if target_only else s.accepted)


def _build(cfg: Config):
    from hetero_sd.engine import Engine

    t0 = time.perf_counter()
    engine = Engine.from_config(cfg)
    return engine, time.perf_counter() - t0


def run_ours(configs: list[Config], work: Workload, progress: Progress) -> tuple[list[RunResult], dict[str, str]]:
    """Run target-only and every configuration. The first configuration's target is the
    baseline: if it cannot be built or run the bench cannot compare anything, so that error is raised."""
    runs: list[RunResult] = []
    skipped: dict[str, str] = {}
    placements: dict[tuple, str] = {}  # target placement -> its target-only run
    taken: set[str] = {TARGET_ONLY}
    for i, cfg in enumerate(configs):
        name = config_name(cfg, taken)
        taken.add(name)
        place = _placement(cfg)
        planned = 2 if cfg.drafter.kind != "none" else int(place not in placements)
        engine = None
        try:
            engine, load_s = _build(cfg)
            todo = _plan(cfg, engine, name, place, placements, load_s)
            _measure(engine, todo, work, progress)
            runs.extend(r for r, _ in todo)
        except HeteroSDError as exc:  # a backend refusing, a prompt too long for its context, ...
            if i == 0:
                raise
            skipped[name] = f"failed: {type(exc).__name__}: {exc}"
            progress.log(f"skipped {name}: {exc}")
            progress.skip(planned * len(work.prompts))
        finally:  # its workers stopped and its CPUs back before the next configuration (or llama-bench)
            if engine is not None:
                engine.close()
            del engine
        gc.collect()
    return runs, skipped


def _plan(cfg: Config, engine, name: str, place: tuple, placements: dict[tuple, str],
          load_s: float) -> list[tuple[RunResult, bool]]:
    """The runs this engine makes: (run, target_only) pairs."""
    target = engine.target
    where = f"{cfg.target.backend}:{target.device.device} {target.precision.name}"
    todo: list[tuple[RunResult, bool]] = []
    if place not in placements:
        base = TARGET_ONLY if not placements else f"{TARGET_ONLY} ({where})"
        placements[place] = base
        todo.append((RunResult(base, "ours", f"our target-only greedy on {where}",
                               {"config": cfg.source, "target": where, "precision": target.precision.name},
                               own_greedy=base, load_s=load_s), True))
    if cfg.drafter.kind != "none" and engine.drafter is not None:
        paired = None
        if not todo:  # the placement's target-only ran with an earlier config: pair a fresh one
            paired = f"{name} / paired target-only"
            todo.append((RunResult(paired, "ours", f"target-only interleaved with {name}", {"target": where},
                                   own_greedy=placements[place], load_s=load_s, hidden=True), True))
        todo.append((RunResult(name, "ours", f"{Path(cfg.source).name}: {_drafter_label(cfg)}, target {where}",
                               {"config": cfg.source, "target": where, "drafter": cfg.drafter.model_dump()},
                               own_greedy=placements[place], load_s=load_s,
                               baseline=paired or placements[place]), False))
    return todo


def _measure(engine, todo: list[tuple[RunResult, bool]], work: Workload, progress: Progress) -> None:
    engine.eos_ids = set(work.stop_ids)  # the bench's EOS policy, the same for every run
    for run, target_only in todo:  # one warm-up per configuration, not counted
        engine.generate_ids(work.warmup_ids, min(8, work.max_new_tokens), target_only=target_only, stop=[])
    for prompt in work.prompts:
        ids = work.ids[prompt.id]
        for run, target_only in todo:
            run.samples.append(_sample(engine, prompt, ids, work, target_only))
            progress.step(f"{run.name} {prompt.id}")
    for run, _ in todo:
        progress.log(f"done {run.name}: {run.label}")
