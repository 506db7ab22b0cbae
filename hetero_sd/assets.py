"""Finding what a config names on disk: its models (relative to the YAML's folder),
the suffix drafter's corpus and the EAGLE-3 head (`auto`: one built here, else one
the package ships).

    model_path(cfg, None)       the target's model, resolved
    suffix_corpus(cfg)          drafter.suffix_corpus as a checked path, or None
    head_path(cfg)              drafter.head as a folder with a config.json

spec.py turns what these find into the spec tree; `hetero-sd build-corpus` and
`hetero-sd train-head` write where default_corpus and default_head point.
"""
from __future__ import annotations

from pathlib import Path

from hetero_sd.config import Config, resolve_model
from hetero_sd.errors import ConfigError


def config_dir(cfg: Config) -> Path | None:
    """The folder relative model paths are resolved against (the YAML's)."""
    return Path(cfg.source).parent if cfg.source != "<defaults>" else None


def model_path(cfg: Config, model: str | None) -> str:
    """A section's model, resolved; None means the target's."""
    return str(resolve_model(model or cfg.target.model, config_dir(cfg), cfg.download))


def _beside_config(cfg: Config, choice: str) -> Path:
    """A path the YAML names, relative to its folder."""
    path = Path(choice).expanduser()
    if not path.is_absolute() and config_dir(cfg) is not None:
        path = config_dir(cfg) / path
    return path


def default_corpus(target_model: str) -> Path:
    """Where `hetero-sd build-corpus` puts, and `suffix_corpus: auto` finds, a target's corpus."""
    from hetero_sd.ir.cache import cache_dir

    return cache_dir("corpora", Path(target_model)) / "corpus.safetensors"


def packaged_corpus(target_model: str) -> Path:
    """A corpus shipped with the package for a target (hetero_sd/corpora/<file stem>.safetensors)."""
    return Path(__file__).parent / "corpora" / f"{Path(target_model).stem}.safetensors"


def suffix_corpus(cfg: Config) -> str | None:
    """drafter.suffix_corpus as a checked path, or None (none, or auto with none built or shipped)."""
    from hetero_sd.drafting.corpus_file import corpus_info

    choice, target = cfg.drafter.suffix_corpus, model_path(cfg, None)
    if choice == "none":
        return None
    if choice == "auto":
        return next((str(p) for p in (default_corpus(target), packaged_corpus(target)) if p.is_file()), None)
    path = _beside_config(cfg, choice)
    try:
        corpus_info(path)
    except ConfigError as exc:
        raise ConfigError(f"{cfg.source}: drafter.suffix_corpus: {exc}") from None
    return str(path)


def default_head(target_model: str) -> Path:
    """Where `hetero-sd train-head` puts, and `head: auto` finds, the head for a target."""
    from hetero_sd.ir.cache import cache_dir

    return cache_dir("heads", Path(target_model))


def packaged_head(target_model: str) -> Path:
    """Where a head shipped with the package for a target lives (hetero_sd/heads/<file stem>)."""
    return Path(__file__).parent / "heads" / Path(target_model).stem


def head_path(cfg: Config) -> Path:
    """drafter.head as a folder that has a config.json (auto: one trained here first,
    else the one the package ships), or a ConfigError that says how to get one."""
    d, target = cfg.drafter, model_path(cfg, None)
    if d.head == "auto":
        path = next((p for p in (default_head(target), packaged_head(target)) if (p / "config.json").exists()),
                    None)
        if path is None:
            raise ConfigError(f"{cfg.source}: drafter.head: auto, but no head has been trained for "
                              f"{Path(target).name} yet (looked in {default_head(target)}) and none ships "
                              f"for it; build it once with `hetero-sd train-head --config {cfg.source}`, "
                              "or name a head folder")
        return path
    path = _beside_config(cfg, d.head)
    if not (path / "config.json").exists():
        raise ConfigError(f"{cfg.source}: drafter.head: {d.head!r} is not a head folder "
                          f"(no {path / 'config.json'})")
    return path
