"""A soak of `hetero-sd serve`: thousands of mixed requests at a fixed concurrency, valid
and hostile, checked as they come back (run by `benchmarks/bench_serve.py --soak`; a short
one is tests/serve/test_soak.py).

    args = server_args(opts, folder)   # --api-key, --fault-plan (written into folder), timeouts
    # start `hetero-sd serve ... *args` on 127.0.0.1, then:
    rep = asyncio.run(soak(base, pid, opts)); print(render(rep))

The mix, request i taking slot KINDS[i % len(KINDS)] and a prompt by a seeded draw:
- chat-stream / chat / completion: greedy, streamed or whole, chat or plain completion;
- sampled: temperature 0.8, top_p 0.9, a seed of its own (so it reproduces);
- json: greedy under response_format json_object;
- logprobs: greedy with logprobs and top_logprobs 2, frequency_penalty 0.5;
- cancel: a stream the client closes after its second chunk;
- hostile: the next of the HOSTILE_KINDS in turn (so every one comes round), each with
  the outcome it must get and a time bound (`expected(name, opts)`): malformed bodies,
  missing or wrong keys, rebinding Hosts, oversized, slow and stalled clients, dropped
  prefills and injected failures in each batch-engine phase (benchmarks/soak_hostile.py
  lists them and sends them; the fault plan is written by `server_args`).

Every request with a deterministic answer (greedy, or sampled with a seed) is first run
alone, one at a time, before the load: under load each must equal its solo answer, text
and finish reason. The server's resident memory is read after the first `warm` requests
and at the end (it may not grow past `rss_tolerance`). Once the load has stopped its
/metrics must show nothing running or waiting and no sequence held but the prefix
cache's; with every client closed, its open file descriptors must come back to within
`fd_tolerance` of their count after the solo runs, and /dev/shm to the entries it had
then. Traffic goes to the server's 127.0.0.1 URL only; the run is bounded by its request
count and a time limit, so it stops by itself.

This module holds the plan, the solo references, the run loop, the end checks, the report
and its rendering, and the server's flags; benchmarks/soak_hostile.py the hostile traffic;
benchmarks/soak_kinds.py what both share (the kinds, the records, `expected`, the requests).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings, however it is loaded
from soak_hostile import _Target, hostile  # noqa: E402
from soak_kinds import (DETERMINISTIC, FAULTS, HOSTILE_KINDS, KINDS, VALID, Outcome, SoakOptions,  # noqa: E402
                        _auth, _body, _fault_message, _key, _marker, _send, expected)
from soak_kinds import MAX_BODY  # noqa: E402,F401 -- the soak's names, all from here


def server_args(opts: SoakOptions, folder: str | Path) -> list[str]:
    """The `hetero-sd serve` flags the soak's hostile traffic expects: its key, its timeouts and
    its fault plan (written into `folder` as soak-faults.json)."""
    path = Path(folder) / "soak-faults.json"
    path.write_text(json.dumps(fault_rules(), indent=1))
    return ["--api-key", opts.api_key, "--fault-plan", str(path), "--header-timeout", f"{opts.header_timeout_s:g}",
            "--body-timeout", f"{opts.body_timeout_s:g}", "--stall-timeout", f"{opts.stall_timeout_s:g}"]


def fault_rules() -> list[dict]:
    return [{"marker": _marker(phase), "phase": phase, "error": error, "message": _fault_message(phase, error)}
            for phase, error in FAULTS]


# ---- the soak ---------------------------------------------------------------------------

async def one(t: _Target, i: int, kind: str, prompt_index: int) -> Outcome:
    opts = t.opts
    prompt = opts.prompts[prompt_index]
    if kind in HOSTILE_KINDS:
        return await hostile(t, i, kind, prompt)
    t0 = time.perf_counter()
    try:
        stream = kind in ("chat-stream", "sampled", "cancel") or (kind == "completion" and i % 2 == 0)
        path, body = _body("chat-stream" if kind == "cancel" else kind, prompt, i, opts, stream)
        if kind == "cancel":
            body["max_tokens"] = max(64, opts.max_tokens)  # long enough to be cut
        status, text, finish = await asyncio.wait_for(
            _send(t.client, path, body, stream, 2 if kind == "cancel" else None, _auth(opts)), opts.request_timeout_s)
        ok = status == 200 and finish is not None
        return Outcome(i, kind, ok, time.perf_counter() - t0, text, finish, status,
                       "" if ok else f"{kind}: status {status}, finish {finish}: {text[:200]}")
    except Exception as exc:  # noqa: BLE001 -- a failed request is counted, never fatal to the soak
        return Outcome(i, kind, False, time.perf_counter() - t0, error=f"{kind}: {type(exc).__name__}: {exc}"[:300])


def plan(opts: SoakOptions) -> list[tuple[int, str, int]]:
    """(request index, kind, prompt index) for the whole soak, the same for a seed: each
    hostile slot takes the next of HOSTILE_KINDS."""
    rng = random.Random(opts.seed)
    out, hostile_n = [], 0
    for i in range(opts.requests):
        kind = KINDS[i % len(KINDS)]
        if kind == "hostile":
            kind, hostile_n = HOSTILE_KINDS[hostile_n % len(HOSTILE_KINDS)], hostile_n + 1
        out.append((i, kind, rng.randrange(len(opts.prompts))))
    return out


async def references(t: _Target, todo: list[tuple[int, str, int]]) -> dict[tuple, Outcome]:
    """Each deterministic request's answer when it runs alone, one request at a time."""
    refs: dict[tuple, Outcome] = {}
    for i, kind, prompt_index in todo:
        key = _key(kind, prompt_index, i)
        if kind in DETERMINISTIC and key not in refs:
            refs[key] = await one(t, i, kind, prompt_index)
    return refs


