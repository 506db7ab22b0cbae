"""Load benchmark for `hetero-sd serve`, side by side with llama.cpp's servers.

    python benchmarks/bench_serve.py [--config configs/cpu.yaml] [--levels 1,2,4,8,16,32]
                                     [--requests-per-level N] [--max-tokens 128] [--no-peer]
                                     [--llamacpp-bin DIR] [--servers spec,alt,nospec,cpp,cppspec,peer]
                                     [--alt-config FILE] [--rounds N] [--prompts default,code]
                                     [--json FILE] [--quick]
    python benchmarks/bench_serve.py --soak [--soak-requests 2000] [--soak-concurrency 32] ...   (soak.py)

The load generator is the `openai` package's AsyncOpenAI client driven by
asyncio at a fixed concurrency: C workers each send streaming chat requests
back to back (stream_options.include_usage, temperature 0, fixed max_tokens)
until the level's request count is spent or its time limit passes. Prompts are
the packaged hetero_sd/bench/prompts.jsonl (grounded and open), cycled, so
request i gets the same prompt on every server.

Servers, one at a time (the host's cores go to the one being measured), on a
free port on 127.0.0.1, started afresh for every level and stopped after it;
per level the order rotates so no server always runs first:
- spec:   hetero-sd serve --config X
- alt:    hetero-sd serve --config Y (--alt-config: another drafter, say, side by side)
- nospec: hetero-sd serve --config X --no-speculation
- cpp:    llama.cpp's C++ llama-server (--llamacpp-bin DIR) on the same GGUF,
          threads = our cores, one slot per concurrent request (--parallel
          = the level), each slot --peer-ctx tokens of context;
- cppspec: the same with its n-gram speculation (--cpp-spec-args, default
          --spec-type ngram-simple): its strongest model-free form;
- peer:   python -m llama_cpp.server on the same GGUF, threads = our cores,
          --interrupt_requests False (its default, True, ends a running
          stream with [DONE] as soon as another request arrives).

Per level and server: TTFT (first content chunk), TPOT ((end - first) /
(tokens - 1), per request), end-to-end latency, each p50/p99 over the
requests that finished; output tok/s = completion tokens of finished
requests / the level's wall time; done and failed counts (an error, a
timeout, or a stream that ended without finish_reason). Completion tokens
come from the usage chunk (ours and llama-server); llama_cpp.server sends none, so for it they are
max_tokens when finish_reason is "length", else the content chunks (it
streams one token per chunk; a held-back partial UTF-8 byte sequence makes
that an undercount by a few). Not a test: speed is measured, never asserted.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_procs import (HOST, acceptance, cores, free_port, scrape_acceptance, serving,  # noqa: E402,F401
                         stop, wait_ready)

API_KEY = "bench"  # neither server is started with --api-key; the client needs some string
LEVELS = (1, 2, 4, 8, 16, 32)
SERVERS = ("spec", "alt", "nospec", "cpp", "cppspec", "peer")
PEERS = ("cpp", "cppspec", "peer")
OURS = ("spec", "alt", "nospec")
LABELS = {"spec": "ours spec", "alt": "ours alt", "nospec": "ours no-spec", "cpp": "llama-server",
          "cppspec": "llama-server ngram", "peer": "llama-cpp-python"}
REPO = Path(__file__).resolve().parents[1]


# ---- one request, one level -------------------------------------------------------------

@dataclass
class Result:
    ok: bool
    e2e_s: float
    ttft_s: float | None = None
    tokens: int = 0
    tokens_from: str = ""  # "usage", "length" or "chunks": how `tokens` was known
    finish: str | None = None
    error: str | None = None
    index: int = -1  # the request's number in its level (prompt index % prompts)
    text: str = ""  # the streamed answer: each output is checked against the same prompt alone (C = 1)

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.tokens - 1)


def _tokens(usage: int | None, finish: str | None, chunks: int, max_tokens: int) -> tuple[int, str]:
    if usage is not None:
        return usage, "usage"
    if finish == "length":
        return max_tokens, "length"
    return chunks, "chunks"


async def one_request(client, model: str, prompt: str, max_tokens: int, include_usage: bool) -> Result:
    """One streaming chat request, timed from before the call to the stream's end."""
    t0 = time.perf_counter()
    first = usage = finish = None
    chunks, parts = 0, []
    extra = {"stream_options": {"include_usage": True}} if include_usage else {}
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            temperature=0, stream=True, **extra)
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.delta is not None and choice.delta.content:
                    first = first or time.perf_counter()
                    chunks += 1
                    parts.append(choice.delta.content)
                finish = choice.finish_reason or finish
    except Exception as exc:  # noqa: BLE001 -- a failed request is counted, never fatal to the level
        return Result(False, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:300])
    end = time.perf_counter()
    tokens, source = _tokens(usage, finish, chunks, max_tokens)
    if finish is None:  # llama_cpp.server's interrupted streams end like this
        return Result(False, end - t0, None, tokens, source, None, "stream ended without finish_reason",
                      text="".join(parts))
    return Result(True, end - t0, (first - t0) if first else None, tokens, source, finish, text="".join(parts))


