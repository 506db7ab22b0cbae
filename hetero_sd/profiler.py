"""Measuring what a model costs on every (backend, device, precision) here.

For each model and placement: the prefill time at a few prompt lengths, the
time of a one-token step (what a draft step costs), and the time of one
verify call of w = 1..k_max+1 tokens after a short context. Each figure is the
median of a few repeats after a warm-up call per shape (graph runtimes
compile per shape on first use). Results are cached as JSON under
`<cache_root>/profiles`, keyed by host (hostname, CPU model, cores), the model
files' identity, the placement, the runtime's description and the settings;
`refresh=True` measures again.

The conversion into the scheduler's pure-Python types happens here
(`ProfileEntry.to_profile`, `build_problem`): the scheduler never measures.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import re
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from hetero_sd.ir.cache import cache_root, model_identity
from hetero_sd.backends.options import DEFAULT as DEFAULT_OPTIONS, BackendOptions
from hetero_sd.backends.registry import Registry, discover, load_runner
from hetero_sd.errors import ConfigError
from hetero_sd.ir.model import load_model_ir
from hetero_sd.draft_options import DEFAULT_ACCEPTANCE, KindInputs, draft_options
from hetero_sd.scheduler import Constraints, CostCurve, DeviceProfile, DraftOption, Placement, Problem

PROFILE_VERSION = 3  # bump when what is measured, or how, changes (2: one-token calls padded per host
# check; 3: the one-token step as a draft, unpadded, measured apart)


@dataclass(frozen=True)
class ProfileSettings:
    k_max: int = 8  # verify widths 1..k_max+1
    prompt_lengths: tuple[int, ...] = (32, 128)
    context: int = 128  # decode and verify are timed after a prefill of this many tokens
    repeats: int = 5
    decode_steps: int = 8

    @classmethod
    def quick(cls, k_max: int = 4) -> "ProfileSettings":
        """Short runs (tests, a first look): short prompts, three repeats."""
        return cls(k_max=k_max, prompt_lengths=(8, 24), context=16, repeats=3, decode_steps=4)


@dataclass
class ProfileEntry:
    model: str  # file or folder name
    model_path: str
    backend: str
    device: str
    precision: str
    exact: bool  # the precision is batch-invariant (bitwise-lossless as a target)
    prefill: list[tuple[int, float]]  # (prompt tokens, seconds)
    decode_s: float  # one one-token step after `context` tokens, as a target runs it
    verify: list[tuple[int, float]]  # (width, seconds) for widths 1..k_max+1
    draft_decode_s: float = 0.0  # the same step as a draft model runs it (Runner.draft_only: unpadded)
    measured_at: str = ""
    kernel: str = ""  # the runner's kernel choice for this host (Runner.kernel_choice)
    cached: bool = field(default=False, compare=False)  # read from the cache, not measured now
    # the runner's calls return before the device is done (a CUDA stream): set per run from
    # the backend (`asynchronous_device`), not cached, since it is the device's, not a figure
    asynchronous: bool = field(default=False, compare=False)

    @property
    def placement(self) -> Placement:
        return Placement(self.backend, self.device, self.precision)

    def to_profile(self, draft: bool = False) -> DeviceProfile:
        """The scheduler's view; draft: of the model as a drafter, whose one-token
        step may be cheaper than a target's (a target pads it where its host needs)."""
        step = self.draft_decode_s if draft and self.draft_decode_s > 0 else self.decode_s
        return DeviceProfile(self.model, self.placement, CostCurve(tuple(self.prefill)), step,
                             CostCurve(tuple(self.verify)), self.exact, self.asynchronous)


