"""The `hetero-sd` command line: generate, devices, models, profile, bench."""
from __future__ import annotations

import argparse
import json
import sys

from hetero_sd.errors import GenerationError, HeteroSDError


def _generate(args) -> int:
    from hetero_sd import flags
    from hetero_sd.engine import Engine
    from hetero_sd.sampling import SamplingParams

    # Check the flags first, so an error names the flag rather than the config file.
    SamplingParams(*(v if v is not None else d for v, d in zip(
        (args.temperature, args.top_k, args.top_p, args.seed), (0.0, 0, 1.0, None))))
    overrides = {"generation.max_new_tokens": args.max_new_tokens, "generation.temperature": args.temperature,
                 "generation.top_k": args.top_k, "generation.top_p": args.top_p, "generation.seed": args.seed}
    if args.no_chat_template:
        overrides["generation.chat_template"] = False
    if args.ignore_eos:
        overrides["generation.ignore_eos"] = True
    constraint = _constraint(args)  # a bad grammar fails before any model loads
    cfg = flags.load(args, overrides)
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    if not prompt.strip():
        raise HeteroSDError("no prompt: pass --prompt TEXT or pipe text on stdin")
    # --target-only builds no drafter at all: a baseline must not pay for loading a draft model.
    engine = Engine.from_config(cfg, progress=not args.json and sys.stderr.isatty() or args.progress,
                                target_only=args.target_only)
    if args.explain:
        print(_explain(engine, cfg, args.target_only), file=sys.stderr)
    # Text goes to stdout as it is committed (a TTY or a pipe alike); --json: one object at the end.
    stream = None if args.json else _write_now
    try:
        result = engine.generate(prompt, target_only=args.target_only, constraint=constraint, on_text=stream)
    except GenerationError as exc:
        partial = exc.partial
        if partial is not None and partial.token_ids:  # never lose what was already produced (streamed: shown)
            print(json.dumps({**partial.to_dict(), "error": str(exc)}) if args.json else "")
        raise
    if args.json:
        print(json.dumps(result.to_dict()))
    else:
        print()
        print(result.stats.summary(), file=sys.stderr)
    return 0


