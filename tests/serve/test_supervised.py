"""What clients and a supervisor see of a real `hetero-sd serve` process: a request that
fails (an injected fault, --fault-plan) fails alone, over HTTP; a connection that never
sends its request head is closed; a batch engine that dies turns /health to 503, fails
what waits with 503 and ends the process with status 3; an open bind without a key
never starts."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import httpx
import pytest

from hetero_sd.engine import Engine
from hetero_sd.serve.app import ServerState, create_app
from hetero_sd.serve.faults import Fault, FaultPlan
from helpers.serving import REPO

pytest.importorskip("fastapi")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _plan(tmp_path, *rules) -> str:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps([{"marker": m, "phase": ph, "error": e, "message": msg} for m, ph, e, msg in rules]))
    return str(path)


def test_faults_over_http_and_a_silent_connection(start_server, serve_config, tmp_path):
    plan = _plan(tmp_path, ("BREAKPROPOSE", "propose", "RuntimeError", "injected propose"),
                 ("BREAKACCEPT", "accept", "ValueError", "injected accept"),
                 ("KILLTHEENGINE", "thread", "ValueError", "engine bug"))
    srv = start_server(serve_config, "--fault-plan", plan, "--header-timeout", "1", "--max-running", "4")
    url = srv.url

    silent = socket.create_connection((url.split("//")[1].split(":")[0], int(url.rsplit(":", 1)[1])))
    silent.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")  # ... and never the rest
    silent.settimeout(30)  # (--header-timeout 1: closed long before; a recv that times out raises)
    assert silent.recv(100) == b""  # closed by the server, unanswered
    silent.close()

    with httpx.Client(base_url=url, timeout=60) as c:
        def ask(prompt, stream=False):
            return c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "stream": stream})

        good = ask("the sea is calm")
        for marker in ("BREAKPROPOSE", "BREAKACCEPT"):
            bad = ask(f"{marker} the sea")
            assert bad.status_code == 500 and f"injected {marker[5:].lower()}" in bad.json()["error"]["message"]
        streamed = ask("BREAKACCEPT now", stream=True)
        assert streamed.status_code == 200 and '"error"' in streamed.text and "injected accept" in streamed.text
        again = ask("the sea is calm")
        assert again.status_code == 200 and again.json()["choices"][0]["text"] == good.json()["choices"][0]["text"]

        dead = ask("KILLTHEENGINE please")
        assert dead.status_code == 500 and "engine bug" in dead.json()["error"]["message"]
    assert srv.proc.wait(30) == 3
    assert "the batch engine died" in srv.log


def test_a_dead_engine_says_503(serve_config):
    engine = Engine.from_config(serve_config)
    plan = FaultPlan([Fault("KILL", "thread", "RuntimeError", "bug")], engine.tokenizer.decode)
    died = []
    st = ServerState(engine, "tiny", faults=plan, on_death=died.append)
    st.start()

    async def go():
        transport = httpx.ASGITransport(app=create_app(st))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as client:
            first = await client.post("/v1/completions", json={"prompt": "KILL it", "max_tokens": 2})
            return first, await client.get("/health"), await client.post(
                "/v1/completions", json={"prompt": "hello", "max_tokens": 2})

    import asyncio

    try:
        first, health, after = asyncio.run(go())
    finally:
        st.close()
    assert first.status_code == 500 and died
    assert health.status_code == 503 and health.json()["status"] == "failed" and "bug" in health.json()["error"]
    assert after.status_code == 503 and "batch engine stopped" in after.json()["error"]["message"]


def test_an_open_bind_without_a_key_does_not_start(serve_config):
    out = subprocess.run([sys.executable, "-m", "hetero_sd.cli", "serve", "--config", serve_config,
                          "--host", "0.0.0.0", "--port", "0"], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "HOME": str(REPO)} | _python_env())
    assert out.returncode != 0 and "--allow-open" in out.stderr, out.stderr


def _python_env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if k != "HETERO_SD_API_KEY"}
