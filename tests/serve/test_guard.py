"""The server under hostile or careless clients, in process (httpx over ASGI): bodies
counted as they arrive (chunked too) and timed, Hosts a rebinding page would send,
heavy work kept off the event loop, streams whose client stopped reading, the small
gaps (a bad tool schema, a config budget past the context, a subnormal temperature),
and the serve command's refusals: empty keys, open binds, bad limits."""
from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from hetero_sd.engine import Engine
from hetero_sd.errors import HeteroSDError
from hetero_sd.serve.app import ServerState, create_app
from hetero_sd.serve.limits import ServeLimits, host_name, is_loopback
from hetero_sd.serve.responses import StallGuardedStream

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def state(serve_config):
    st = ServerState(Engine.from_config(serve_config), "tiny", max_running=2, max_waiting=8,
                     limits=ServeLimits(body_timeout_s=0.5))
    st.start()
    yield st
    st.close()


def _client(state, host="localhost"):
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(state)), base_url=f"http://{host}",
                             timeout=60)


def run(coro):
    return asyncio.run(coro)


def test_a_chunked_body_is_counted_as_it_arrives(state):
    state.limits = ServeLimits(max_body=10_000)
    sent = []

    async def chunks(n):  # no Content-Length: the body arrives in pieces
        for i in range(n):
            sent.append(i)
            yield b" " * 1000

    async def go():
        async with _client(state) as c:
            big = await c.post("/v1/completions", content=chunks(50), headers={"content-type": "application/json"})
            sent.clear()
            ok = await c.post("/v1/completions", content=_json_chunks(b'{"prompt": "x", "max_tokens": 2}'),
                              headers={"content-type": "application/json"})
            return big, ok

    big, ok = run(go())
    assert big.status_code == 413 and big.json()["error"]["code"] == 413
    assert ok.status_code == 200, ok.text


async def _json_chunks(body: bytes):
    for i in range(0, len(body), 5):
        yield body[i:i + 5]


def test_a_slow_body_gets_408(state):
    async def trickle():
        yield b'{"prompt": '
        await asyncio.sleep(5)
        yield b'"x"}'

    async def go():
        async with _client(state) as c:  # (the body's second half would come 5 s later)
            return await c.post("/v1/completions", content=trickle(), headers={"content-type": "application/json"})

    r = run(go())
    assert r.status_code == 408 and "within 0.5 s" in r.json()["error"]["message"]


def test_a_rebinding_host_is_refused(state):
    async def go(host, allowed=()):
        state.limits = ServeLimits(allowed_hosts=allowed)
        async with _client(state, host) as c:
            return (await c.get("/v1/models")).status_code

    assert run(go("evil.example")) == 403
    assert run(go("evil.example:8000")) == 403
    assert run(go("localhost:8000")) == 200 and run(go("127.0.0.1:8000")) == 200 and run(go("[::1]:80")) == 200
    assert run(go("my.box:8000", ("my.box",))) == 200 and run(go("evil.example", ("*",))) == 200
    assert host_name("[::1]:8000") == "::1" and host_name("Example.COM") == "example.com"
    assert is_loopback("127.0.0.2") and is_loopback("::1") and not is_loopback("0.0.0.0")


def test_a_slow_grammar_compile_stalls_nothing(state, monkeypatch):
    """The compile runs on a worker thread, outside the batch lock: /metrics and /health answer."""
    from hetero_sd.constraint import guide

    real, order = guide.GuideCompiler.guide, []
    entered, release = threading.Event(), threading.Event()

    def slow(self, constraint):  # a compile that lasts until /metrics and /health have answered
        entered.set()
        release.wait(20)  # (a breaker: where they cannot answer first, the order shows it)
        order.append("compiled")
        return real(self, constraint)

    monkeypatch.setattr(guide.GuideCompiler, "guide", slow)

    async def go():
        async with _client(state) as c:
            task = asyncio.create_task(c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "response_format": {"type": "json_object"}}))
            while not entered.is_set():
                await asyncio.sleep(0.01)
            metrics, health = await c.get("/metrics"), await c.get("/health")
            order.append("answered")
            release.set()
            return await task, metrics, health

    constrained, metrics, health = run(go())
    assert constrained.status_code == 200 and metrics.status_code == 200 and health.status_code == 200
    assert order[0] == "answered", order


