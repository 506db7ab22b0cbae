"""Fixtures for the HTTP server tests (each skips without the `server` extra): a tiny
random Llama (torch fp32, n-gram drafts) served by `hetero-sd serve` as a real
subprocess (tests/helpers/serving.py).

    def test_x(server):                      # one server per session, default flags
        httpx.get(server.url + "/health")
    def test_y(start_server, serve_config):  # a server of your own, stopped at the end
        srv = start_server(serve_config, "--max-running", "1")
"""
from __future__ import annotations

import pytest

from helpers.serving import ServerProcess, write_config


@pytest.fixture(scope="session")
def serve_config(tiny_model_dir, tmp_path_factory) -> str:
    return write_config(tmp_path_factory.mktemp("serve") / "tiny.yaml", tiny_model_dir("llama"))


@pytest.fixture
def start_server():
    started: list[ServerProcess] = []

    def start(config: str, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
        srv = ServerProcess(config, *args, env=env)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture(scope="session")
def server(serve_config):
    srv = ServerProcess(serve_config)
    yield srv
    srv.stop()
    assert srv.proc.returncode == 0, srv.log
    assert "Traceback" not in srv.log, srv.log
