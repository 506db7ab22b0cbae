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


def build_engine(cfg: Config, progress: bool = False) -> Engine:
    base = Path(cfg.source).parent if cfg.source != "<defaults>" else None
    registry = discover()
    # Every placement is checked before any model loads, so a typo fails in a second.
    check_placement(registry, cfg.target, "target")
    if cfg.drafter.kind == "model":
        check_placement(registry, cfg.drafter, "draft model")
    target_ir = load_model_ir(resolve_model(cfg.target.model, base))
    target = load_runner(registry, cfg.target, target_ir, cfg.memory.kv_budget, "target", progress)
    drafter = None
    d = cfg.drafter
    if d.kind == "ngram":
        drafter = NgramDrafter(d.min_ngram, d.max_ngram)
    elif d.kind == "model":
        draft_ir = load_model_ir(resolve_model(d.model or cfg.target.model, base))
        runner = load_runner(registry, d, draft_ir, cfg.memory.kv_budget, "draft model", progress)
        drafter = ModelDrafter(runner, target.vocab_size, f"draft model {draft_ir.source.name}")
    tokenizer = target_ir.load_tokenizer()
    if d.kind == "model" and draft_ir.source.resolve() != target_ir.source.resolve():
        _check_same_tokenizer(tokenizer, draft_ir)
    eos = set(target_ir.config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return Engine(target, drafter, k=d.k, tokenizer=tokenizer, eos_ids=tuple(sorted(eos)),
                  max_new_tokens=cfg.generation.max_new_tokens, stop=tuple(cfg.generation.stop),
                  chat_template=cfg.generation.chat_template, sampling=cfg.generation.sampling())