def test_a_stream_whose_client_stopped_reading_is_cancelled():
    closed, sent = [], []

    async def endless():
        try:
            while True:
                yield "data: x\n\n"
                await asyncio.sleep(0)
        finally:
            closed.append(True)  # what frees a stream's sequences (responses._sse's finally)

    async def send(message):
        sent.append(message)
        if len(sent) > 3:  # the client's buffers are full: a write never completes
            await asyncio.Event().wait()

    async def go():
        await asyncio.wait_for(StallGuardedStream(endless(), 0.3).stream_response(send), 10)

    run(go())  # (a plain StreamingResponse never returns: wait_for's 10 s end it with an error)
    assert closed and len(sent) == 4


def test_a_bad_tool_schema_is_the_clients_error(state):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}

    async def go():
        async with _client(state) as c:
            return await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                              "tools": [tool], "tool_choice": "required"})

    r = run(go())
    assert r.status_code == 400 and "no-such-type" in r.json()["error"]["message"], r.text


def test_a_schema_past_the_cap_is_refused(state):
    state.limits = ServeLimits(max_schema_bytes=200)
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(40)}}

    async def go():
        async with _client(state) as c:
            return await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})

    r = run(go())
    assert r.status_code == 400 and "response_format is larger" in r.json()["error"]["message"]


def test_a_config_budget_past_the_context_still_serves(state):
    """max_tokens omitted: the config's budget, as much of it as the context leaves."""
    state.engine.max_new_tokens = 10 ** 6

    async def go():
        async with _client(state) as c:
            return await c.post("/v1/completions", json={"prompt": "hello"})

    r = run(go())
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] <= state.batch.target.max_context


def test_a_subnormal_temperature_decodes_greedily(state):
    async def go():
        async with _client(state) as c:
            return [(await c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 8,
                                                           "temperature": t})).json() for t in (1e-310, 0)]

    tiny, greedy = run(go())
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_body_fields_reach_the_submission(state, monkeypatch):
    """cache_salt partitions the prefix cache with the key's tenant; timeout lowers the deadline."""
    seen = []
    real = state.batch.submit
    monkeypatch.setattr(state.batch, "submit", lambda sub, cb: (seen.append(sub), real(sub, cb))[1])
    state.limits = ServeLimits(request_timeout_s=60)

    async def go():
        async with _client(state) as c:
            for extra in ({}, {"cache_salt": "s1", "timeout": 5}, {"timeout": 600}):
                assert (await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **extra})
                        ).status_code == 200

    run(go())
    assert [(s.tenant, s.deadline_s) for s in seen] == [("/", 60), ("/s1", 5), ("/", 60)]


# ------------------------------------------------------------------ the serve command
def test_empty_and_blank_keys_are_refused():
    from hetero_sd.serve.cli import api_keys

    for given, env in (([""], {}), (["  "], {}), (None, {"HETERO_SD_API_KEY": ""}),
                       ([" padded"], {})):
        with pytest.raises(HeteroSDError):
            api_keys(given, env)
    assert api_keys(None, {}) == {} and api_keys(["k=2"], {}) == {"k": 2.0}


def test_an_open_bind_needs_a_key_or_allow_open():
    from hetero_sd.serve.cli import check_bind

    with pytest.raises(HeteroSDError, match="--allow-open"):
        check_bind("0.0.0.0", {}, False)
    check_bind("0.0.0.0", {"k": 0.0}, False)
    check_bind("0.0.0.0", {}, True)
    check_bind("127.0.0.1", {}, False)
    check_bind("localhost", {}, False)


def test_secrets_stay_out_of_workers(monkeypatch):
    import os
    import sys

    from hetero_sd.serve.cli import _scrub_secrets

    monkeypatch.setenv("HETERO_SD_API_KEY", "s3cret")
    monkeypatch.setattr(sys, "argv", ["hetero-sd", "serve", "--api-key", "s3cret=4"])
    _scrub_secrets({"s3cret": 4.0})
    assert "HETERO_SD_API_KEY" not in os.environ and not any("s3cret" in a for a in sys.argv)


@pytest.mark.parametrize("flag,value", [("--prefix-cache", "-1"), ("--drain-s", "inf"), ("--drain-s", "nan"),
                                        ("--header-timeout", "0"), ("--request-timeout", "inf"),
                                        ("--max-connections", "0")])
def test_bad_limits_are_refused_by_name(flag, value, capsys):
    from hetero_sd.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", flag, value])
    assert flag in capsys.readouterr().err
