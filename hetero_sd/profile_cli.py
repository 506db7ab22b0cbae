"""`hetero-sd profile`: measure the configured models on every placement here,
print a table (or JSON), and with --explain what `placement: auto` would pick.

Wired into hetero_sd/cli.py by `add_parser(subparsers)`; `run(args)` returns
the exit status and raises HeteroSDError subclasses for the CLI to print.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _csv(text: str | None) -> list[str] | None:
    if text is None:
        return None
    items = [t.strip() for t in text.split(",") if t.strip()]
    return items or None


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "profile", help="measure prefill, draft and verify costs on every backend/device/precision here",
        description="Measure the configured target (and draft) model on every available (backend, device, "
                    "precision); results are cached per host, model and precision.")
    p.add_argument("--config", help="YAML config whose target and draft models are profiled "
                                    "(default: the packaged configs/cpu.yaml); one that places them on Ray "
                                    "nodes (process: ray) is measured as placed: the link to each actor, "
                                    "drafting and verifying, and the cost model's verdict")
    p.add_argument("--backends", help="comma-separated backends to profile (default: all available)")
    p.add_argument("--precisions", help="comma-separated precisions to profile (default: all)")
    p.add_argument("--k-max", type=int, default=None, help="verify widths 1..k_max+1 (default 8; quick: 4)")
    p.add_argument("--quick", action="store_true", help="short prompts and few repeats (a first look)")
    p.add_argument("--refresh", action="store_true", help="measure again even if a cached profile exists")
    p.add_argument("--explain", action="store_true", help="also rank placements as `placement: auto` would")
    p.add_argument("--alpha-ngram", type=float, help="assumed n-gram acceptance for --explain")
    p.add_argument("--alpha-model", type=float, help="assumed draft-model acceptance for --explain")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--progress", action="store_true", help="show progress even when stderr is not a TTY")
    from hetero_sd.flags import add_model_flags

    add_model_flags(p)
    p.set_defaults(func=run)


def _models(cfg) -> tuple[Path, Path | None]:
    from hetero_sd.config import resolve_model

    base = Path(cfg.source).parent if cfg.source != "<defaults>" else None
    target = resolve_model(cfg.target.model, base, cfg.download).resolve()
    draft = None
    d = cfg.drafter
    if d.kind in ("model", "auto") or (d.kind == "hybrid" and d.hybrid_with == "model"):
        draft = resolve_model(d.model or cfg.target.model, base, cfg.download).resolve()
    return target, draft


def _stage_models(cfg) -> list[Path]:
    """drafter.stages' models, outermost first (a cascade's intermediate models)."""
    from hetero_sd.config import resolve_model

    base = Path(cfg.source).parent if cfg.source != "<defaults>" else None
    return [resolve_model(s.model or cfg.target.model, base, cfg.download).resolve() for s in cfg.drafter.stages]


def _kind_inputs(cfg, target: Path):
    """What --explain needs to price every drafter kind: the head's estimated step where
    a trained head exists (else why not), and drafters in a worker process too."""
    from hetero_sd.assets import head_path
    from hetero_sd.draft_options import KindInputs, head_fraction
    from hetero_sd.errors import HeteroSDError
    from hetero_sd.ir.model import load_model_ir

    try:
        head_path(cfg)
    except HeteroSDError as exc:
        return KindInputs(no_head=f"no trained head: {exc}", workers=True)
    return KindInputs(head_fraction=head_fraction(load_model_ir(target).config.num_layers), workers=True)


def run(args) -> int:
    from hetero_sd import flags
    from hetero_sd.errors import ConfigError
    from hetero_sd.options import config_options
    from hetero_sd.profiler import ProfileSettings, build_problem, profile_models
    from hetero_sd.scheduler import plan

    cfg = flags.load(args)
    if uses_ray(cfg):
        return _profile_cluster(cfg, args)
    target, draft = _models(cfg)
    stages = _stage_models(cfg)
    k_max = args.k_max
    if k_max is not None and not 1 <= k_max <= 16:
        raise ConfigError(f"--k-max must be in 1..16, got {k_max}")
    settings = ProfileSettings.quick(k_max or 4) if args.quick else ProfileSettings(k_max=k_max or 8)
    report = profile_models([target] + ([draft] if draft else []) + stages, _csv(args.backends),
                            _csv(args.precisions),
                            settings, refresh=args.refresh, progress=args.progress or sys.stderr.isatty(),
                            kv_budget=cfg.memory.kv_budget, options=config_options(cfg))
    roles = {str(target): "target"}
    if draft is not None:
        roles[str(draft)] = _draft_role(draft, target)
    chosen = None
    if args.explain:
        alphas = {**cfg.auto.acceptance,
                  **{k: v for k, v in (("ngram", args.alpha_ngram), ("model", args.alpha_model)) if v is not None}}
        chosen = plan(build_problem(report, target, draft, alphas, kinds=_kind_inputs(cfg, target),
                                    stage_models=tuple(stages), overlap=cfg.scheduler.overlap))
    if args.json:
        out = report.to_json()
        for entry in out["profiles"]:
            entry["role"] = roles.get(entry["model_path"], "")
        if chosen is not None:
            out["plan"] = {"explain": chosen.explain(), "best": _candidate_json(chosen.best)}
        print(json.dumps(out))
    else:
        _print_table(report, roles)
        if chosen is not None:
            print(chosen.explain())
    return 0


def _draft_role(draft: Path, target: Path) -> str:
    from hetero_sd.loading import Loader

    if draft == target:
        return "target+draft"
    # such a draft's tokens are re-tokenized into the target's ids each round (drafting/cross_vocab.py)
    return "draft" if Loader().shares_tokenizer(draft, target) else "draft (another tokenizer: drafts via text)"


def uses_ray(cfg) -> bool:
    return any(s.process == "ray" for s in (cfg.target, cfg.drafter, *cfg.drafter.stages))


def _profile_cluster(cfg, args) -> int:
    """A placement across Ray nodes: the devices are on other machines, so what is
    measured here is the placement as built: the link to each actor, the drafter's
    D(k), the target's V(k+1) and V(1), and the cost model's verdict on them."""
    from hetero_sd.cluster.explain import explain_cluster
    from hetero_sd.engine import Engine

    engine = Engine.from_config(cfg, progress=args.progress or sys.stderr.isatty())
    try:
        k = cfg.drafter.k if isinstance(cfg.drafter.k, int) else cfg.drafter.k_max
        text = explain_cluster(engine, k, sampled=not cfg.generation.sampling().greedy)
    finally:
        engine.close()
    print(json.dumps({"cluster": text}) if args.json else text)
    return 0


def _candidate_json(c) -> dict:
    return {"target": str(c.target), "drafter": c.drafter,
            "draft_placement": None if c.draft_placement is None else str(c.draft_placement),
            "k": c.k, "tokens_per_s": c.tokens_per_s, "label": c.drafter_label,
            "overlap": c.overlap.on, "overlap_why": c.overlap.why}


def _decode(e) -> str:
    """The one-token step, and beside it the step as a draft where that is cheaper (unpadded)."""
    out = f"{e.decode_s * 1e3:.2f}"
    if 0 < e.draft_decode_s < 0.95 * e.decode_s:
        out += f" ({e.draft_decode_s * 1e3:.2f} as draft)"
    return out


_MATMULS = (("by MatMulNBits", "MatMulNBits"), ("and GGUFMatMul", "GGUFMatMul"), ("by our BlockMatMul", "BlockMatMul"))


def _kernel(choice: str) -> str:
    """The matmul that runs (backends/kernel_timing.py) and the row check's verdict
    (backends/row_check.py), short; "" for runners without one."""
    if not choice:
        return ""
    matmul = next((f"{name}, " for said, name in _MATMULS if said in choice), "")
    short = "unpadded" if "unpadded" in choice else "odd calls padded" if "odd-width" in choice else "padded"
    return matmul + short + (" (forced)" if "forced" in choice or "pad_single_row" in choice else "")


def _print_table(report, roles: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    s = report.settings
    host = report.host
    table = Table(title=f"hetero-sd profile on {host['hostname']} ({host['cpu']}, {host['cores']} cores); "
                        f"ms, median of {s.repeats}")
    table.add_column("model")
    table.add_column("role")
    table.add_column("placement")
    table.add_column("exact")
    table.add_column("prefill n:ms", justify="right")
    table.add_column("decode", justify="right")
    table.add_column(f"verify w=1..{s.k_max + 1}", justify="right")
    table.add_column("calls")  # async: the runner returns before the device is done (overlap possible)
    table.add_column("matmul, one-token calls")
    table.add_column("source")
    for e in report.entries:
        table.add_row(e.model, roles.get(e.model_path, ""), str(e.placement), "yes" if e.exact else "no",
                      " ".join(f"{n}:{t * 1e3:.1f}" for n, t in e.prefill), _decode(e),
                      " ".join(f"{t * 1e3:.2f}" for _, t in e.verify), "async" if e.asynchronous else "sync",
                      _kernel(e.kernel),
                      "cache" if e.cached else "measured")
    for f in report.failures:
        table.add_row(f["model"], roles.get(f["model_path"], ""), f["placement"], "-", "", "",
                      f"[red]{f['error']}[/red]", "", "", "failed")
    console = Console()
    if not console.is_terminal:  # piped: keep one placement per line rather than wrap at 80 columns
        console = Console(width=240)
    console.print(table)
    print(f"n-gram lookup: {report.ngram_round_s * 1e6:.1f} us per round")
