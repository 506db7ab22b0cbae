"""Issue 15, point 6: SIGTERM during 8 running streams. Each stream ends with a final chunk
carrying a finish_reason (then [DONE]), the process exits 0, and the drafter worker's
shared-memory segments (`/dev/shm/hsd-*`) and the worker process are gone."""
from __future__ import annotations

import os
import threading
import time

import pytest

import httpx

from helpers.serving import SLOW_ENV, metric, parse_sse, write_slow_config
from hetero_sd.transport.segment import SHM_DIR

STREAMS = 8
# Prompts "story number i" whose greedy output on the tiny model runs to max_tokens (no EOS):
# the 8 requests must still be running when SIGTERM arrives.
LONG = (0, 1, 2, 5, 8, 10, 11, 13)


def segments(pid: int) -> list[str]:
    """Shared-memory segments created by process `pid` (their names carry the creator's pid)."""
    if not os.path.isdir(SHM_DIR):
        return []
    return [n for n in os.listdir(SHM_DIR) if n.startswith("hsd-") and f"-{pid}-" in n]


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


@pytest.fixture
def worker_config(tiny_model_dir, tmp_path) -> str:
    # the drafter in its own process over shared memory: the server owns segments and a child
    # the target slowed by declared costs, so all 8 are still running when SIGTERM comes on any host
    return write_slow_config(tmp_path / "worker.yaml", tiny_model_dir("llama"),
                             "{kind: ngram, k: 4, process: worker, transport: shm, threads: 1}")


def read_stream(url: str, i: int, out: dict, started: threading.Event) -> None:
    body = {"messages": [{"role": "user", "content": f"story number {LONG[i]}"}], "max_tokens": 200,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        lines = []
        for line in resp.iter_lines():
            lines.append(line)
            started.set()
        out[i] = (resp.status_code, parse_sse(lines))


def test_sigterm_ends_every_stream_and_cleans_up(start_server, worker_config):
    # --drain-s 0: requests still running when SIGTERM arrives are aborted at the next step
    srv = start_server(worker_config, "--max-running", str(STREAMS), "--drain-s", "0", env=SLOW_ENV)
    assert segments(srv.pid), "the worker drafter's shared memory should exist while serving"
    workers = children(srv.pid)
    assert workers
    results, threads = {}, []
    for i in range(STREAMS):
        started = threading.Event()
        th = threading.Thread(target=read_stream, args=(srv.url, i, results, started), daemon=True)
        th.start()
        threads.append(th)
        assert started.wait(60)
    deadline = time.monotonic() + 60
    while metric(httpx.get(srv.url + "/metrics").text, "hetero_sd:num_requests_running") < STREAMS:
        assert time.monotonic() < deadline, "the 8 requests never ran together"
        time.sleep(0.02)
    assert srv.terminate(timeout=60) == 0, srv.log
    for th in threads:
        th.join(30)
    assert sorted(results) == list(range(STREAMS))
    for status, events in results.values():
        assert status == 200 and events[-1] == "[DONE]"
        final = events[-2]
        assert final["choices"][0]["finish_reason"] == "abort", final
        assert final["speculation"]["rounds"] >= 1  # they had run
    assert "Traceback" not in srv.log, srv.log
    assert [seg for pid in [srv.pid, *workers] for seg in segments(pid)] == []
    # the drafter worker, and multiprocessing's resource tracker, which leaves once its parent has
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [(pid, cmdline(pid)) for pid in workers if alive(pid)]
