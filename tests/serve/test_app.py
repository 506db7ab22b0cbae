"""The app in-process (httpx over ASGI, no socket): what is awkward to provoke in a
subprocess. Priorities reach the queue; a draining server says 503; an oversized
body is refused before it is read; a key caps the priority its requests may ask."""
from __future__ import annotations

import asyncio

import pytest

import httpx

from hetero_sd.engine import Engine
from hetero_sd.serve.app import ServerState, create_app
from hetero_sd.serve.limits import ServeLimits

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def state(serve_config):
    st = ServerState(Engine.from_config(serve_config), "tiny", max_running=1, max_waiting=8)
    st.start()
    yield st
    st.close()


def call(state, *requests):
    """Send (method, path, json) requests concurrently; the responses in order."""
    async def go():
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as client:
            return await asyncio.gather(*(client.request(m, path, json=body) for m, path, body in requests))

    return asyncio.run(go())


def test_higher_priority_runs_first(state):
    """One running slot: a long request holds it while a low and then a high priority wait."""
    order = []
    state.batch.on_finish = lambda handle, result: (order.append(handle.request.priority),
                                                    state.metrics.on_finish(handle, result))

    async def go():
        transport = httpx.ASGITransport(app=create_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as client:
            def post(priority, tokens):
                return asyncio.create_task(client.post("/v1/completions", json={
                    "prompt": "story number 0", "max_tokens": tokens, "priority": priority}))
            first = post(1, 120)
            while state.batch.counts()[0] == 0:  # the long one runs before the others arrive
                await asyncio.sleep(0.01)
            low = post(0, 4)
            await asyncio.sleep(0.05)
            high = post(9, 4)
            return [(await t).status_code for t in (first, low, high)]

    assert asyncio.run(go()) == [200, 200, 200]
    assert order == [1.0, 9.0, 0.0]


def test_draining_server_says_503(state):
    (health,) = call(state, ("GET", "/health", None))
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    state.drain()
    health, refused = call(state, ("GET", "/health", None),
                           ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}))
    assert health.status_code == 503 and health.json() == {"status": "draining"}
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == 503 and "shutting down" in refused.json()["error"]["message"]


def test_oversized_body_is_refused_unread(state):
    state.limits = ServeLimits(max_body=1000)
    big, small = call(state, ("POST", "/v1/completions", {"prompt": "x" * 2000}),
                      ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 2}))
    assert big.status_code == 413 and big.json()["error"]["code"] == 413
    assert small.status_code == 200


def test_api_keys_carry_default_priorities(serve_config):
    """Several keys, each with the priority its requests get when they name none, and
    the most they may name: a body asking more is capped at its key's."""
    st = ServerState(Engine.from_config(serve_config), "tiny", api_key={"interactive": 5.0, "batch": -1.0})
    st.start()
    seen = []
    st.batch.on_finish = lambda handle, result: seen.append(handle.request.priority)

    async def go():
        transport = httpx.ASGITransport(app=create_app(st))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost", timeout=60) as client:
            out = []
            for key, body in (("interactive", {}), ("batch", {}), ("batch", {"priority": 3}),
                              ("interactive", {"priority": 2}), ("nope", {})):
                r = await client.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                      json={"prompt": "x", "max_tokens": 2, **body})
                out.append(r.status_code)
            return out

    try:
        assert asyncio.run(go()) == [200, 200, 200, 200, 401]
    finally:
        st.close()
    assert seen == [5.0, -1.0, -1.0, 2.0]


def test_api_key_flag_parsing(monkeypatch):
    from hetero_sd.serve.cli import api_keys

    monkeypatch.delenv("HETERO_SD_API_KEY", raising=False)
    assert api_keys(None) == {}
    assert api_keys(["a", "b=5", "c=-2", "YWJj==", "x=y"]) == {"a": 0.0, "b": 5.0, "c": -2.0, "YWJj==": 0.0,
                                                               "x=y": 0.0}
    monkeypatch.setenv("HETERO_SD_API_KEY", "secret")
    assert api_keys(None) == {"secret": 0.0} and api_keys(["other"]) == {"other": 0.0}
