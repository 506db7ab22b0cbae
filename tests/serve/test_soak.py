"""A short soak (benchmarks/soak.py) of the real server on a tiny model: mixed requests at
concurrency 8, streamed and whole, chat and completions, sampled with seeds, JSON
constrained, logprobs with a penalty, cancelled mid-stream, and 29 kinds of hostile
traffic (invalid bodies, wrong keys, rebinding Hosts, oversized, slow and stalled
clients, dropped prefills, injected failures), each several times. Every deterministic
answer must equal the same request run alone, no valid request may fail, every hostile
one must get its answer (or a close) in time, memory may not grow, and afterwards no KV
may be held by a request and the server's file descriptors and /dev/shm must be back to
their baseline. The long soak (2,000 requests at C = 32 on the default model) is
`python benchmarks/bench_serve.py --soak`."""
from __future__ import annotations

import asyncio
import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

# soak.py imports its siblings (soak_kinds, soak_hostile: the dataclasses) from its own folder
_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak", _PATH)
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)

PROMPTS = ["Tell me about the sea.", "List three colours.", "What is 2 + 2?", "Write a haiku about rain.",
           "Repeat: one two three one two three one two three"]


def test_short_soak(start_server, serve_config, tmp_path):
    opts = soak.SoakOptions(requests=240, concurrency=8, max_tokens=8, warm=60, prompts=PROMPTS,
                            time_limit_s=300, request_timeout_s=120, settle_s=15)
    srv = start_server(serve_config, "--max-running", "8", *soak.server_args(opts, tmp_path))
    rep = asyncio.run(soak.soak(srv.url, srv.pid, opts))
    assert rep["passed"], soak.render(rep)
    assert rep["requests"] == 240 and rep["compared_with_solo"] == 128
    counts = {k: s["requests"] for k, s in rep["by_kind"].items()}
    assert {k: counts[k] for k in soak.VALID} == {
        "chat-stream": 48, "chat": 16, "sampled": 16, "completion": 16, "json": 16, "logprobs": 16, "cancel": 16}
    hostile = {k: counts[k] for k in soak.HOSTILE_KINDS}
    assert len(hostile) == 29 and sum(hostile.values()) == 96 and min(hostile.values()) >= 3, hostile
    assert srv.terminate() == 0 and "Traceback" not in srv.log, srv.log


def test_the_checks_can_fail():
    """The report fails a soak whose answer differs from its solo run, whose memory grew,
    whose pool still holds a request's KV, whose server kept file descriptors or /dev/shm
    segments, or whose hostile request was answered wrongly or too late."""
    o = soak.Outcome
    opts = soak.SoakOptions(requests=3, prompts=PROMPTS)
    refs = {("chat", 0, None): o(0, "chat", True, 0.1, "a b", "stop")}
    good = [o(0, "chat", True, 0.1, "a b", "stop", key=("chat", 0, None)),
            o(1, "not JSON", True, 0.01, status=400), o(2, "slow headers", True, 2.1, note="closed")]
    idle = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_sequences": 3,
            "prefix_cache_sequences": 3, "kv_cache_request_usage_perc": 0.0}
    res = {"fds": {"baseline": 20, "end": 24}, "shm": {"baseline": ["a"], "end": ["a"]}}
    run = lambda outcomes=good, rss=None, after=idle, res=res: soak.report(  # noqa: E731
        outcomes, refs, rss or {"warm": 100, "end": 104}, after, 1.0, 1.0, opts, res)
    rep = run()
    assert rep["passed"], rep["checks"]
    assert rep["by_kind"]["slow headers"]["notes"] == {"closed": 1} and rep["hostile_kinds"] == 2
    assert "| slow headers | closed (or 4xx)" in soak.render(rep)
    differs = run([o(0, "chat", True, 0.1, "a c", "stop", key=("chat", 0, None)), *good[1:]])
    assert not differs["passed"] and differs["mismatched"][0]["got"] == "a c"
    assert not run(rss={"warm": 100, "end": 106})["passed"]
    leaked = {**idle, "kv_cache_sequences": 4, "kv_cache_request_usage_perc": 0.01}
    assert not run(after=leaked)["passed"]
    lost = run(good[:2])
    assert not lost["checks"]["all requests answered"]
    failed_valid = run([o(0, "chat", False, 0.1, error="chat: status 500"), *good[1:]])
    assert not failed_valid["checks"]["no valid request failed or lost"]
    wrong = [*good[:2], o(2, "slow headers", False, 7.0, error="slow headers: no answer nor close within 7 s")]
    rep = run(wrong)
    assert not rep["checks"]["every hostile request got its expected answer, or a close, within its bound"]
    assert rep["checks"]["no valid request failed or lost"] and rep["by_kind"]["slow headers"]["failed"] == 1
    fds = run(res={**res, "fds": {"baseline": 20, "end": 25}})
    assert [k for k, ok in fds["checks"].items() if not ok] == [
        "open file descriptors back to within 4 of their baseline"]
    shm = run(res={**res, "shm": {"baseline": ["a"], "end": ["a", "psm_1"]}})
    assert not shm["checks"]["/dev/shm back to its baseline entries"] and shm["new_shm"] == ["psm_1"]
    gone = run(res={**res, "shm": {"baseline": ["a", "b"], "end": ["a"]}})  # another's segment went away
    assert gone["passed"]
    text = ('# TYPE hetero_sd:num_requests_running gauge\nhetero_sd:num_requests_running{model_name="m"} 2.0\n'
            '# TYPE hetero_sd:prompt_tokens counter\nhetero_sd:prompt_tokens_total{model_name="m"} 7.0\n')
    assert soak.gauges(text) == {"num_requests_running": 2.0}  # counters are not gauges


