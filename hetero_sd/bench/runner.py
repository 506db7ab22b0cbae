"""The bench, start to end: check every input, tokenize once, run ours then
the peers one after another in this process, compare, write the files."""
from __future__ import annotations

import datetime
import importlib.util
import json
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

from hetero_sd.bench.common import EOS_POLICIES, WARMUP_PROMPT, Progress, RunResult, Workload
from hetero_sd.bench.ours import TARGET_ONLY, load_configs, planned_runs, run_ours
from hetero_sd.bench.prompts import load_prompts, prompts_path
from hetero_sd.bench.report import compare, headline, summarize, to_markdown
from hetero_sd.config import PACKAGED, Config, resolve_model
from hetero_sd.errors import ConfigError

PEERS = ("genai", "transformers", "llamacpp")
RUNS_PER_PEER = {"genai": 6, "transformers": 3, "llamacpp": 3}
DEFAULT_CONFIGS = ("cpu.yaml", "cpu-draft-model.yaml")
NO_CONFIGS = "none"  # --config none: only the peers (the reference is then the first peer's plain greedy)


def default_peers() -> tuple[str, ...]:
    """genai and transformers (listed as skipped when absent), and llamacpp where it is
    installed: found without importing it, since importing loads its native library."""
    return ("genai", "transformers") + (("llamacpp",) if importlib.util.find_spec("llama_cpp") else ())


def _absolute(model: str | None) -> str | None:
    """A path that exists becomes absolute (configs live elsewhere); names stay names."""
    if model is not None and model != "default" and Path(model).expanduser().exists():
        return str(Path(model).expanduser().resolve())
    return model


@dataclass
class BenchOptions:
    prompts: str | None = None  # None: the packaged prompt set
    configs: list[str] = field(default_factory=list)  # empty: DEFAULT_CONFIGS from the package
    peers: tuple[str, ...] = field(default_factory=default_peers)
    max_new_tokens: int = 128
    kinds: list[str] | None = None
    model: str = "default"
    draft_model: str | None = None  # None: the first draft-model configuration's draft, else the target
    eos_policy: str = "ignore"
    progress: bool | None = None  # None: a bar only when stderr is a terminal
    llamacpp_bin: str | None = None  # llama.cpp's C++ tools (llama-bench) run beside the runs (llamacpp_tools.py)

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        unknown = [p for p in self.peers if p not in PEERS]
        if unknown:
            raise ConfigError(f"--peers: unknown {', '.join(unknown)}; allowed: {', '.join(PEERS)} or none")
        if self.eos_policy not in EOS_POLICIES:
            raise ConfigError(f"--eos must be one of {', '.join(EOS_POLICIES)}, got {self.eos_policy!r}")
        if NO_CONFIGS in self.configs and len(self.configs) > 1:
            raise ConfigError("--config none runs none of our configurations: it cannot be combined with others")
        if self.configs == [NO_CONFIGS] and not self.peers:
            raise ConfigError("--config none with --peers none leaves nothing to run")


def _peer_spec(configs: list[Config], model_path: Path) -> dict:
    """Peers draft like our configurations do: the first n-gram and the first draft-model config
    (a `k: auto` of ours keeps the peer's fixed default: peers have no adaptive length)."""
    spec = {"ngram_k": 5, "max_ngram": 4, "draft_k": 4, "draft_path": model_path, "draft_precision": "fp32"}
    fixed = lambda k, default: k if isinstance(k, int) else default  # noqa: E731
    ngram = next((c for c in configs if c.drafter.kind == "ngram"), None)
    if ngram:
        spec["ngram_k"], spec["max_ngram"] = fixed(ngram.drafter.k, 5), ngram.drafter.max_ngram
    drafted = next((c for c in configs if c.drafter.kind == "model"), None)
    if drafted:
        base = Path(drafted.source).parent
        spec["draft_k"], spec["draft_precision"] = fixed(drafted.drafter.k, 4), drafted.drafter.precision
        spec["draft_path"] = resolve_model(drafted.drafter.model or drafted.target.model, base).resolve()
    return spec


def _check_placements(configs: list[Config]) -> None:
    """Backends, devices and precisions exist here (probes only): a typo fails before any load."""
    from hetero_sd.loading import Loader
    from hetero_sd.spec import placed

    load = Loader()
    for cfg in configs:
        load.check(placed(cfg, cfg.target, f"{cfg.source}: target"))
        if cfg.drafter.kind == "model":
            load.check(placed(cfg, cfg.drafter, f"{cfg.source}: draft model"))


def _workload(model_path: Path, prompts, opts: BenchOptions) -> Workload:
    from hetero_sd.engine import encode_text
    from hetero_sd.ir import load_model_ir
    from hetero_sd.ir.eog import eog_ids

    ir = load_model_ir(model_path)
    tok = ir.load_tokenizer()
    eos = set(eog_ids(ir, tok))  # the engine's end-of-generation set (ir/eog.py), as llama.cpp's
    ids = {p.id: encode_text(tok, p.prompt, chat_template=True) for p in prompts}  # the ids every run gets
    return Workload(prompts, ids, encode_text(tok, WARMUP_PROMPT, chat_template=True),
                    opts.max_new_tokens, opts.eos_policy, tuple(sorted(eos)))