async def run_level(base_url: str, model: str, prompts: list[str], concurrency: int, n_requests: int,
                    max_tokens: int, time_limit_s: float, request_timeout_s: float,
                    include_usage: bool = True) -> tuple[list[Result], float]:
    """`concurrency` workers sending requests back to back; (results, wall seconds).

    Bounded in count (n_requests) and time: no request starts after time_limit_s, and each is
    cancelled after request_timeout_s (a timeout counts as a failure)."""
    import httpx
    from openai import AsyncOpenAI

    # A new connection per request: llama-server closes idle keep-alive connections, and a
    # request sent on one it just closed fails with no retry (a connection error, counted
    # against it); on 127.0.0.1 a connection costs well under a millisecond.
    http = httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0), timeout=request_timeout_s)
    client = AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0, timeout=request_timeout_s,
                         http_client=http)
    order, results = itertools.count(), []
    t0 = time.perf_counter()

    async def worker():
        while time.perf_counter() - t0 < time_limit_s:
            i = next(order)
            if i >= n_requests:
                return
            call = one_request(client, model, prompts[i % len(prompts)], max_tokens, include_usage)
            started = time.perf_counter()
            try:
                result = await asyncio.wait_for(call, request_timeout_s)
            except asyncio.TimeoutError:
                result = Result(False, time.perf_counter() - started, error="timeout")
            result.index = i
            results.append(result)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    return results, time.perf_counter() - t0


# ---- statistics and report --------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    at = (len(xs) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (at - lo)


def _p(values: list[float]) -> dict:
    return {"p50": percentile(values, 50), "p99": percentile(values, 99)}


def summarize(results: list[Result], wall_s: float) -> dict:
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "?"] = errors.get(r.error or "?", 0) + 1
    return {"requests": len(results), "done": len(ok), "failed": len(results) - len(ok),
            "wall_s": wall_s, "output_tokens": tokens, "output_tok_s": tokens / wall_s if wall_s > 0 else None,
            "ttft_s": _p([r.ttft_s for r in ok if r.ttft_s is not None]),
            "tpot_s": _p([r.tpot_s for r in ok if r.tpot_s is not None]),
            "e2e_s": _p([r.e2e_s for r in ok]),
            "tokens_from": sorted({r.tokens_from for r in ok}), "errors": errors}


def ratios(results: dict[str, dict[int, dict]]) -> dict[int, dict[str, float]]:
    """Per level: each of our servers' output tok/s over each peer's, and spec over no-spec."""
    out: dict[int, dict[str, float]] = {}
    pairs = [(ours, peer) for peer in PEERS for ours in OURS] + [("spec", "nospec"), ("alt", "nospec")]
    for ours, peer in pairs:
        for level, base in results.get(peer, {}).items():
            mine = results.get(ours, {}).get(level, {}).get("output_tok_s")
            if mine is not None and base.get("output_tok_s"):
                out.setdefault(level, {})[f"{LABELS[ours]} / {LABELS[peer]}"] = mine / base["output_tok_s"]
    return dict(sorted(out.items()))