def _write_now(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _explain(engine, cfg, target_only: bool = False) -> str:
    # what the engine does, whatever planned it: drafting during the verify or serially, and why
    overlap = "" if target_only or engine.drafter is None else \
        f"\noverlap: {'on' if engine.overlap().on else 'serial'}: {engine.overlap().why}"
    if engine.plan is not None:
        text = engine.plan.explain()
        if target_only:
            text += (f"\n--target-only: {engine.plan.best.target} alone, the target the plan verifies on "
                     "(its drafter is not built), so the output is what the speculative run must equal")
        return text  # (the plan's own overlap line says what the engine does)
    from hetero_sd.cluster.explain import explain_cluster

    k = cfg.drafter.k if isinstance(cfg.drafter.k, int) else cfg.drafter.k_max
    across = explain_cluster(engine, k, sampled=not cfg.generation.sampling().greedy)
    return (across or ("placement: manual (the config fixes every placement; set placement: auto to let "
                       "the splitter choose)")) + overlap


def _constraint(args):
    """The Constraint the flags ask for (at most one), checked; None when none."""
    from hetero_sd.constraint import Constraint, read_source

    given = [(flag, value) for flag, value in (("--json-schema", args.json_schema), ("--regex", args.regex),
                                               ("--grammar", args.grammar), ("--any-json", args.any_json))
             if value]
    if len(given) > 1:
        raise HeteroSDError(f"give one constraint, not {' and '.join(flag for flag, _ in given)}")
    if not given:
        return None
    flag, value = given[0]
    if flag == "--any-json":
        constraint = Constraint.any_json(flag)
    elif flag == "--regex":
        constraint = Constraint.regex(value, flag)
    else:
        kind = "json_schema" if flag == "--json-schema" else "grammar"
        constraint = Constraint(kind, read_source(value), flag)
    constraint.check()
    return constraint


def _devices(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from hetero_sd.backends.registry import discover
    from hetero_sd.config import load_config
    from hetero_sd.options import config_options

    # the backend options a config gives (with --config), else the defaults and the
    # environment's switches (read by load_config, as for every command)
    registry = discover(config_options(load_config(args.config)))
    table = Table(title="hetero-sd backends and devices on this host")
    for col in ("backend", "device", "description", "precisions (default*, exact=batch-invariant)"):
        table.add_column(col)
    rows = []
    for name, backend in sorted(registry.backends.items()):
        for info in backend.probe():
            precs = ", ".join(
                f"{p.name}{'*' if p.name == info.default_precision else ''}"
                f"{' exact' if p.batch_invariant else ''}" for p in info.precisions)
            table.add_row(name, info.device, info.description, precs)
            rows.append({"backend": name, "device": info.device, "description": info.description,
                         "default_precision": info.default_precision,
                         "precisions": [p.__dict__ for p in info.precisions]})
    for name, why in sorted(registry.broken.items()):
        table.add_row(name, "-", f"[red]skipped: {why}[/red]", "")
    if args.json:
        print(json.dumps({"devices": rows, "broken": registry.broken, "families": _families()}))
    else:
        console = Console()
        console.print(table)
        # what each precision keeps and rounds (where a block type has no exact form, say so)
        for row in rows:
            for p in row["precisions"]:
                if p.get("note"):
                    console.print(f"  {row['backend']}:{row['device']} [bold]{p['name']}[/bold]: {p['note']}",
                                  highlight=False)
        _row_checks(console)
        console.print("model families every backend above lowers from the IR (hetero-sd models lists them): "
                      + ", ".join(f["family"] for f in _families()), highlight=False)
    return 0


def _families() -> list[dict]:
    from hetero_sd.ir import families

    return families.supported()


def _families_table():
    from rich.table import Table

    table = Table(title="model families (Hugging Face folders and GGUF files; every backend; docs/models.md)")
    for col in ("family", "HF model_type", "GGUF architecture", "what it adds to the Llama decoder"):
        table.add_column(col)
    for f in _families():
        table.add_row(f["family"], ", ".join(f["hf_model_types"]), ", ".join(f["gguf_archs"]) or "-", f["what"])
    return table


def _row_checks(console) -> None:
    """The per-host kernel choices cached so far, model by model: whether one-token calls
    of a quantized graph runner run padded (backends/row_check.py), and which matmul
    runs where more than one is exact (backends/kernel_timing.py)."""
    from hetero_sd.backends.kernel_timing import cached_choices
    from hetero_sd.backends.row_check import cached_verdicts, host_signature
    from hetero_sd.ir.cache import cache_root

    verdicts = cached_verdicts(cache_root() / "row-check")
    host = host_signature()
    console.print(f"one-token calls on this host ({host['cpu']}; {' '.join(host['flags']) or 'no SIMD flags read'}):"
                  + ("" if verdicts else " no model checked yet (a quantized graph runner checks at its first load)"),
                  highlight=False)
    for label, verdict in verdicts:
        console.print(f"  {label}: {verdict.describe()}", highlight=False)
    choices = cached_choices(cache_root() / "kernel-choice")
    if choices:
        console.print("quantized matmuls on this host (the faster exact path, backends/kernel_timing.py):",
                      highlight=False)
    for label, choice in choices:
        console.print(f"  {label}: {choice.chosen}, {choice.describe()}", highlight=False)


def _model_details(args) -> int:
    """`models --details MODEL`: the end-of-generation set generation stops at."""
    from hetero_sd.config import resolve_model
    from hetero_sd.ir.eog import describe_eog
    from hetero_sd.loading import Loader

    path = str(resolve_model(args.details, None))
    load = Loader()
    rows = describe_eog(load.ir(path), load.tokenizer(path))
    if args.json:
        print(json.dumps({"model": path, "end_of_generation": [
            {"id": i, "text": text, "sources": sources} for i, text, sources in rows]}))
        return 0
    print(f"{path}\nend of generation ({len(rows)} ids; generation stops at any of them):")
    for i, text, sources in rows:
        print(f"  {i:>7}  {text!r:<24} {sources}")
    return 0


def _models(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from hetero_sd import catalog, hub

    if args.details:
        return _model_details(args)

    rows = [catalog.status(entry) for entry in catalog.entries()]  # cheap: sizes and markers, no hashing
    hub_rows = hub.cached_models()  # the Hugging Face cache's models: a scan, no hashing, no network
    if args.json:
        print(json.dumps({"models": rows, "hub": hub_rows, "families": _families()}, default=str))
        return 0
    table = Table(title="hetero-sd named models (use the name as `model:` in a config)")
    table.add_column("name", no_wrap=True)  # the one thing to copy into a config: never cut
    for col in ("description", "size", "licence", "installed", "verified"):
        table.add_column(col)
    for row in rows:
        name = row["name"] + "".join(f"\n[dim]alias: {a}[/dim]" for a in row["aliases"])
        installed = "[green]yes[/green]" if row["installed"] else f"[red]no[/red] ({len(row['missing'])} missing)"
        # Not verified yet: the first use joins (chunks) and checks it, once.
        verified = "[green]yes[/green]" if row["verified"] else "on first use"
        table.add_row(name, row["description"], f"{row['size'] / 2**20:,.0f} MiB", row["licence"], installed,
                      verified)
    console = Console()
    console.print(table)
    for row in rows:
        if not row["installed"]:
            extra = f"  (or: pip install -e \".[{row['extra']}]\" from a checkout)" if row["extra"] else ""
            console.print(f"install {row['name']}: {row['install']}{extra}", soft_wrap=True, highlight=False)
    if hub_rows:
        console.print(hub.models_table(hub_rows))
    console.print(_families_table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hetero-sd", description="Lossless speculative decoding across heterogeneous backends.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt",
                         description="Generate text; the default config runs SmolLM2-135M on the CPU "
                                     "(onnxruntime, the file's own Q4_1 blocks) with suffix-decoding drafts and k: auto.")
    gen.add_argument("--config", help="YAML config (default: the packaged configs/cpu.yaml)")
    gen.add_argument("-p", "--prompt", help="the prompt (default: read stdin)")
    gen.add_argument("-n", "--max-new-tokens", type=int, help="override generation.max_new_tokens")
    gen.add_argument("--target-only", action="store_true",
                     help="no speculation (baseline): the drafter section is ignored and not loaded")
    gen.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="generate max_new_tokens past the end-of-generation set (generation.ignore_eos)")
    from hetero_sd.flags import add_model_flags

    add_model_flags(gen)
    sam = gen.add_argument_group("sampling")
    sam.add_argument("--temp", "--temperature", dest="temperature", type=float,
                     help="sampling temperature (0 = greedy, the default)")
    sam.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 = off)")
    sam.add_argument("--top-p", type=float, help="nucleus sampling mass in (0, 1] (1 = off)")
    sam.add_argument("-s", "--seed", type=int, help="seed for reproducible sampling")
    con = gen.add_argument_group("constrained output (one of; lossless under speculation)")
    con.add_argument("--json-schema", metavar="FILE|JSON", help="output is JSON valid under this JSON Schema")
    con.add_argument("--any-json", action="store_true", help="output is a JSON object (any keys)")
    con.add_argument("--regex", help="output matches this regular expression (Rust regex syntax)")
    con.add_argument("--grammar", metavar="FILE|TEXT", help="output follows this GBNF (llama.cpp) or Lark grammar")
    out = gen.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    out.add_argument("--explain", action="store_true",
                     help="print why each placement was chosen (placement: auto) to stderr")
    out.add_argument("--progress", action="store_true", help="show load progress even when not a TTY")
    gen.set_defaults(func=_generate)
    dev = sub.add_parser("devices", help="list backends, devices and precisions on this host")
    dev.add_argument("--json", action="store_true", help="print JSON instead of a table")
    dev.add_argument("--config", help="YAML config whose `options:` the backends are probed with "
                     "(default: the packaged configs/cpu.yaml)")
    dev.set_defaults(func=_devices)
    mod = sub.add_parser("models", help="list the named models a config's `model:` accepts, and the model families that load",
                         description="Named models: where they come from (pip packages), whether they are "
                                     "installed here and verified, and how to install them.")
    mod.add_argument("--json", action="store_true", help="print JSON instead of a table")
    mod.add_argument("--details", metavar="MODEL",
                     help="one model's end-of-generation set: each id, its text and where it comes from")
    mod.set_defaults(func=_models)
    from hetero_sd import chat, profile_cli
    from hetero_sd.bench import add_parser as add_bench_parser
    from hetero_sd.serve import cli as serve_cli
    from hetero_sd.training import cli as train_cli
    from hetero_sd.training import corpus_build

    chat.add_parser(sub)
    profile_cli.add_parser(sub)
    add_bench_parser(sub)
    serve_cli.add_parser(sub)
    train_cli.add_parser(sub)
    corpus_build.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except HeteroSDError as exc:
        print(f"hetero-sd: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