def run_bench(opts: BenchOptions) -> dict:
    opts.check()
    prompts = load_prompts(opts.prompts, opts.kinds)
    model, draft = _absolute(opts.model), _absolute(opts.draft_model)
    model_path = resolve_model(model, None).resolve()
    paths = [] if opts.configs == [NO_CONFIGS] else opts.configs or [str(PACKAGED / n) for n in DEFAULT_CONFIGS]
    configs = load_configs(paths, model, opts.max_new_tokens, draft)
    _check_placements(configs)
    work = _workload(model_path, prompts, opts)
    spec = _peer_spec(configs, model_path)
    if draft is not None:  # --draft-model feeds every peer that drafts with a model
        spec["draft_path"] = resolve_model(draft, None).resolve()

    total = len(prompts) * (planned_runs(configs) + sum(RUNS_PER_PEER[p] for p in opts.peers))
    tools = None
    if opts.llamacpp_bin is not None:
        from hetero_sd.bench.llamacpp_tools import Bracket, check

        check(Path(opts.llamacpp_bin))  # a wrong folder fails now, not after the runs
        tools = Bracket(Path(opts.llamacpp_bin), model_path, opts.max_new_tokens)
        tools.measure()
    progress = Progress(total, opts.progress)
    runs: list[RunResult] = []
    skipped: dict[str, str] = {}
    try:
        got, why = run_ours(configs, work, progress)
        runs += got
        skipped |= why
        if "genai" in opts.peers:
            from hetero_sd.bench.genai_peer import run_genai

            got, why = run_genai(model_path, spec["draft_path"], spec, work, progress)
            runs, skipped = runs + got, skipped | why
        if "transformers" in opts.peers:
            from hetero_sd.bench.hf_peer import run_transformers

            got, why = run_transformers(model_path, spec["draft_path"], spec["draft_precision"], spec, work,
                                        progress)
            runs, skipped = runs + got, skipped | why
        if "llamacpp" in opts.peers:
            from hetero_sd.bench.llamacpp_peer import run_llamacpp

            got, why = run_llamacpp(model_path, spec["draft_path"], spec, work, progress)
            runs, skipped = runs + got, skipped | why
    finally:
        progress.close()
    if tools is not None:
        tools.measure()
    baseline = reference(runs)
    rows = compare(runs, baseline)
    shown = [r for r in runs if not r.hidden]
    summary = summarize(shown, [row for row in rows if row["run"] in {r.name for r in shown}])
    report = {"meta": _meta(opts, model_path, prompts, paths, spec, baseline), "runs": [_run_info(r) for r in runs],
              "skipped": skipped, "summary": summary, "headline": headline(summary), "results": rows}
    if tools is not None:
        ours = next((r for r in runs if r.name == TARGET_ONLY), None)
        report["llamacpp_tools"] = tools.report([s.decode_tok_s for s in ours.samples if s.decode_tok_s]
                                                if ours is not None else [],
                                                ours.settings.get("precision") if ours is not None else None)
    return report


def reference(runs: list[RunResult]) -> str | None:
    """Our target-only; without our runs (--config none), the first peer's plain greedy."""
    if any(r.name == TARGET_ONLY for r in runs):
        return TARGET_ONLY
    return next((r.name for r in runs if r.own_greedy == r.name), None)


def _run_info(r: RunResult) -> dict:
    return {"name": r.name, "family": r.family, "label": r.label, "settings": r.settings,
            "own_greedy": r.own_greedy, "lossless_settings": r.lossless_settings, "load_s": r.load_s,
            "baseline": r.baseline, "hidden": r.hidden}


def _meta(opts: BenchOptions, model_path: Path, prompts, paths: list[str], spec: dict,
          baseline: str | None) -> dict:
    return {"model": model_path.name, "model_path": str(model_path), "max_new_tokens": opts.max_new_tokens,
            "eos_policy": opts.eos_policy, "greedy": True, "chat_template": True,
            "prompts_file": str(prompts_path(opts.prompts)), "prompts": len(prompts),
            "kinds": list(dict.fromkeys(p.kind for p in prompts)), "configs": paths,
            "peers": list(opts.peers), "baseline": baseline,
            "peer_drafting": {k: str(v) for k, v in spec.items()},
            "host": {"cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                     "processor": platform.processor() or platform.machine(), "python": platform.python_version()},
            "versions": _versions(), "date": datetime.datetime.now().isoformat(timespec="seconds")}


def _versions() -> dict:
    from importlib import metadata

    out = {}
    for dist in ("hetero-sd", "torch", "transformers", "openvino", "openvino-genai", "onnxruntime",
                 "llama-cpp-python"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def write_outputs(report: dict, out_dir: str | Path) -> dict[str, Path]:
    """bench.json, bench.md and bench.png in `out_dir` (created). The figures are written
    first: without matplotlib the chart is left out with a note, the results are kept."""
    from hetero_sd.bench.chart import write_png

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md", "png": out / "bench.png"}
    paths["json"].write_text(json.dumps(report, indent=1) + "\n")
    paths["markdown"].write_text(to_markdown(report))
    try:
        write_png(report, paths["png"])
    except ImportError as exc:
        log(f"no chart: {exc} (pip install -e '.[bench]' for matplotlib)")
        del paths["png"]
    return paths


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