async def _size_hostile(t: _Target) -> None:
    """The long prompt (disconnect mid-prefill) and the stalled stream's length, fitted to the
    served model's context through /tokenize."""
    opts, unit = t.opts, "The quick brown fox jumps over the lazy dog near the river bank. "
    r = await t.client.post("/tokenize", json={"model": opts.model, "prompt": unit}, headers=_auth(opts))
    r.raise_for_status()
    per, context = max(1, r.json()["count"]), r.json()["max_model_len"]
    want = min(opts.long_prompt_tokens, context * 3 // 4 - opts.max_tokens)
    t.long_prompt = unit * max(1, want // per)
    r = await t.client.post("/tokenize", json={"model": opts.model, "messages": [
        {"role": "user", "content": max(opts.prompts, key=len)}]}, headers=_auth(opts))
    r.raise_for_status()
    t.stall_max_tokens = max(8, min(opts.stall_max_tokens, context - r.json()["count"] - 16))


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def shm_entries() -> list[str]:
    """hetero-sd's shared-memory segments (hsd-*): the shared host's other /dev/shm users
    (another test run, any program) come and go and are not the server's to leak."""
    from hetero_sd.transport.segment import PREFIX, SHM_DIR

    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"{PREFIX}-")) if os.path.isdir(SHM_DIR) else []


