"""A short soak (benchmarks/soak.py) of the real server on a tiny model: mixed requests at
concurrency 8, streamed and whole, chat and completions, sampled with seeds, JSON
constrained, logprobs with a penalty, cancelled mid-stream and hostile bodies. Every
deterministic answer must equal the same request run alone, nothing may fail, memory may
not grow, and afterwards no KV may be held by a request. The long soak (2,000 requests on
the default model) is `python benchmarks/bench_serve.py --soak`."""
from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak", _PATH)
soak = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("soak", soak)  # dataclasses look their module up there
_spec.loader.exec_module(soak)

PROMPTS = ["Tell me about the sea.", "List three colours.", "What is 2 + 2?", "Write a haiku about rain.",
           "Repeat: one two three one two three one two three"]


def test_short_soak(start_server, serve_config):
    srv = start_server(serve_config, "--max-running", "8")
    opts = soak.SoakOptions(requests=160, concurrency=8, max_tokens=8, warm=60, prompts=PROMPTS,
                            time_limit_s=300, request_timeout_s=120)
    rep = asyncio.run(soak.soak(srv.url, srv.pid, opts))
    assert rep["passed"], soak.render(rep)
    assert rep["requests"] == 160 and rep["compared_with_solo"] >= 90
    assert {k: s["requests"] for k, s in rep["by_kind"].items()} == {
        "chat-stream": 48, "chat": 16, "sampled": 16, "completion": 16, "json": 16, "logprobs": 16, "cancel": 16,
        "hostile": 16}
    assert srv.terminate() == 0 and "Traceback" not in srv.log, srv.log


def test_the_checks_can_fail():
    """The report fails a soak whose answer differs from its solo run, whose memory grew,
    or whose pool still holds a request's KV."""
    o = soak.Outcome
    opts = soak.SoakOptions(requests=2, prompts=PROMPTS)
    refs = {("chat", 0, None): o(0, "chat", True, 0.1, "a b", "stop")}
    good = [o(0, "chat", True, 0.1, "a b", "stop", key=("chat", 0, None)),
            o(1, "hostile", True, 0.01, status=400)]
    idle = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_sequences": 3,
            "prefix_cache_sequences": 3, "kv_cache_request_usage_perc": 0.0}
    assert soak.report(good, refs, {"warm": 100, "end": 104}, idle, 1.0, 1.0, opts)["passed"]
    differs = [o(0, "chat", True, 0.1, "a c", "stop", key=("chat", 0, None)), good[1]]
    bad = soak.report(differs, refs, {"warm": 100, "end": 104}, idle, 1.0, 1.0, opts)
    assert not bad["passed"] and bad["mismatched"][0]["got"] == "a c"
    assert not soak.report(good, refs, {"warm": 100, "end": 106}, idle, 1.0, 1.0, opts)["passed"]
    leaked = {**idle, "kv_cache_sequences": 4, "kv_cache_request_usage_perc": 0.01}
    assert not soak.report(good, refs, {"warm": 100, "end": 100}, leaked, 1.0, 1.0, opts)["passed"]
    lost = soak.report(good[:1], refs, {"warm": 100, "end": 100}, idle, 1.0, 1.0, opts)
    assert not lost["checks"]["all requests answered"]
    text = ('# TYPE hetero_sd:num_requests_running gauge\nhetero_sd:num_requests_running{model_name="m"} 2.0\n'
            '# TYPE hetero_sd:prompt_tokens counter\nhetero_sd:prompt_tokens_total{model_name="m"} 7.0\n')
    assert soak.gauges(text) == {"num_requests_running": 2.0}  # counters are not gauges
