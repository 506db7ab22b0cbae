"""From a validated Config to a running Engine: find backends, check devices
and precisions, load models with progress, build the drafter."""
from __future__ import annotations

from pathlib import Path

from hetero_sd.backends.base import Runner, resolve
from hetero_sd.backends.registry import Registry, discover
from hetero_sd.config import Config, ModelPlacement, resolve_model
from hetero_sd.drafters import ModelDrafter, NgramDrafter
from hetero_sd.engine import Engine
from hetero_sd.errors import BackendError, ConfigError
from hetero_sd.ir.model import ModelIR, load_model_ir
from hetero_sd.scheduler import AdaptiveDraftLength


def _progress_bar(enabled: bool, label: str):
    if not enabled:
        return None, None
    from tqdm import tqdm

    bar = tqdm(desc=label, unit="tensor", leave=False)

    def update(i: int, total: int, name: str) -> None:
        bar.total = total
        bar.update(1)
        bar.set_postfix_str(name[-40:], refresh=False)

    return update, bar


def check_placement(registry: Registry, place, role: str):
    """Backend, device and precision exist here (cheap: probes only, loads nothing)."""
    try:
        return resolve(registry.get(place.backend).probe(), place.backend, place.device, place.precision)
    except BackendError as exc:
        raise BackendError(f"{role}: {exc}") from None


def load_runner(registry: Registry, place: ModelPlacement | object, model: ModelIR, kv_budget: int,
                role: str, progress: bool) -> Runner:
    backend = registry.get(place.backend)
    info, precision = check_placement(registry, place, role)
    update, bar = _progress_bar(progress, f"loading {role} on {place.backend}:{info.device} {precision.name}")
    try:
        return backend.load(model, info.device, precision.name, kv_budget, progress=update)
    finally:
        if bar is not None:
            bar.close()


def _check_same_tokenizer(target_tok, draft_ir: ModelIR) -> None:
    """Equal vocabulary sizes are not enough: the same id must mean the same text."""
    if draft_ir.load_tokenizer().get_vocab() != target_tok.get_vocab():
        raise ConfigError(f"draft model {draft_ir.source} has the target's vocabulary size but a "
                          "different tokenizer; draft and target must share a tokenizer")


def _finish(cfg: Config, target: Runner, target_ir: ModelIR, drafter, draft_ir: ModelIR | list | None,
            **engine_kw):
    tokenizer = target_ir.load_tokenizer()
    for ir in draft_ir if isinstance(draft_ir, list) else [draft_ir]:
        if ir is not None and ir.source.resolve() != target_ir.source.resolve():
            _check_same_tokenizer(tokenizer, ir)
    eos = set(target_ir.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    k = cfg.drafter.k if isinstance(cfg.drafter.k, int) else cfg.drafter.k_max
    return Engine(target, drafter, k=k, tokenizer=tokenizer, eos_ids=tuple(sorted(eos)),
                  max_new_tokens=cfg.generation.max_new_tokens, stop=tuple(cfg.generation.stop),
                  chat_template=cfg.generation.chat_template, sampling=cfg.generation.sampling(), **engine_kw)


def build_engine(cfg: Config, progress: bool = False) -> Engine:
    base = Path(cfg.source).parent if cfg.source != "<defaults>" else None
    registry = discover()
    if cfg.placement == "auto":
        return _build_auto(cfg, registry, base, progress)
    # Every placement is checked before any model loads, so a typo fails in a second.
    check_placement(registry, cfg.target, "target")
    if cfg.drafter.kind == "model":
        check_placement(registry, cfg.drafter, "draft model")
    for i, stage in enumerate(cfg.drafter.stages):
        check_placement(registry, stage, f"drafter.stages.{i}")
    target_ir = load_model_ir(resolve_model(cfg.target.model, base))
    d = cfg.drafter
    if d.stages or d.process == "worker":
        from hetero_sd.drafter_tree import build_drafter_tree

        def loader(place, ir, role):
            return load_runner(registry, place, ir, cfg.memory.kv_budget, role, progress)

        def load_target():
            return load_runner(registry, cfg.target, target_ir, cfg.memory.kv_budget, "target", progress)

        target, drafter, draft_irs = build_drafter_tree(cfg, base, target_ir, load_target, loader)
        policy = AdaptiveDraftLength(d.k_max) if d.k == "auto" else None
        return _finish(cfg, target, target_ir, drafter, draft_irs, policy=policy)
    target = load_runner(registry, cfg.target, target_ir, cfg.memory.kv_budget, "target", progress)
    drafter = draft_ir = None
    if d.kind == "ngram":
        drafter = NgramDrafter(d.min_ngram, d.max_ngram)
    elif d.kind == "model":
        draft_ir = load_model_ir(resolve_model(d.model or cfg.target.model, base))
        runner = load_runner(registry, d, draft_ir, cfg.memory.kv_budget, "draft model", progress)
        drafter = ModelDrafter(runner, target.vocab_size, f"draft model {draft_ir.source.name}")
    policy = AdaptiveDraftLength(d.k_max) if d.k == "auto" else None  # learns costs from its own timings
    return _finish(cfg, target, target_ir, drafter, draft_ir, policy=policy)


def _build_auto(cfg: Config, registry: Registry, base: Path | None, progress: bool) -> Engine:
    from hetero_sd.auto import build_auto

    target_ir = load_model_ir(resolve_model(cfg.target.model, base))
    draft_ir = None
    if cfg.drafter.kind in ("auto", "model"):
        draft_path = resolve_model(cfg.drafter.model or cfg.target.model, base)
        draft_ir = target_ir if draft_path.resolve() == target_ir.source.resolve() else load_model_ir(draft_path)
    irs = {target_ir.source: target_ir, **({draft_ir.source: draft_ir} if draft_ir is not None else {})}

    def loader(placement, path, role):
        return load_runner(registry, placement, irs[Path(path)], cfg.memory.kv_budget, role, progress)

    target, drafter, policy, fallback, plan = build_auto(
        cfg, registry, target_ir.source, None if draft_ir is None else draft_ir.source, loader, progress)
    engine = _finish(cfg, target, target_ir, drafter, draft_ir if drafter is not None else None,
                     policy=policy, fallback=fallback)
    engine.plan = plan
    return engine