def same_as_alone(by_level: dict[int, dict], n_prompts: int) -> dict[int, str]:
    """Per level, how many answers equal the same prompt's answer at C = 1 (its requests
    run alone), "equal/compared"; levels without a C = 1 run are not compared."""
    alone = {r["index"] % n_prompts: r["text"] for r in by_level.get(1, {}).get("per_request", []) if r["ok"]}
    out = {}
    for level, summary in by_level.items():
        pairs = [(r["text"], alone[r["index"] % n_prompts]) for r in summary.get("per_request", [])
                 if r["ok"] and r["index"] % n_prompts in alone]
        if alone:
            out[level] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _accepted(metrics: dict | None) -> str:
    return f"{metrics['acceptance']:.0%}" if metrics and "acceptance" in metrics else "-"


def table_rows(results: dict[str, dict[int, dict]]) -> list[list[str]]:
    """One row per level and server: the figures of the printed table, as text."""
    levels = sorted({lv for by in results.values() for lv in by})
    rows = []
    for level in levels:
        for name in SERVERS:
            s = results.get(name, {}).get(level)
            if s is None:
                continue
            base = results[name].get(min(results[name]))  # the lowest level run: the scaling reference
            tps, ref = s.get("output_tok_s"), base.get("output_tok_s")
            rows.append([str(level), LABELS[name], f"{s['done']}/{s['failed']}",
                         _ms(s["ttft_s"]["p50"]), _ms(s["ttft_s"]["p99"]),
                         _ms(s["tpot_s"]["p50"]), _ms(s["tpot_s"]["p99"]),
                         _ms(s["e2e_s"]["p50"]), _ms(s["e2e_s"]["p99"]),
                         "-" if tps is None else f"{tps:.1f}",
                         f"{tps / ref:.2f}x" if tps and ref else "-", _accepted(s.get("metrics")),
                         s.get("same_as_alone", "-")])
    return rows


HEADER = ["C", "server", "done/failed", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
          "E2E p50 ms", "E2E p99 ms", "out tok/s", "vs lowest C", "accepted", "= alone"]