def gauges(text: str) -> dict[str, float]:
    """Our /metrics' gauges by short name (hetero_sd:num_requests_running -> num_requests_running),
    summed over their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "gauge" and family.name.startswith("hetero_sd:"):
            out[family.name[len("hetero_sd:"):]] = sum(s.value for s in family.samples)
    return out


def _idle(after: dict) -> bool:
    return after.get("num_requests_running") == 0 and after.get("num_requests_waiting") == 0 and \
        after.get("kv_cache_sequences", 0) == after.get("prefix_cache_sequences", 0) and \
        after.get("kv_cache_request_usage_perc", 1.0) == 0.0


async def soak(base: str, pid: int, opts: SoakOptions, progress=None) -> dict:
    """Run the soak against the server at `base` (process `pid`, started with
    `server_args(opts, ...)`); the report."""
    import httpx

    def client():
        limits = httpx.Limits(max_connections=opts.concurrency + 4, max_keepalive_connections=opts.concurrency + 4)
        return httpx.AsyncClient(base_url=base, timeout=opts.request_timeout_s, limits=limits)

    todo = plan(opts)
    async with client() as c:
        t = _Target.of(base, c, opts)
        await _size_hostile(t)
        t_ref = time.perf_counter()
        refs = await references(t, todo)
        ref_s = time.perf_counter() - t_ref
    await asyncio.sleep(1.0)  # the server closes our connection's socket
    res = {"fds": {"baseline": open_fds(pid)}, "shm": {"baseline": shm_entries()}}
    queue, outcomes, rss = list(reversed(todo)), [], {}
    t0 = time.perf_counter()
    async with client() as c:
        t.client = c

        async def worker():
            while queue and time.perf_counter() - t0 < opts.time_limit_s:
                i, kind, prompt_index = queue.pop()
                outcome = await one(t, i, kind, prompt_index)
                outcome.key = _key(kind, prompt_index, i)
                outcomes.append(outcome)
                if len(outcomes) == opts.warm:
                    rss["warm"] = rss_bytes(pid)
                if progress is not None:
                    progress(len(outcomes), opts.requests)

        await asyncio.gather(*(worker() for _ in range(opts.concurrency)))
        wall = time.perf_counter() - t0
        rss["end"] = rss_bytes(pid)
        # cancelled and dropped requests are freed at a step boundary; stalled streams at their timeout
        t_settle, after = time.perf_counter(), {}
        while True:
            after = gauges((await c.get("/metrics", headers=_auth(opts))).text)
            if _idle(after) or time.perf_counter() - t_settle > opts.settle_s:
                break
            await asyncio.sleep(0.5)
        res["idle_after_s"] = time.perf_counter() - t_settle
    await asyncio.sleep(1.0)
    deadline = time.perf_counter() + opts.settle_s
    while open_fds(pid) > res["fds"]["baseline"] + opts.fd_tolerance and time.perf_counter() < deadline:
        await asyncio.sleep(0.5)
    res["fds"]["end"], res["shm"]["end"] = open_fds(pid), shm_entries()
    return report(outcomes, refs, rss, after, wall, ref_s, opts, res)


def _percentiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"p50": None, "p99": None}
    pick = lambda q: xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]  # noqa: E731
    return {"p50": pick(0.50), "p99": pick(0.99)}


def report(outcomes: list[Outcome], refs: dict, rss: dict, after: dict, wall: float, ref_s: float,
           opts: SoakOptions, res: dict) -> dict:
    """`res`: {"fds": {"baseline": n, "end": n}, "shm": {"baseline": [names], "end": [names]}}."""
    mismatched = []
    for o in outcomes:
        ref = refs.get(o.key)
        if o.ok and o.kind in DETERMINISTIC and ref is not None and (o.text, o.finish) != (ref.text, ref.finish):
            mismatched.append({"index": o.index, "kind": o.kind, "got": o.text[:120], "solo": ref.text[:120]})
    by_kind = {}
    for kind in VALID + HOSTILE_KINDS:
        mine = [o for o in outcomes if o.kind == kind]
        notes: dict[str, int] = {}
        for o in mine:
            if o.note:
                notes[o.note] = notes.get(o.note, 0) + 1
        by_kind[kind] = {"requests": len(mine), "failed": sum(not o.ok for o in mine),
                         "latency_s": _percentiles([o.latency_s for o in mine if o.ok])}
        if kind in HOSTILE_KINDS:
            by_kind[kind].update(expect=expected(kind, opts)[0], bound_s=expected(kind, opts)[1], notes=notes)
    valid_failed = [o for o in outcomes if not o.ok and o.kind not in HOSTILE_KINDS]
    hostile_failed = [o for o in outcomes if not o.ok and o.kind in HOSTILE_KINDS]
    growth = (rss["end"] - rss["warm"]) / rss["warm"] if rss.get("warm") else None
    held = after.get("kv_cache_sequences", 0) - after.get("prefix_cache_sequences", 0)
    fds, shm = res["fds"], res["shm"]
    new_shm = sorted(set(shm["end"]) - set(shm["baseline"]))
    checks = {
        "all requests answered": len(outcomes) == opts.requests,
        "no valid request failed or lost": not valid_failed,
        "every hostile request got its expected answer, or a close, within its bound": not hostile_failed,
        "every deterministic output equals its solo run": not mismatched and
        all(r.ok for r in refs.values()),
        f"RSS within {opts.rss_tolerance:.0%} of its value after {opts.warm} requests":
            growth is not None and growth <= opts.rss_tolerance,
        "nothing running or waiting at the end": after.get("num_requests_running") == 0 and
        after.get("num_requests_waiting") == 0,
        "no KV held by a request at the end (only the prefix cache's)": held == 0 and
        after.get("kv_cache_request_usage_perc", 1.0) == 0.0,
        f"open file descriptors back to within {opts.fd_tolerance} of their baseline":
            fds.get("end") is not None and fds["end"] <= fds["baseline"] + opts.fd_tolerance,
        "/dev/shm back to its baseline entries": not new_shm,
    }
    return {"requests": len(outcomes), "concurrency": opts.concurrency, "wall_s": wall,
            "solo_references": len(refs), "solo_references_s": ref_s,
            "compared_with_solo": sum(1 for o in outcomes if o.ok and o.kind in DETERMINISTIC),
            "hostile": sum(1 for o in outcomes if o.kind in HOSTILE_KINDS),
            "hostile_kinds": sum(1 for k in HOSTILE_KINDS if by_kind[k]["requests"]),
            "mismatched": mismatched, "failures": [o.error for o in valid_failed + hostile_failed][:20],
            "latency_s": _percentiles([o.latency_s for o in outcomes if o.ok and o.kind in VALID]),
            "by_kind": by_kind, "rss_bytes": rss, "rss_growth": growth, "metrics_after": after,
            "idle_after_s": res.get("idle_after_s"), "fds": fds, "new_shm": new_shm, "checks": checks,
            "passed": all(checks.values())}


def render(rep: dict) -> str:
    ms = lambda s: "-" if s is None else f"{s * 1e3:.0f}"  # noqa: E731
    lines = [f"soak: {rep['requests']} requests at concurrency {rep['concurrency']} in {rep['wall_s']:.0f} s; "
             f"{rep['compared_with_solo']} compared with {rep['solo_references']} solo runs; "
             f"{rep['hostile']} hostile of {rep['hostile_kinds']} kinds",
             "| kind | expected | bound s | requests | failed | latency p50 ms | latency p99 ms | endings |",
             "|---|---|---|---|---|---|---|---|"]
    for kind, s in rep["by_kind"].items():
        notes = ", ".join(f"{n}: {c}" for n, c in s.get("notes", {}).items())
        expect = s.get("expect") or ("200, equal to its solo run" if kind in DETERMINISTIC else "200, then cut")
        bound = f"{s['bound_s']:g}" if "bound_s" in s else "-"
        lines.append(f"| {kind} | {expect} | {bound} | {s['requests']} | {s['failed']} | "
                     f"{ms(s['latency_s']['p50'])} | {ms(s['latency_s']['p99'])} | {notes or '-'} |")
    rss, growth = rep["rss_bytes"], rep["rss_growth"]
    lines.append(f"RSS after warm-up {rss.get('warm', 0) / 2**20:.0f} MiB, at the end {rss['end'] / 2**20:.0f} MiB "
                 f"({'-' if growth is None else f'{growth:+.1%}'}); open fds {rep['fds'].get('baseline')} after the "
                 f"solo runs, {rep['fds'].get('end')} at the end; new /dev/shm entries: {rep['new_shm'] or 'none'}"
                 + ("" if rep.get("idle_after_s") is None else f"; idle {rep['idle_after_s']:.1f} s after the load"))
    lines += [f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in rep["checks"].items()]
    lines += [f"  mismatch: {m}" for m in rep["mismatched"][:5]] + [f"  failure: {f}" for f in rep["failures"][:10]]
    return "\n".join(lines)