@dataclass
class ProfileReport:
    host: dict
    settings: ProfileSettings
    entries: list[ProfileEntry]
    failures: list[dict]  # {"model", "model_path", "placement", "error"}: placements that could not be measured
    ngram_round_s: float  # one n-gram lookup round (host-wide, measured each run: microseconds)

    def for_model(self, path: Path | str) -> list[ProfileEntry]:
        want = str(Path(path).resolve())
        return [e for e in self.entries if e.model_path == want]

    def to_json(self) -> dict:
        return {"host": self.host, "settings": asdict(self.settings), "ngram_round_s": self.ngram_round_s,
                "profiles": [asdict(e) for e in self.entries], "failures": self.failures}


# ------------------------------------------------------------------ identity and cache
def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_identity() -> dict:
    return {"hostname": socket.gethostname(), "cpu": cpu_model(), "cores": os.cpu_count()}


def cache_path(ir, placement: Placement, runtime: str, settings: ProfileSettings, host: dict) -> Path:
    key = json.dumps({"v": PROFILE_VERSION, "host": host, "model": model_identity(ir.source), "place": str(placement),
                      "runtime": runtime, "settings": asdict(settings)}, sort_keys=True, default=str)
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{ir.source.stem}-{placement.backend}-{placement.device}-"
                                             f"{placement.precision}")
    return cache_root() / "profiles" / f"{name}-{digest}.json"


def _read_cache(path: Path) -> ProfileEntry | None:
    try:
        data = json.loads(path.read_text())
        entry = ProfileEntry(**data)
    except (OSError, ValueError, TypeError):
        return None  # absent or unreadable: measure again
    entry.prefill = [tuple(p) for p in entry.prefill]
    entry.verify = [tuple(p) for p in entry.verify]
    entry.cached = True
    return entry


def _write_cache(path: Path, entry: ProfileEntry) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = asdict(entry)
    data.pop("cached")
    data.pop("asynchronous")
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)  # atomic: a concurrent reader sees the old file or the new one


# ------------------------------------------------------------------ measuring
def _timed(call) -> float:
    t0 = time.perf_counter()
    call()
    return time.perf_counter() - t0


def measure_runner(runner, settings: ProfileSettings) -> dict:
    """Prefill, one-token step and verify timings (seconds) of one loaded runner, and
    its one-token step as a draft (the runner is left drafting: measure it last)."""
    widths = range(1, settings.k_max + 2)
    room = runner.max_context - (settings.k_max + settings.decode_steps + 2)
    lengths = sorted({max(1, min(n, room)) for n in settings.prompt_lengths})
    ctx = max(1, min(settings.context, room))
    rng = random.Random(0)  # fixed tokens: the same work on every run
    tokens = [rng.randrange(runner.vocab_size) for _ in range(max(lengths + [ctx]) + settings.k_max + 2)]
    seq = runner.allocate(max(lengths + [ctx + max(settings.decode_steps, settings.k_max + 1)]))
    try:
        def prefill(n):
            runner.truncate(seq, 0)
            return _timed(lambda: runner.greedy(seq, tokens[:n], 0, 1))

        def verify(w):
            runner.truncate(seq, ctx)
            return _timed(lambda: runner.greedy(seq, tokens[ctx:ctx + w], ctx, w))

        def decode():
            runner.truncate(seq, ctx)
            steps = [_timed(lambda i=i: runner.greedy(seq, [tokens[ctx + i]], ctx + i, 1))
                     for i in range(settings.decode_steps)]
            return statistics.median(steps)

        rep = range(settings.repeats)
        for n in lengths:
            prefill(n)  # warm-up: graph runtimes compile or pick kernels per shape
        figures = {"prefill": [(n, statistics.median(prefill(n) for _ in rep)) for n in lengths]}
        prefill(ctx)  # the context every decode step and verify runs after
        for w in widths:
            verify(w)
        figures["decode_s"] = statistics.median(decode() for _ in rep)
        figures["verify"] = [(w, statistics.median(verify(w) for _ in rep)) for w in widths]
        figures["kernel"] = runner.kernel_choice  # the target's choice, before it drafts
        # last: draft_only is one-way (a runner told it drafts stays a drafter)
        runner.draft_only()
        decode()
        figures["draft_decode_s"] = statistics.median(decode() for _ in rep)
        return figures
    finally:
        runner.release(seq)