def render(results: dict[str, dict[int, dict]]) -> str:
    """The table and the ratio lines, as plain markdown (readable in a terminal and a README)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    for level, row in ratios(results).items():
        lines.append(f"C={level}: " + ", ".join(f"{k} {v:.2f}x" for k, v in row.items()))
    return "\n".join(lines)


# ---- servers (serve_procs.py: start, wait, stop, metrics) -------------------------------

def server_argv(name: str, port: int, opts, level: int | None = None) -> list[str]:
    most = max(opts.levels)
    if name in ("cpp", "cppspec"):
        # llama.cpp's own C++ server: one slot per concurrent request of this level (it is
        # started afresh per level), each with peer_ctx of context (the KV pool is split
        # across slots), continuous batching (its default).
        most = level or most
        spec = shlex.split(opts.cpp_spec_args) if name == "cppspec" else []
        return [str(Path(opts.llamacpp_bin) / "llama-server"), "--model", str(opts.peer_model), "--host", HOST,
                "--port", str(port), "--threads", str(cores()), "--threads-batch", str(cores()),
                "--parallel", str(most), "--ctx-size", str(opts.peer_ctx * most), "--no-webui",
                *spec, *shlex.split(opts.peer_args)]
    if name == "peer":
        return [sys.executable, "-m", "llama_cpp.server", "--model", str(opts.peer_model), "--host", HOST,
                "--port", str(port), "--n_threads", str(cores()), "--n_threads_batch", str(cores()),
                "--n_ctx", str(opts.peer_ctx), "--interrupt_requests", "False", "--verbose", "False",
                *shlex.split(opts.peer_args)]  # later flags win in its argparse
    argv = [sys.executable, "-m", "hetero_sd.cli", "serve", "--config", str(opts.config), "--host", HOST,
            "--port", str(port), "--max-running", str(most), "--max-waiting", str(2 * most)]
    return argv + (["--no-speculation"] if name == "nospec" else []) + shlex.split(opts.serve_args)


# ---- the run ----------------------------------------------------------------------------

def requests_for(level: int, opts) -> int:
    """At least one request per worker, so the level reaches its concurrency."""
    return max(opts.requests_per_level or max(16, 2 * level), level)


def load_prompt_texts(limit: int | None = None, sets: str = "default") -> list[str]:
    """The prompts of comma-separated sets (packaged names: default, code; or files), in order."""
    from hetero_sd.bench.prompts import load_prompts
    return [p.prompt for name in sets.split(",") if name.strip() for p in load_prompts(name.strip())][:limit]


def measure(name: str, level: int, prompts: list[str], opts, logdir: Path) -> dict:
    """Start `name`'s server, warm it up, run one level, stop it: the level's summary."""
    port = free_port()
    log = logdir / f"{name}-c{level}.log"
    argv = server_argv(name, port, opts, level)
    t0 = time.perf_counter()
    load = os.getloadavg()  # the host is shared: its load average says how much of it we had
    try:
        with serving(argv, port, log, opts.ready_timeout) as (base, model):
            ready_s = time.perf_counter() - t0
            summary = _load(name, base, model, level, prompts, opts)
    except RuntimeError as exc:  # a server that did not start: reported, the run goes on
        return {**summarize([], 0.0), "error": str(exc)[-1500:], "argv": argv}
    summary.update(argv=argv, ready_s=ready_s, log=str(log), loadavg_before=load, loadavg_after=os.getloadavg())
    return summary


def _load(name: str, base: str, model: str, level: int, prompts: list[str], opts) -> dict:
    usage = name != "peer"  # llama_cpp.server has no stream_options (pydantic drops the field)
    metrics = name in OURS
    # Warm-up, not counted: first-call allocations and caches are not the load's cost.
    asyncio.run(run_level(f"{base}/v1", model, prompts, 1, 1, 8, opts.request_timeout, opts.request_timeout, usage))
    before = scrape_acceptance(base) if metrics else None
    results, wall = asyncio.run(run_level(f"{base}/v1", model, prompts, level, requests_for(level, opts),
                                          opts.max_tokens, opts.level_timeout, opts.request_timeout, usage))
    summary = summarize(results, wall)
    summary["per_request"] = [asdict(r) for r in sorted(results, key=lambda r: r.index)]
    if metrics:
        summary["metrics"] = acceptance(before, scrape_acceptance(base))
    return summary


def _commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def _meta(opts, argv: list[str]) -> dict:
    import platform
    return {"command": "python benchmarks/bench_serve.py " + shlex.join(argv), "commit": _commit(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "cores": cores(),
            "cpu": platform.processor() or platform.machine(), "config": str(opts.config),
            "peer_model": str(opts.peer_model), "levels": opts.levels, "max_tokens": opts.max_tokens,
            "requests_per_level": {lv: requests_for(lv, opts) for lv in opts.levels},
            "servers": opts.servers, "prompts": f"{opts.prompts} (cycled)", "rounds": opts.rounds,
            "alt_config": opts.alt_config}


def run(opts, argv: list[str]) -> dict:
    prompts = load_prompt_texts(sets=opts.prompts)
    logdir = Path(opts.logdir or tempfile.mkdtemp(prefix="bench-serve-"))
    logdir.mkdir(parents=True, exist_ok=True)
    meta = _meta(opts, argv)  # before the run: its start time and commit
    rounds: dict[str, dict[int, list[dict]]] = {name: {} for name in opts.servers}
    for r in range(opts.rounds):
        for i, level in enumerate(opts.levels):
            turn = (i + r) % len(opts.servers)  # no server always runs first
            for name in opts.servers[turn:] + opts.servers[:turn]:
                s = measure(name, level, prompts, opts, logdir)
                rounds[name].setdefault(level, []).append(s)
                tps = s.get("output_tok_s")
                print(f"round {r + 1}/{opts.rounds} C={level} {LABELS[name]}: {s['done']} done, {s['failed']} "
                      f"failed, {'-' if tps is None else f'{tps:.1f}'} tok/s"
                      f"{'  ' + s['error'][:200] if 'error' in s else ''}", file=sys.stderr, flush=True)
    results = {name: {level: pooled(runs) for level, runs in by.items()} for name, by in rounds.items()}
    for by_level in results.values():
        for level, counted in same_as_alone(by_level, len(prompts)).items():
            by_level[level]["same_as_alone"] = counted
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return {"meta": meta, "results": results, "ratios": ratios(results)}


def pooled(runs: list[dict]) -> dict:
    """One level's rounds as one: every request's figures pooled, tok/s = all tokens / all wall
    time; each round's tok/s kept (how much the host moved between them)."""
    if len(runs) == 1:
        return {**runs[0], "rounds_tok_s": [runs[0].get("output_tok_s")]}
    requests = [Result(**r) for run in runs for r in run.get("per_request", [])]
    out = summarize(requests, sum(run.get("wall_s", 0.0) for run in runs))
    out["per_request"] = [r for run in runs for r in run.get("per_request", [])]
    out["rounds_tok_s"] = [run.get("output_tok_s") for run in runs]
    metrics = [run["metrics"] for run in runs if run.get("metrics")]
    if metrics:
        keys = ("num_draft_tokens", "num_accepted_tokens")
        out["metrics"] = acceptance({}, {k: sum(m.get(k, 0) for m in metrics) for k in keys})
    errors = [run["error"] for run in runs if "error" in run]
    if errors:
        out["error"] = errors[0]
    return out


