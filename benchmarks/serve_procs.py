"""Server processes for benchmarks/bench_serve.py: ports on 127.0.0.1, start in a
session of their own, wait until ready, stop (SIGTERM, then the whole group),
and read our /metrics' acceptance counters."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

HOST = "127.0.0.1"  # never any other address: the servers are reachable from this host only


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def wait_ready(proc: subprocess.Popen, base: str, log: Path, timeout_s: float, api_key: str | None = None) -> str:
    """Poll /v1/models (with the key, if the server wants one) until the server answers;
    the served model's id."""
    import httpx

    deadline = time.monotonic() + timeout_s
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready:\n{_tail(log)}")
        try:
            models = httpx.get(f"{base}/v1/models", headers=headers, timeout=5)
            if models.status_code == 200:
                return models.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            pass  # not listening yet, or still loading
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s:\n{_tail(log)}")


def stop(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """SIGTERM (a graceful shutdown), then SIGKILL to the process group we created."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: only what it started dies
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


@contextmanager
def serving(argv: list[str], port: int, log: Path, ready_timeout_s: float):
    """A server started in its own session, yielded once ready as (base url, model id); always stopped."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=tempfile.gettempdir())
    try:
        base = f"http://{HOST}:{port}"
        yield base, wait_ready(proc, base, log, ready_timeout_s)
    finally:
        stop(proc)


def scrape_acceptance(base: str) -> dict | None:
    """Drafted and accepted tokens from our /metrics (vLLM's names under hetero_sd:), if it has them."""
    import httpx
    try:
        from prometheus_client.parser import text_string_to_metric_families
        text = httpx.get(f"{base}/metrics", timeout=10).text
    except Exception:  # noqa: BLE001 -- metrics are a bonus: their absence never fails the benchmark
        return None
    got = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:  # counters: `name_total` (typed) or as written (untyped)
            name = sample.name.removesuffix("_total")
            for key in ("num_draft_tokens", "num_accepted_tokens"):
                if name.endswith("spec_decode_" + key):
                    got[key] = got.get(key, 0) + sample.value
    return got or None


def acceptance(before: dict | None, after: dict | None) -> dict | None:
    """The counters' growth over the level (the warm-up excluded) and accepted / drafted."""
    if not after:
        return None
    got = {k: v - (before or {}).get(k, 0) for k, v in after.items()}
    if got.get("num_draft_tokens"):
        got["acceptance"] = got.get("num_accepted_tokens", 0) / got["num_draft_tokens"]
    return got