def measure_ngram(rounds: int = 200) -> float:
    """Seconds of one n-gram drafter round on a 256-token context (median of blocks)."""
    from hetero_sd.drafting.build import build_drafter
    from hetero_sd.drafting.specs import NgramSpec
    from hetero_sd.ir.work import DraftRequest

    rng = random.Random(0)
    context = [rng.randrange(64) for _ in range(256)]
    drafter = build_drafter(NgramSpec(), target_vocab=64)
    drafter.draft(DraftRequest(0, 0, 4, context))

    def block():
        return _timed(lambda: [drafter.draft(DraftRequest(0, len(context), 4, [])) for _ in range(rounds)]) / rounds

    return statistics.median(block() for _ in range(5))


def _placements(registry: Registry, backends: list[str] | None, precisions: list[str] | None):
    names = sorted(registry.backends) if backends is None else backends
    out = []
    for name in names:
        backend = registry.get(name)  # unknown or broken: BackendError naming what is available
        for info in backend.probe():
            for prec in info.precisions:
                if precisions is None or prec.name in precisions:
                    out.append((name, info, prec))
    if not out:
        raise ConfigError(f"no placement matches backends {backends or 'all'} and precisions {precisions}; "
                          f"available here: {available_placements(registry)}")
    return out


def asynchronous_device(registry: Registry, backend: str, device: str) -> bool:
    """Whether the runner on this device works asynchronously (Runner.asynchronous): a
    `cuda` backend's CUDA device does (a stream; the Triton interpreter's "cpu" does
    not), a fake device where its spec declares `asynchronous`, every other not."""
    if backend == "cuda":
        return device.lower().startswith("cuda")
    spec_of = getattr(registry.get(backend), "device_spec", None)  # the fake backend's
    if spec_of is None:
        return False
    try:
        return bool(getattr(spec_of(device), "asynchronous", False))
    except Exception:  # a device the spec does not know: no claim
        return False


def available_placements(registry: Registry) -> str:
    return ", ".join(f"{name}:{info.device}/{p.name}" for name, b in sorted(registry.backends.items())
                     for info in b.probe() for p in info.precisions)


def profile_models(models: list[Path], backends: list[str] | None = None, precisions: list[str] | None = None,
                   settings: ProfileSettings = ProfileSettings(), refresh: bool = False, progress: bool = False,
                   kv_budget: int = 64 * 2**20, registry: Registry | None = None,
                   options: BackendOptions = DEFAULT_OPTIONS) -> ProfileReport:
    """Profile each model on every matching placement (cached unless refresh), loaded
    with the backend options `options` (a config's)."""
    from tqdm import tqdm

    registry = registry or discover(options)
    places = _placements(registry, backends, precisions)
    host = host_identity()
    irs = [load_model_ir(m) for m in dict.fromkeys(Path(m).resolve() for m in models)]
    entries, failures = [], []
    bar = tqdm(total=len(irs) * len(places), desc="profiling", unit="placement", file=sys.stderr,
               disable=not progress, leave=False)
    try:
        for ir in irs:
            for name, info, prec in places:
                placement = Placement(name, info.device, prec.name)
                bar.set_postfix_str(f"{ir.source.name} on {placement}", refresh=True)
                path = cache_path(ir, placement, info.description, settings, host)
                entry = None if refresh else _read_cache(path)
                if entry is None:
                    try:
                        entry = _measure(registry, ir, placement, prec.batch_invariant, settings, kv_budget,
                                         options)
                    except Exception as exc:  # one broken placement must not stop the others
                        failures.append({"model": ir.source.name, "model_path": str(ir.source.resolve()),
                                         "placement": str(placement),
                                         "error": f"{type(exc).__name__}: {exc}"})
                        bar.update(1)
                        continue
                    _write_cache(path, entry)
                entry.asynchronous = asynchronous_device(registry, name, info.device)
                entries.append(entry)
                bar.update(1)
    finally:
        bar.close()
    return ProfileReport(host, settings, entries, failures, measure_ngram())