def parse_args(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "configs" / "cpu.yaml"), help="our server's config")
    ap.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels, e.g. 1,8")
    ap.add_argument("--requests-per-level", type=int, help="requests per level (default max(16, 2C))")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="measure every level this many times per server, "
                    "the order rotated; the rounds' requests are pooled (default 1)")
    ap.add_argument("--prompts", default="default", help="prompt sets, comma-separated: packaged default, "
                    "code, or files (default: default)")
    ap.add_argument("--alt-config", help="a second config of ours, served speculating as server alt")
    ap.add_argument("--servers", help="any of " + ",".join(SERVERS) + " (default: spec,nospec and cpp with "
                    "--llamacpp-bin, else peer)")
    ap.add_argument("--no-peer", action="store_true", help="without llama.cpp's servers")
    ap.add_argument("--llamacpp-bin", default=os.environ.get("HETERO_SD_LLAMACPP_BIN"), metavar="DIR",
                    help="folder of llama.cpp's C++ tools with llama-server (docs/benchmarks.md; "
                         "default $HETERO_SD_LLAMACPP_BIN)")
    ap.add_argument("--cpp-spec-args", default="--spec-type ngram-simple",
                    help="llama-server's speculation flags for the cppspec server")
    ap.add_argument("--peer-model", help="the GGUF for llama.cpp (default: the config's target model)")
    ap.add_argument("--peer-ctx", type=int, default=2048, help="llama.cpp's n_ctx")
    ap.add_argument("--serve-args", default="", help="more arguments for hetero-sd serve")
    ap.add_argument("--peer-args", default="", help="more arguments for the llama.cpp servers")
    ap.add_argument("--level-timeout", type=float, default=600, help="no request starts after this (s)")
    ap.add_argument("--request-timeout", type=float, default=300, help="one request's bound (s)")
    ap.add_argument("--ready-timeout", type=float, default=600, help="a server's start-up bound (s)")
    ap.add_argument("--quick", action="store_true", help="smoke run: levels 1,2, 4 requests, 16 tokens")
    ap.add_argument("--logdir", help="servers' logs (default: a new temporary folder)")
    ap.add_argument("--soak", action="store_true", help="a soak of our server instead (benchmarks/soak.py)")
    ap.add_argument("--soak-requests", type=int, default=2000)
    ap.add_argument("--soak-concurrency", type=int, default=32)
    ap.add_argument("--soak-max-tokens", type=int, default=24)
    ap.add_argument("--json", help="write every figure here")
    opts = ap.parse_args(argv)
    if opts.quick:
        opts.levels, opts.requests_per_level, opts.max_tokens = "1,2", opts.requests_per_level or 4, 16
    if opts.soak:  # our server only, sized for the soak's concurrency
        opts.levels, opts.servers = str(opts.soak_concurrency), opts.servers or "spec"
        opts.level_timeout = max(opts.level_timeout, 3600)
    opts.levels = [int(x) for x in str(opts.levels).split(",") if x.strip()]
    default = "spec,nospec," + ("cpp" if opts.llamacpp_bin else "peer")
    opts.servers = [s for s in (opts.servers or default).split(",") if s and not (opts.no_peer and s in PEERS)]
    if not opts.levels or min(opts.levels) < 1 or set(opts.servers) - set(SERVERS) or not opts.servers:
        ap.error(f"--levels: positive integers; --servers: some of {','.join(SERVERS)}")
    if "alt" in opts.servers and not opts.alt_config:
        ap.error("--servers alt needs --alt-config FILE")
    if opts.alt_config:
        opts.alt_config = str(Path(opts.alt_config).resolve())
    if opts.rounds < 1:
        ap.error("--rounds: at least 1")
    if {"cpp", "cppspec"} & set(opts.servers):
        binary = Path(opts.llamacpp_bin or ".").expanduser() / "llama-server"
        if not opts.llamacpp_bin or not binary.is_file():
            ap.error(f"--llamacpp-bin: no llama-server in {opts.llamacpp_bin or '(not given)'}: build llama.cpp's "
                     "tools (docs/benchmarks.md) and pass their folder")
        opts.llamacpp_bin = str(binary.parent.resolve())
    opts.config = str(Path(opts.config).resolve())  # the servers run in another folder
    if set(PEERS) & set(opts.servers) and not opts.peer_model:
        from hetero_sd.config import load_config, resolve_model
        opts.peer_model = resolve_model(load_config(opts.config).target.model, Path(opts.config).parent)
    opts.peer_model = opts.peer_model and Path(opts.peer_model).resolve()
    return opts