def test_the_hostile_checks_can_fail(tmp_path):
    """Against a stub server that never closes, answers 200, or refuses with the wrong
    status, each raw-socket hostile kind fails within its bound; against one that does
    the right thing, it passes. The fault plan names every phase's marker and message."""
    opts = soak.SoakOptions(prompts=PROMPTS, header_timeout_s=0.4, body_timeout_s=0.4, margin_s=0.6,
                            hostile_timeout_s=2)
    args = soak.server_args(opts, tmp_path)
    assert args[:2] == ["--api-key", "soak-key"] and "--header-timeout" in args and "--stall-timeout" in args
    rules = json.loads(Path(args[args.index("--fault-plan") + 1]).read_text())
    assert {r["phase"] for r in rules} == {"admit", "prefill", "propose", "score", "accept"}

    async def stub(behaviour):
        async def handle(reader, writer):
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.6 if behaviour == "right" else 30)
                got = 0
                while b"chunked" in head and behaviour == "right" and got <= soak.MAX_BODY:
                    got += len(await reader.read(2**16))  # refused once past 8 MiB
                if behaviour == "200":
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                elif behaviour == "right" and b"Content-Length: 1000" in head:
                    await asyncio.sleep(0.4)
                    writer.write(b'HTTP/1.1 408 Request Timeout\r\nContent-Length: 20\r\n\r\n{"error": {"x": 1}}\n')
                elif behaviour == "right":
                    writer.write(b'HTTP/1.1 413 Too Large\r\nContent-Length: 20\r\n\r\n{"error": {"x": 1}}\n')
                else:
                    await asyncio.sleep(30)
                await writer.drain()
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                pass  # "right": a head that does not come in time is closed
            finally:
                writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        t = soak._Target("127.0.0.1", server.sockets[0].getsockname()[1], None, opts)
        kinds = ("slow headers", "idle connection", "not HTTP", "slow body", "oversized Content-Length",
                 "oversized chunked body")
        try:
            return dict(zip(kinds, await asyncio.gather(*(soak.hostile(t, 0, k, "hi") for k in kinds))))
        finally:
            server.close()

    right = asyncio.run(stub("right"))
    assert all(o.ok for o in right.values()), {k: o.error for k, o in right.items()}
    for behaviour in ("hang", "200"):
        wrong = asyncio.run(stub(behaviour))
        assert not any(o.ok for o in wrong.values()), (behaviour, {k: o.note for k, o in wrong.items()})
        assert all(o.latency_s < soak.expected(k, opts)[1] + 1 for k, o in wrong.items())
