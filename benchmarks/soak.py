"""A soak of `hetero-sd serve`: thousands of mixed requests at a fixed concurrency,
checked as they come back (run by `benchmarks/bench_serve.py --soak`; a short one is
tests/benchmarks/test_soak.py).

The mix, request i taking kind KINDS[i % len(KINDS)] and a prompt by a seeded draw:
- chat-stream / chat / completion: greedy, streamed or whole, chat or plain completion;
- sampled: temperature 0.8, top_p 0.9, a seed of its own (so it reproduces);
- json: greedy under response_format json_object;
- logprobs: greedy with logprobs and top_logprobs 2, frequency_penalty 0.5;
- cancel: a stream the client closes after its second chunk;
- hostile: a malformed or invalid body, which must get a 4xx naming what is wrong.

Every request with a deterministic answer (greedy, or sampled with a seed) is first
run alone, one at a time, before the load: under load each must equal its solo answer,
text and finish reason. The server's resident memory is read after the first
`warm` requests and at the end (it may not grow past `rss_tolerance`), and once the
load has stopped its /metrics must show nothing running or waiting and no sequence
held but the prefix cache's. Traffic goes to the server's 127.0.0.1 URL only; the
run is bounded by its request count and a time limit, so it stops by itself.
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("chat-stream", "chat", "sampled", "completion", "json", "chat-stream", "logprobs", "cancel", "hostile",
         "chat-stream")
DETERMINISTIC = ("chat-stream", "chat", "sampled", "completion", "json", "logprobs")
# Bodies that must be refused: (what is wrong, the body; None = not JSON at all)
HOSTILE = (
    ("not JSON", None),
    ("no messages", {"max_tokens": 4}),
    ("messages not a list", {"messages": "hi", "max_tokens": 4}),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}], "max_tokens": 4}),
    ("temperature a string", {"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
    ("negative max_tokens", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}),
    ("max_tokens past the context", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 9}),
    ("n too large", {"messages": [{"role": "user", "content": "hi"}], "n": 10 ** 4}),
    ("top_logprobs out of range", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                   "top_logprobs": 99}),
    ("a bad response_format", {"messages": [{"role": "user", "content": "hi"}],
                               "response_format": {"type": "yaml"}}),
)


@dataclass
class Outcome:
    index: int
    kind: str
    ok: bool
    latency_s: float
    text: str = ""
    finish: str | None = None
    status: int | None = None
    error: str = ""
    key: tuple | None = None  # requests with the same key must answer alike (_key)


@dataclass
class SoakOptions:
    requests: int = 2000
    concurrency: int = 16
    max_tokens: int = 24
    warm: int = 200  # RSS is compared against its value after this many requests
    rss_tolerance: float = 0.05
    time_limit_s: float = 3600.0
    request_timeout_s: float = 300.0
    seed: int = 0
    model: str = "default"
    prompts: list[str] = field(default_factory=list)


def _body(kind: str, prompt: str, i: int, opts: SoakOptions, stream: bool) -> tuple[str, dict]:
    """(path, body) of a well-formed request of `kind`."""
    base = {"model": opts.model, "max_tokens": opts.max_tokens, "temperature": 0}
    if kind == "completion":
        return "/v1/completions", {**base, "prompt": prompt, "stream": stream}
    body = {**base, "messages": [{"role": "user", "content": prompt}], "stream": stream}
    if kind == "sampled":
        body.update(temperature=0.8, top_p=0.9, seed=1000 + i % 7)
    elif kind == "json":
        body["response_format"] = {"type": "json_object"}
    elif kind == "logprobs":
        body.update(logprobs=True, top_logprobs=2, frequency_penalty=0.5)
    if stream:
        body["stream_options"] = {"include_usage": True}
    return "/v1/chat/completions", body


def _key(kind: str, prompt_index: int, i: int) -> tuple:
    """Requests that must answer alike: the same kind, prompt and (sampled) seed."""
    return (kind, prompt_index, 1000 + i % 7 if kind == "sampled" else None)


async def _send(client, path: str, body: dict | None, stream: bool, cancel_after: int | None = None
                ) -> tuple[int, str, str | None]:
    """(HTTP status, the text, the finish reason) of one request."""
    content = b"{not json" if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    if not stream:
        r = await client.post(path, content=content, headers=headers)
        if r.status_code != 200:
            return r.status_code, r.text, None
        choice = r.json()["choices"][0]
        return 200, choice.get("message", {}).get("content") if "message" in choice else choice["text"], \
            choice["finish_reason"]
    text, finish, chunks = [], None, 0
    async with client.stream("POST", path, content=content, headers=headers) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode(errors="replace"), None
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return 500, json.dumps(chunk["error"]), None
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                text.append(delta.get("content") or choice.get("text") or "")
                finish = choice.get("finish_reason") or finish
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                return 200, "".join(text), "cancelled"  # leaving the block closes the connection
    return 200, "".join(text), finish


async def one(client, i: int, kind: str, prompt_index: int, opts: SoakOptions) -> Outcome:
    prompt = opts.prompts[prompt_index]
    t0 = time.perf_counter()
    try:
        if kind == "hostile":
            what, body = HOSTILE[i % len(HOSTILE)]
            status, text, _ = await _send(client, "/v1/chat/completions", body, False)
            ok = 400 <= status < 500 and '"error"' in text
            return Outcome(i, kind, ok, time.perf_counter() - t0, status=status,
                           error="" if ok else f"{what}: got {status} {text[:200]}")
        stream = kind in ("chat-stream", "sampled", "cancel") or (kind == "completion" and i % 2 == 0)
        path, body = _body("chat-stream" if kind == "cancel" else kind, prompt, i, opts, stream)
        if kind == "cancel":
            body["max_tokens"] = max(64, opts.max_tokens)  # long enough to be cut
        status, text, finish = await _send(client, path, body, stream, 2 if kind == "cancel" else None)
        ok = status == 200 and finish is not None
        return Outcome(i, kind, ok, time.perf_counter() - t0, text, finish, status,
                       "" if ok else f"status {status}, finish {finish}: {text[:200]}")
    except Exception as exc:  # noqa: BLE001 -- a failed request is counted, never fatal to the soak
        return Outcome(i, kind, False, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:300])


def plan(opts: SoakOptions) -> list[tuple[int, str, int]]:
    """(request index, kind, prompt index) for the whole soak, the same for a seed."""
    rng = random.Random(opts.seed)
    return [(i, KINDS[i % len(KINDS)], rng.randrange(len(opts.prompts))) for i in range(opts.requests)]


async def references(client, todo: list[tuple[int, str, int]], opts: SoakOptions) -> dict[tuple, Outcome]:
    """Each deterministic request's answer when it runs alone, one request at a time."""
    refs: dict[tuple, Outcome] = {}
    for i, kind, prompt_index in todo:
        key = _key(kind, prompt_index, i)
        if kind in DETERMINISTIC and key not in refs:
            refs[key] = await one(client, i, kind, prompt_index, opts)
    return refs


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def gauges(text: str) -> dict[str, float]:
    """Our /metrics' gauges by short name (hetero_sd:num_requests_running -> num_requests_running),
    summed over their labels."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "gauge" and family.name.startswith("hetero_sd:"):
            out[family.name[len("hetero_sd:"):]] = sum(s.value for s in family.samples)
    return out


async def soak(base: str, pid: int, opts: SoakOptions, progress=None) -> dict:
    """Run the soak against the server at `base` (process `pid`); the report."""
    import httpx

    limits = httpx.Limits(max_connections=opts.concurrency + 4, max_keepalive_connections=opts.concurrency + 4)
    async with httpx.AsyncClient(base_url=base, timeout=opts.request_timeout_s, limits=limits) as client:
        todo = plan(opts)
        t_ref = time.perf_counter()
        refs = await references(client, todo, opts)
        ref_s = time.perf_counter() - t_ref
        queue, outcomes, rss = list(reversed(todo)), [], {}
        t0 = time.perf_counter()

        async def worker():
            while queue and time.perf_counter() - t0 < opts.time_limit_s:
                i, kind, prompt_index = queue.pop()
                outcome = await asyncio.wait_for(one(client, i, kind, prompt_index, opts), opts.request_timeout_s)
                outcome.key = _key(kind, prompt_index, i)
                outcomes.append(outcome)
                if len(outcomes) == opts.warm:
                    rss["warm"] = rss_bytes(pid)
                if progress is not None:
                    progress(len(outcomes), opts.requests)

        await asyncio.gather(*(worker() for _ in range(opts.concurrency)))
        wall = time.perf_counter() - t0
        rss["end"] = rss_bytes(pid)
        await asyncio.sleep(0.5)  # cancelled streams' sequences are freed at the next step boundary
        after = gauges((await client.get("/metrics")).text)
    return report(outcomes, refs, rss, after, wall, ref_s, opts)


def _percentiles(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {"p50": None, "p99": None}
    pick = lambda q: xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]  # noqa: E731
    return {"p50": pick(0.50), "p99": pick(0.99)}


def report(outcomes: list[Outcome], refs: dict, rss: dict, after: dict, wall: float, ref_s: float,
           opts: SoakOptions) -> dict:
    mismatched, failed = [], [o for o in outcomes if not o.ok]
    for o in outcomes:
        ref = refs.get(o.key)
        if o.ok and o.kind in DETERMINISTIC and ref is not None and (o.text, o.finish) != (ref.text, ref.finish):
            mismatched.append({"index": o.index, "kind": o.kind, "got": o.text[:120], "solo": ref.text[:120]})
    by_kind = {}
    for kind in sorted(set(KINDS)):
        mine = [o for o in outcomes if o.kind == kind]
        by_kind[kind] = {"requests": len(mine), "failed": sum(not o.ok for o in mine),
                         "latency_s": _percentiles([o.latency_s for o in mine if o.ok])}
    growth = (rss["end"] - rss["warm"]) / rss["warm"] if rss.get("warm") else None
    held = after.get("kv_cache_sequences", 0) - after.get("prefix_cache_sequences", 0)
    checks = {
        "all requests answered": len(outcomes) == opts.requests,
        "no request failed": not failed,
        "every deterministic output equals its solo run": not mismatched and
        all(r.ok for r in refs.values()),
        f"RSS within {opts.rss_tolerance:.0%} of its value after {opts.warm} requests":
            growth is not None and growth <= opts.rss_tolerance,
        "nothing running or waiting at the end": after.get("num_requests_running") == 0 and
        after.get("num_requests_waiting") == 0,
        "no KV held by a request at the end (only the prefix cache's)": held == 0 and
        after.get("kv_cache_request_usage_perc", 1.0) == 0.0,
    }
    return {"requests": len(outcomes), "concurrency": opts.concurrency, "wall_s": wall,
            "solo_references": len(refs), "solo_references_s": ref_s,
            "compared_with_solo": sum(1 for o in outcomes if o.ok and o.kind in DETERMINISTIC),
            "mismatched": mismatched, "failures": [o.error for o in failed][:20],
            "latency_s": _percentiles([o.latency_s for o in outcomes if o.ok]), "by_kind": by_kind,
            "rss_bytes": rss, "rss_growth": growth, "metrics_after": after, "checks": checks,
            "passed": all(checks.values())}


def render(rep: dict) -> str:
    lines = [f"soak: {rep['requests']} requests at concurrency {rep['concurrency']} in {rep['wall_s']:.0f} s; "
             f"{rep['compared_with_solo']} compared with {rep['solo_references']} solo runs",
             "| kind | requests | failed | latency p50 ms | latency p99 ms |", "|---|---|---|---|---|"]
    for kind, s in rep["by_kind"].items():
        p50, p99 = s["latency_s"]["p50"], s["latency_s"]["p99"]
        lines.append(f"| {kind} | {s['requests']} | {s['failed']} | {'-' if p50 is None else f'{p50 * 1e3:.0f}'} | "
                     f"{'-' if p99 is None else f'{p99 * 1e3:.0f}'} |")
    rss, growth = rep["rss_bytes"], rep["rss_growth"]
    lines.append(f"RSS after warm-up {rss.get('warm', 0) / 2**20:.0f} MiB, at the end {rss['end'] / 2**20:.0f} MiB "
                 f"({'-' if growth is None else f'{growth:+.1%}'})")
    lines += [f"{'PASS' if ok else 'FAIL'}  {name}" for name, ok in rep["checks"].items()]
    lines += [f"  mismatch: {m}" for m in rep["mismatched"][:5]] + [f"  failure: {f}" for f in rep["failures"][:5]]
    return "\n".join(lines)