def _measure(registry: Registry, ir, placement: Placement, exact: bool, settings: ProfileSettings,
             kv_budget: int, options: BackendOptions = DEFAULT_OPTIONS) -> ProfileEntry:
    runner = load_runner(registry.get(placement.backend), ir, placement.device, placement.precision, kv_budget,
                         options=options)
    figures = measure_runner(runner, settings)
    return ProfileEntry(ir.source.name, str(ir.source.resolve()), placement.backend, placement.device,
                        placement.precision, exact, measured_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
                        **figures)


# ------------------------------------------------------------------ to the splitter
def build_problem(report: ProfileReport, target_model: Path | str, draft_model: Path | str | None = None,
                  acceptance: dict[str, float] | None = None, k_max: int | None = None,
                  constraints: Constraints = Constraints(), workload=None, kinds: KindInputs | None = None,
                  stage_models: tuple[Path | str, ...] = (), overlap: str = "auto") -> Problem:
    """The splitter's problem: targets = the target model's profiles. Drafters: without
    `kinds`, the n-gram drafter plus, if given, the draft model on each profiled
    placement; with it, every drafter kind (draft_options.py), the draft model's and
    the stage models' (`stage_models`, outermost first) profiles read from the report."""
    alpha = {**DEFAULT_ACCEPTANCE, **(acceptance or {})}
    targets = tuple(e.to_profile() for e in report.for_model(target_model))
    if not targets:
        raise ConfigError(f"no profile of the target model {target_model}; run `hetero-sd profile` for it")
    k_max = k_max or report.settings.k_max
    drafts = tuple(e.to_profile(draft=True) for e in report.for_model(draft_model)) if draft_model else ()
    if kinds is None:
        drafters = [DraftOption("ngram", alpha["ngram"], round_s=report.ngram_round_s)]
        drafters += [DraftOption("model", alpha["model"], p) for p in drafts]
        return Problem(targets, tuple(drafters), k_max, constraints, workload, overlap)
    stages = tuple(tuple(e.to_profile(draft=True) for e in report.for_model(m)) for m in stage_models)
    inputs = replace(kinds, drafts=drafts or kinds.drafts, stages=stages or kinds.stages)
    options, unplanned = draft_options(targets, alpha, report.ngram_round_s, inputs, k_max)
    return Problem(targets, tuple(options), k_max, constraints, workload, overlap, tuple(unplanned))


def auto_plan(target_model: Path | str, draft_model: Path | str | None = None, *,
              constraints: Constraints = Constraints(), acceptance: dict[str, float] | None = None,
              k_max: int = 8, workload=None, backends: list[str] | None = None,
              precisions: list[str] | None = None, quick: bool = False, kv_budget: int = 64 * 2**20,
              progress: bool = False, registry: Registry | None = None,
              options: BackendOptions = DEFAULT_OPTIONS, kinds: KindInputs | None = None,
              stage_models: tuple[Path | str, ...] = (), overlap: str = "auto"):
    """`placement: auto` in one call: profile every placement (cached: only the
    first run on a host pays), then plan under the constraints. kinds: plan every
    drafter kind (build_problem)."""
    from hetero_sd.scheduler import plan

    settings = ProfileSettings.quick(k_max) if quick else ProfileSettings(k_max=k_max)
    models = [target_model] + ([draft_model] if draft_model is not None else []) + list(stage_models)
    report = profile_models(models, backends, precisions, settings, progress=progress, kv_budget=kv_budget,
                            registry=registry, options=options)
    return plan(build_problem(report, target_model, draft_model, acceptance, k_max, constraints, workload,
                              kinds, tuple(stage_models), overlap))
