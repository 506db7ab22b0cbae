"""Model and draft flags shared by `generate`, `chat`, `serve` and `profile`: each sets
the YAML key of the same meaning, named as llama.cpp names it where it has a name
(its short aliases work too), so a model runs with no YAML at all:

    hetero-sd generate -m model.gguf -md draft.gguf --draft-max 6 -p "..."

A flag wins over the YAML file (`--config`, default the packaged configs/cpu.yaml).
`--print-config` prints the merged YAML and exits; fed back as `--config`, it builds
the same engine. FLAGS is the one table: the parser, the overrides, and the docs'
table (docs/configuration.md) all come from it.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from hetero_sd.errors import ConfigError


def _draft_max(text: str):
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of draft tokens or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (or 'auto'), got {value}")
    return value


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    key: str  # the YAML key it sets
    help: str
    peers: str  # the llama.cpp / vLLM equivalent, for the docs' table
    group: str = "model"
    type: object = str


FLAGS = (
    Flag(("-m", "--model"), "target.model", "the target: a .gguf file, a HF folder, a catalog name or ORG/NAME",
         "llama.cpp -m; vLLM's model argument"),
    Flag(("--backend",), "target.backend", "the target's backend (hetero-sd devices lists them)",
         "vLLM --device (roughly)"),
    Flag(("--device", "-dev"), "target.device", "the target's device, e.g. cpu, cuda:0", "llama.cpp --device"),
    Flag(("--precision",), "target.precision", "the target's precision, e.g. fp32, int8, gguf",
         "vLLM --dtype / --quantization"),
    Flag(("--kv-budget",), "memory.kv_budget", "the KV pool per runner, e.g. 1GiB", "vLLM --kv-cache-memory"),
    Flag(("--drafter",), "drafter.kind", "the drafter kind: ngram, suffix, model, head, hybrid, none, auto",
         "vLLM speculative_config.method", "draft"),
    Flag(("-md", "--draft-model", "--model-draft"), "drafter.model",
         "the draft model (implies --drafter model unless the drafter already takes a model)",
         "llama.cpp -md; vLLM speculative_config.model", "draft"),
    Flag(("--draft-backend",), "drafter.backend", "the draft model's backend", "-", "draft"),
    Flag(("--draft-device", "-devd", "--device-draft"), "drafter.device", "the draft model's device",
         "llama.cpp --device-draft", "draft"),
    Flag(("--draft-precision",), "drafter.precision", "the draft model's precision", "-", "draft"),
    Flag(("--draft-max", "--draft", "--draft-n"), "drafter.k", "draft tokens per round, or auto",
         "llama.cpp --draft-max; vLLM num_speculative_tokens", "draft", _draft_max),
)
_TAKES_A_MODEL = ("model", "hybrid")
_by_key = {flag.key: flag for flag in FLAGS}


def add_model_flags(parser: argparse.ArgumentParser, print_config: bool = True) -> None:
    groups = {"model": parser.add_argument_group("model (each flag overrides its YAML key)"),
              "draft": parser.add_argument_group("draft")}
    for flag in FLAGS:
        groups[flag.group].add_argument(*flag.names, dest=_dest(flag), type=flag.type, default=None,
                                        metavar=flag.key.split(".")[-1].upper(), help=f"{flag.help} ({flag.key})")
    groups["model"].add_argument("--download", dest="flag_download", action="store_true", default=None,
                                 help="fetch a Hugging Face id (-m ORG/NAME) missing from the hub cache (download)")
    if print_config:
        parser.add_argument("--print-config", action="store_true",
                            help="print the merged YAML (file, then flags) and exit")


def _dest(flag: Flag) -> str:
    return "flag_" + flag.key.replace(".", "_")


def overrides(args) -> dict:
    """The dotted YAML keys the flags set ({} when none is given)."""
    out = {flag.key: getattr(args, _dest(flag)) for flag in FLAGS if getattr(args, _dest(flag), None) is not None}
    if getattr(args, "flag_download", None):
        out["download"] = True
    return out


def load(args, extra: dict | None = None):
    """The config: args.config (or the packaged default), then `extra` (a command's own
    overrides), then the model flags. A flag that changes the drafter's kind drops the
    file's keys of the old kind, which would otherwise be an error for the new one."""
    from hetero_sd.config import load_config

    flags = overrides(args)
    if "drafter.model" in flags and "drafter.kind" not in flags:
        base = load_config(args.config, extra)
        if base.drafter.kind not in _TAKES_A_MODEL:
            flags["drafter.kind"] = "model"
    try:
        cfg = load_config(args.config, {**(extra or {}), **flags}, drop_other_kinds="drafter.kind" in flags)
    except ConfigError as exc:  # name the flag that set the key the message is about
        given = [f"{_by_key[key].names[-1 if key == 'drafter.kind' else 0]} sets {key}" for key in flags
                 if key in str(exc) and key in _by_key]
        raise ConfigError(f"{exc}" + (f" ({'; '.join(given)})" if given else "")) from None
    if getattr(args, "print_config", False):
        print(dump(cfg), end="")
        raise SystemExit(0)
    return cfg


def dump(cfg) -> str:
    """The config as YAML: the keys the file and the flags set (defaults stay implicit,
    so the kind checks read it as they read the original), model paths made absolute."""
    import yaml

    data = cfg.model_dump(mode="json", exclude_unset=True)
    base = Path(cfg.source).parent if cfg.source != "<defaults>" else Path.cwd()
    for section in ("target", "drafter"):
        model = data.get(section, {}).get("model")
        if model is not None and (base / model).exists() and not Path(model).is_absolute():
            data[section]["model"] = str((base / model).resolve())
    return yaml.safe_dump(data, sort_keys=False)


def table() -> str:
    """docs/configuration.md's flag table, in markdown."""
    rows = ["| Flag | YAML key | llama.cpp / vLLM |", "|---|---|---|"]
    rows += [f"| `{' / '.join(f.names)}` | `{f.key}` | {f.peers} |" for f in FLAGS]
    return "\n".join(rows)


__all__ = ["FLAGS", "ConfigError", "add_model_flags", "dump", "load", "overrides", "table"]