def run_soak(opts, argv: list[str]) -> dict:
    """benchmarks/soak.py against our server (spec, or nospec with --servers nospec)."""
    import soak

    name = "nospec" if opts.servers == ["nospec"] else "spec"
    port, logdir = free_port(), Path(opts.logdir or tempfile.mkdtemp(prefix="bench-soak-"))
    logdir.mkdir(parents=True, exist_ok=True)
    sopts = soak.SoakOptions(requests=opts.soak_requests, concurrency=opts.soak_concurrency,
                             max_tokens=opts.soak_max_tokens, prompts=load_prompt_texts(sets=opts.prompts),
                             time_limit_s=opts.level_timeout, request_timeout_s=opts.request_timeout)
    # its key, timeouts and fault plan (in logdir) go before --serve-args, which may override them
    argv_server = server_argv(name, port, opts)
    extra = len(shlex.split(opts.serve_args))
    argv_server[len(argv_server) - extra:len(argv_server) - extra] = soak.server_args(sopts, logdir)
    meta = {**_meta(opts, argv), "server": argv_server, "log": str(logdir / "soak.log")}
    with open(logdir / "soak.log", "wb") as out:
        proc = subprocess.Popen(argv_server, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=tempfile.gettempdir())
    try:
        base = f"http://{HOST}:{port}"
        sopts.model = wait_ready(proc, base, logdir / "soak.log", opts.ready_timeout, sopts.api_key)  # (its key)
        last = [0.0]

        def progress(done: int, total: int) -> None:
            if time.monotonic() - last[0] > 10 or done == total:
                last[0] = time.monotonic()
                print(f"soak: {done}/{total} requests", file=sys.stderr, flush=True)

        rep = asyncio.run(soak.soak(base, proc.pid, sopts, progress))
    finally:
        stop(proc)
    meta["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    print(soak.render(rep))
    return {"meta": meta, "soak": rep}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    opts = parse_args(argv)
    if opts.soak:
        report = run_soak(opts, argv)
        if opts.json:
            Path(opts.json).write_text(json.dumps(report, indent=2, default=str))
        return 0 if report["soak"]["passed"] else 1
    report = run(opts, argv)
    print(render(report["results"]))
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
