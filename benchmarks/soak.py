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
  the outcome it must get and a time bound (`expected(name, opts)`):
  * ten malformed or invalid bodies (HOSTILE): 400 with an OpenAI error body;
  * no key, a wrong key: 401; a rebinding Host (evil.example) or a look-alike one
    (localhost.evil.example): 403;
  * a Content-Length past 8 MiB: 413; a chunked body sent up to 32 MiB: 413, or the
    connection closed, once past 8 MiB and before all of it is sent (the client stops
    sending once refused);
  * slow headers (half a request head, then nothing), an idle connection (nothing at all),
    a slow second head (a kept-alive connection's second request head half sent), not
    HTTP (a TLS ClientHello), a huge header (1 MiB): closed (or a 4xx) within
    --header-timeout + margin, and not before half of it for the slow ones;
  * a slow body (Content-Length 1000, 10 bytes sent): 408, or closed, within
    --body-timeout + margin;
  * a client that stops reading mid-stream (a small receive buffer, a long stream with
    top_logprobs 20): the head and a first chunk arrive, then it reads nothing for
    --stall-timeout + 2 s while /health must still answer; whether the server closed the
    stalled stream is noted (not checked: the kernel's socket buffers, up to tcp_wmem's
    4 MiB on the server's side, can hold a whole short stream, so no stall is felt);
  * a client that disconnects mid-prefill (a long prompt, closed, or reset, at once);
  * an injected failure (--fault-plan, written by `server_args`) in each batch-engine
    phase (admit, prefill, propose, score, accept), its marker in the prompt: HTTP 500
    whose error names the rule's message, or a stream's error chunk naming it.

Every request with a deterministic answer (greedy, or sampled with a seed) is first run
alone, one at a time, before the load: under load each must equal its solo answer, text
and finish reason. The server's resident memory is read after the first `warm` requests
and at the end (it may not grow past `rss_tolerance`). Once the load has stopped its
/metrics must show nothing running or waiting and no sequence held but the prefix
cache's; with every client closed, its open file descriptors must come back to within
`fd_tolerance` of their count after the solo runs, and /dev/shm to the entries it had
then. Traffic goes to the server's 127.0.0.1 URL only; the run is bounded by its request
count and a time limit, so it stops by itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

KINDS = ("chat-stream", "chat", "sampled", "completion", "json", "chat-stream", "logprobs", "cancel", "hostile",
         "chat-stream", "hostile", "hostile", "hostile", "hostile", "hostile")
DETERMINISTIC = ("chat-stream", "chat", "sampled", "completion", "json", "logprobs")
VALID = ("chat-stream", "chat", "sampled", "completion", "json", "logprobs", "cancel")
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
# (phase, the exception raised there) of the injected failures: one hostile kind each
FAULTS = (("admit", "RuntimeError"), ("prefill", "ValueError"), ("propose", "KeyError"), ("score", "MemoryError"),
          ("accept", "AssertionError"))
HOSTILE_KINDS = tuple(what for what, _ in HOSTILE) + (
    "no key", "wrong key", "rebinding Host", "look-alike Host", "oversized Content-Length", "oversized chunked body",
    "slow headers", "idle connection", "slow second head", "not HTTP", "huge header", "slow body",
    "stop reading mid-stream",
    "disconnect mid-prefill") + tuple(f"fault in {phase}" for phase, _ in FAULTS)
MAX_BODY = 8 * 2**20  # the server's bound on a request body


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
    note: str = ""  # how a hostile request ended, when more than one ending passes


@dataclass
class SoakOptions:
    requests: int = 2000
    concurrency: int = 32
    max_tokens: int = 24
    warm: int = 200  # RSS is compared against its value after this many requests
    rss_tolerance: float = 0.05
    time_limit_s: float = 3600.0
    request_timeout_s: float = 300.0
    seed: int = 0
    model: str = "default"
    prompts: list[str] = field(default_factory=list)
    # the server's side of the hostile traffic (server_args passes them as its flags)
    api_key: str = "soak-key"
    header_timeout_s: float = 2.0
    body_timeout_s: float = 2.0
    stall_timeout_s: float = 3.0
    margin_s: float = 5.0  # a timeout may fire this late on a loaded host
    hostile_timeout_s: float = 30.0  # the bound on a refusal that needs no timeout of the server's
    long_prompt_tokens: int = 1024  # disconnect mid-prefill: at most this long (and 3/4 of the context)
    stall_max_tokens: int = 2048  # stop reading mid-stream: at most this many tokens (and the context)
    oversize_bytes: int = MAX_BODY + 2**20  # oversized Content-Length: what it announces
    chunked_bytes: int = 4 * MAX_BODY  # oversized chunked body: the most it sends before a refusal
    fd_tolerance: int = 4
    settle_s: float = 20.0  # after the load, how long the server may take to come back to idle


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


def _marker(phase: str) -> str:
    return f"SOAK-FAULT-{phase.upper()}"


def _fault_message(phase: str, error: str) -> str:
    return f"soak: injected {error} in {phase}"


def expected(name: str, opts: SoakOptions) -> tuple[str, float]:
    """(what the server must do, the time bound in seconds) for a hostile kind."""
    quick, head, body = opts.hostile_timeout_s, opts.header_timeout_s + opts.margin_s, \
        opts.body_timeout_s + opts.margin_s
    if name in dict(HOSTILE):
        return "400, error body", quick
    return {
        "no key": ("401, error body", quick),
        "wrong key": ("401, error body", quick),
        "rebinding Host": ("403, error body", quick),
        "look-alike Host": ("403, error body", quick),
        "oversized Content-Length": ("413, error body", quick),
        "oversized chunked body": (f"413, or closed, before all {opts.chunked_bytes // 2**20} MiB is sent", quick),
        "slow headers": ("closed (or 4xx), not before half the header timeout", head),
        "idle connection": ("closed (or 4xx), not before half the header timeout", head),
        "slow second head": ("200, then closed (or 4xx) on the half-sent second head", head),
        "not HTTP": ("closed, or 4xx", head),
        "huge header": ("431 or another 4xx, or closed", head),
        "slow body": ("408, or closed, not before half the body timeout", body),
        "stop reading mid-stream": ("200 and a first chunk; /health answers while stalled",
                                    opts.stall_timeout_s + 2 + quick),
        "disconnect mid-prefill": ("sent and dropped; nothing leaks (end checks)", quick),
    }.get(name) or ("500 or an error chunk naming the fault", opts.request_timeout_s)


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


def _auth(opts: SoakOptions) -> dict:
    return {"authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}


async def _send(client, path: str, body: dict | None, stream: bool, cancel_after: int | None = None,
                headers: dict | None = None) -> tuple[int, str, str | None]:
    """(HTTP status, the text, the finish reason) of one request; a stream's error chunk is
    (500, its error object as JSON, None)."""
    content = b"{not json" if body is None else json.dumps(body).encode()
    headers = {"content-type": "application/json", **(headers or {})}
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


# ---- hostile traffic --------------------------------------------------------------------

@dataclass
class _Target:
    """Where raw connections go, and what the hostile requests need beside the options."""
    host: str
    port: int
    client: object  # the soak's httpx.AsyncClient
    opts: SoakOptions
    long_prompt: str = "Hello"
    stall_max_tokens: int = 64
    seen: dict = field(default_factory=dict)  # hostile kind -> how many were sent (variants alternate)

    @classmethod
    def of(cls, base: str, client, opts: SoakOptions) -> "_Target":
        url = urlsplit(base)
        return cls(url.hostname or "127.0.0.1", url.port or 80, client, opts)

    @property
    def hostport(self) -> str:
        return f"{self.host}:{self.port}"


def _head(t: _Target, path: str = "/v1/chat/completions", *, key: bool = True, length: int | None = None,
          chunked: bool = False, method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {t.hostport}", "Content-Type: application/json"]
    if key and t.opts.api_key:
        lines.append(f"Authorization: Bearer {t.opts.api_key}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _connect(t: _Target, rcvbuf: int | None = None):
    """A raw connection (reader, writer); `rcvbuf`: a small receive buffer, so a client that
    stops reading is felt by the server soon."""
    if rcvbuf is None:
        return await asyncio.open_connection(t.host, t.port)
    sock = socket.socket(socket.AF_INET6 if ":" in t.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connect: it sets the window
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (t.host, t.port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock)


async def _close(writer, abort: bool = False) -> None:
    if abort:  # a reset, not a FIN: linger 0, then close without flushing
        with contextlib.suppress(OSError, AttributeError):
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()
    else:
        writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 2)


async def _reply(reader) -> tuple[int | None, bytes]:
    """(status, body) of one response; (None, b"") when the server closed without one."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise ValueError(f"a cut response head: {exc.partial[:120]!r}") from None
        return None, b""
    except (ConnectionResetError, BrokenPipeError):
        return None, b""
    first, *lines = head.decode("latin-1").split("\r\n")
    status = int(first.split(" ", 2)[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines if line)}
    body = b""
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                body += await reader.readexactly(size)
                await reader.readexactly(2)
    return status, body


def _refused(status: int | None, body: bytes, want: int) -> tuple[bool, str]:
    if status is None:
        return False, f"closed without the {want}"
    if status != want:
        return False, f"got {status}, not {want}: {body[:200]!r}"
    if b'"error"' not in body:
        return False, f"{status} without an OpenAI error body: {body[:200]!r}"
    return True, ""


async def _h_body(t: _Target, i: int, name: str, prompt: str) -> tuple[bool, int | None, str, str]:
    """(passed, HTTP status, what went wrong, a note) of the i-th hostile request of kind `name`."""
    status, text, _ = await _send(t.client, "/v1/chat/completions", dict(HOSTILE)[name], False,
                                  headers=_auth(t.opts))
    ok, why = _refused(status, text.encode(), 400)
    return ok, status, why, ""


async def _h_key(t: _Target, i: int, name: str, prompt: str):
    body = {"model": t.opts.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    headers = {} if name == "no key" else {"authorization": f"Bearer wrong-{t.opts.api_key}-{i}"}
    status, text, _ = await _send(t.client, "/v1/chat/completions", body, False, headers=headers)
    ok, why = _refused(status, text.encode(), 401)
    return ok, status, why, ""


async def _h_host(t: _Target, i: int, name: str, prompt: str):
    host = ("evil.example", f"evil.example:{t.port}")[i % 2] if name == "rebinding Host" else \
        ("localhost.evil.example", f"127.0.0.1.evil.example:{t.port}")[i % 2]
    body = {"model": t.opts.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    status, text, _ = await _send(t.client, "/v1/chat/completions", body, False,
                                  headers={**_auth(t.opts), "host": host})
    ok, why = _refused(status, text.encode(), 403)
    return ok, status, why and f"Host {host}: {why}", ""


async def _h_big_length(t: _Target, i: int, name: str, prompt: str):
    reader, writer = await _connect(t)
    try:
        writer.write(_head(t, length=t.opts.oversize_bytes) + b'{"messages": [')
        await writer.drain()
        status, body = await _reply(reader)
    finally:
        await _close(writer)
    ok, why = _refused(status, body, 413)
    return ok, status, why, ""


async def _h_big_chunked(t: _Target, i: int, name: str, prompt: str):
    reader, writer = await _connect(t)
    reply = asyncio.ensure_future(_reply(reader))
    sent, chunk, cut, total = 0, b" " * 2**16, False, t.opts.chunked_bytes
    try:
        writer.write(_head(t, chunked=True))
        while sent < total and not reply.done():
            writer.write(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            await writer.drain()
            sent += len(chunk)
            await asyncio.sleep(0)  # drain() does not yield while the socket takes all: let the reply in
        if not reply.done():
            writer.write(b"0\r\n\r\n")
            await writer.drain()
    except (ConnectionError, OSError):
        cut = True  # the server closed (or reset) while we were sending
    try:
        status, body = await reply
    except (ConnectionError, OSError, ValueError):
        status, body = None, b""
    finally:
        reply.cancel()
        await _close(writer)
    mib = f"{sent / 2**20:.0f} MiB sent"
    if sent <= MAX_BODY:  # we had not yet sent more than the bound: nothing to refuse
        return False, status, f"{'closed' if status is None else status} before the body passed 8 MiB", ""
    if status is None:
        ok = cut or sent < total
        return ok, None, "" if ok else f"read all {total // 2**20} MiB, then closed without a 413", \
            f"closed, {mib}"
    ok, why = _refused(status, body, 413)
    if ok and sent >= total:  # a body counted as it arrives is refused long before this
        ok, why = False, f"the 413 came only after all {total // 2**20} MiB was sent"
    return ok, status, why, f"413, {mib}" if ok else ""


async def _h_silent(t: _Target, i: int, name: str, prompt: str):
    """slow headers, idle connection, not HTTP: the server must close it (a 4xx is let pass)."""
    reader, writer = await _connect(t)
    t0 = time.perf_counter()
    try:
        if name == "slow headers":
            writer.write(_head(t)[:40])  # the request line and part of a header, no end
        elif name == "not HTTP":  # the start of a TLS ClientHello, sent to a plain-HTTP port
            writer.write(bytes.fromhex("16030100a5010000a10303") + os.urandom(32))
        await writer.drain()
        status, body = await _reply(reader)
    finally:
        await _close(writer)
    took = time.perf_counter() - t0
    if status is not None and not 400 <= status < 500:
        return False, status, f"got {status}: {body[:200]!r}", ""
    if name != "not HTTP" and took < t.opts.header_timeout_s / 2:
        return False, status, f"closed after {took:.2f} s, before half the header timeout", ""
    return True, status, "", "closed" if status is None else f"{status}"


async def _h_second_head(t: _Target, i: int, name: str, prompt: str):
    """A kept-alive connection whose first request is answered and whose second head never ends."""
    reader, writer = await _connect(t)
    try:
        writer.write(_head(t, "/health", method="GET"))
        await writer.drain()
        first, _ = await _reply(reader)
        if first != 200:
            return False, first, f"the first request (GET /health) got {first}", ""
        t0 = time.perf_counter()
        writer.write(_head(t)[:40])
        await writer.drain()
        status, body = await _reply(reader)
    finally:
        await _close(writer)
    took = time.perf_counter() - t0
    if status is not None and not 400 <= status < 500:
        return False, status, f"got {status}: {body[:200]!r}", ""
    if took < t.opts.header_timeout_s / 2:
        return False, status, f"closed after {took:.2f} s, before half the header timeout", ""
    return True, status, "", "closed" if status is None else f"{status}"


async def _h_huge_header(t: _Target, i: int, name: str, prompt: str):
    """A request head with one 1 MiB header."""
    reader, writer = await _connect(t)
    try:
        head = _head(t, "/health", method="GET")
        writer.write(head[:-2] + b"X-Filler: " + b"a" * 2**20 + b"\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        try:
            status, body = await _reply(reader)
        except (ConnectionError, OSError):
            status, body = None, b""
    finally:
        await _close(writer)
    if status is not None and not 400 <= status < 500:
        return False, status, f"got {status}: {body[:200]!r}", ""
    return True, status, "", "closed" if status is None else f"{status}"


async def _h_slow_body(t: _Target, i: int, name: str, prompt: str):
    reader, writer = await _connect(t)
    t0 = time.perf_counter()
    try:
        writer.write(_head(t, length=1000) + b'{"messages')  # 10 of the 1000 bytes promised
        await writer.drain()
        status, body = await _reply(reader)
    finally:
        await _close(writer)
    took = time.perf_counter() - t0
    if took < t.opts.body_timeout_s / 2:
        return False, status, f"answered {status} after {took:.2f} s, before half the body timeout", ""
    if status is None:
        return True, None, "", "closed"
    ok, why = _refused(status, body, 408)
    return ok, status, why, "408" if ok else ""


async def _h_stall(t: _Target, i: int, name: str, prompt: str):
    """A long stream read to its first chunk, then not read at all while /health must answer."""
    body = {"model": t.opts.model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "max_tokens": t.stall_max_tokens, "temperature": 0, "logprobs": True, "top_logprobs": 20}
    payload = json.dumps(body).encode()
    reader, writer = await _connect(t, rcvbuf=4096)
    try:
        writer.write(_head(t, length=len(payload)) + payload)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            return False, status, f"the stream got {status}: {head[:200]!r}", ""
        seen = b""
        while b"data: " not in seen:
            more = await reader.read(1024)
            if not more:
                return False, status, "closed before a first chunk", ""
            seen += more
        # stop reading: the server's writes fill our small window and its send buffer
        t_stall, health_s = time.perf_counter(), 0.0
        while time.perf_counter() - t_stall < t.opts.stall_timeout_s + 2:  # /health every second
            await asyncio.sleep(1.0)
            t0 = time.perf_counter()
            r = await t.client.get("/health", timeout=t.opts.hostile_timeout_s)
            health_s = max(health_s, time.perf_counter() - t0)
            if r.status_code != 200:
                return False, status, f"/health answered {r.status_code} while a stream stalled", ""
        # did the server give up on us? read what it had sent (for 3 s at most), up to its end
        note, until = "still streaming", time.perf_counter() + 3
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            while True:
                more = await asyncio.wait_for(reader.read(2**16), max(0.01, until - time.perf_counter()))
                if not more:
                    note = "closed by the server"
                    break
                if more.endswith(b"0\r\n\r\n"):
                    note = "finished into the socket buffers"
                    break
        return True, status, "", f"{note}; /health within {health_s:.1f} s"
    finally:
        await _close(writer)


async def _h_prefill(t: _Target, i: int, name: str, prompt: str):
    stream = i % 2 == 0
    body = {"model": t.opts.model, "messages": [{"role": "user", "content": f"{t.long_prompt} {i}"}],
            "max_tokens": t.opts.max_tokens, "temperature": 0, "stream": stream}
    payload = json.dumps(body).encode()
    reader, writer = await _connect(t)
    abort = i % 4 < 2
    try:
        writer.write(_head(t, length=len(payload)) + payload)
        await writer.drain()
        await asyncio.sleep(0.05 * (i % 3))  # gone as soon as sent, or just after it is admitted
    finally:
        await _close(writer, abort=abort)
    return True, None, "", ("reset" if abort else "closed") + (", streamed" if stream else "")


async def _h_fault(t: _Target, i: int, name: str, prompt: str):
    phase = name.removeprefix("fault in ")
    message = _fault_message(phase, dict(FAULTS)[phase])
    stream = i % 2 == 1
    path, body = _body("chat", f"{_marker(phase)} {prompt}", i, t.opts, stream)
    status, text, _ = await _send(t.client, path, body, stream, headers=_auth(t.opts))
    if status != 500:
        return False, status, f"got {status}, not 500 or an error chunk: {text[:200]}", ""
    if message not in text:
        return False, status, f"the error does not name the fault ({message!r}): {text[:200]}", ""
    # a stream's error chunk comes back as its error object; a whole 500 as {"error": ...}
    return True, status, "", "HTTP 500" if text.lstrip().startswith('{"error"') else "error chunk"


_HANDLERS = {**{what: _h_body for what, _ in HOSTILE}, "no key": _h_key, "wrong key": _h_key,
             "rebinding Host": _h_host, "look-alike Host": _h_host, "oversized Content-Length": _h_big_length,
             "oversized chunked body": _h_big_chunked, "slow headers": _h_silent, "idle connection": _h_silent,
             "slow second head": _h_second_head, "not HTTP": _h_silent, "huge header": _h_huge_header,
             "slow body": _h_slow_body, "stop reading mid-stream": _h_stall, "disconnect mid-prefill": _h_prefill,
             **{f"fault in {p}": _h_fault for p, _ in FAULTS}}
assert set(_HANDLERS) == set(HOSTILE_KINDS)


async def hostile(t: _Target, i: int, name: str, prompt: str) -> Outcome:
    """One hostile request of kind `name`, bounded by its time bound."""
    _, bound = expected(name, t.opts)
    n = t.seen[name] = t.seen.get(name, -1) + 1  # the handlers vary their request by n
    t0 = time.perf_counter()
    try:
        ok, status, why, note = await asyncio.wait_for(_HANDLERS[name](t, n, name, prompt), bound)
    except asyncio.TimeoutError:
        ok, status, why, note = False, None, f"no answer nor close within {bound:g} s", ""
    except Exception as exc:  # noqa: BLE001 -- counted as this request's failure
        ok, status, why, note = False, None, f"{type(exc).__name__}: {exc}"[:300], ""
    return Outcome(i, name, ok, time.perf_counter() - t0, status=status,
                   error="" if ok else f"{name}: {why}", note=note)


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
    return sorted(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else []


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


def wait_ready(proc, base: str, api_key: str | None, timeout_s: float) -> str:
    """Poll /v1/models (with the key) until the server answers; the served model's id."""
    import httpx

    deadline = time.monotonic() + timeout_s
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            models = httpx.get(f"{base}/v1/models", headers=headers, timeout=5)
            if models.status_code == 200:
                return models.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            pass  # not listening yet, or still loading
        time.sleep(0.5)
    raise RuntimeError(f"server not ready after {timeout_s:.0f} s")
