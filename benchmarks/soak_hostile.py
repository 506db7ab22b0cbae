"""The soak's hostile traffic (benchmarks/soak.py runs it; what each kind must get and its
time bound are `soak_kinds.expected`): `hostile(t, i, name, prompt)` sends one request of
a hostile kind to the `_Target` `t` and checks how it ends, each kind by its handler
(`_HANDLERS`), most over a raw socket:
- ten malformed or invalid bodies (HOSTILE): 400 with an OpenAI error body;
- no key, a wrong key: 401; a rebinding Host (evil.example) or a look-alike one
  (localhost.evil.example): 403;
- a Content-Length past 8 MiB: 413; a chunked body sent up to 32 MiB: 413, or the
  connection closed, once past 8 MiB and before all of it is sent (the client stops
  sending once refused);
- slow headers (half a request head, then nothing), an idle connection (nothing at all),
  a slow second head (a kept-alive connection's second request head half sent), not
  HTTP (a TLS ClientHello), a huge header (1 MiB): closed (or a 4xx) within
  --header-timeout + margin, and not before half of it for the slow ones;
- a slow body (Content-Length 1000, 10 bytes sent): 408, or closed, within
  --body-timeout + margin;
- a client that stops reading mid-stream (a small receive buffer, a long stream with
  top_logprobs 20): the head and a first chunk arrive, then it reads nothing for
  --stall-timeout + 2 s while /health must still answer; whether the server closed the
  stalled stream is noted (not checked: the kernel's socket buffers, up to tcp_wmem's
  4 MiB on the server's side, can hold a whole short stream, so no stall is felt);
- a client that disconnects mid-prefill (a long prompt, closed, or reset, at once);
- an injected failure (--fault-plan, written by `soak.server_args`) in each batch-engine
  phase (admit, prefill, propose, score, accept), its marker in the prompt: HTTP 500
  whose error names the rule's message, or a stream's error chunk naming it.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from soak_kinds import (FAULTS, HOSTILE, HOSTILE_KINDS, MAX_BODY, Outcome, SoakOptions, _auth, _body,
                        _fault_message, _marker, _send, expected)


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
    return _head_refused(t, status, body, time.perf_counter() - t0, timed=name != "not HTTP")


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
    return _head_refused(t, status, body, time.perf_counter() - t0)


def _head_refused(t: _Target, status: int | None, body: bytes, took: float, timed: bool = True):
    """A head that never completes: closed (or a 4xx), and not before half the header timeout."""
    if status is not None and not 400 <= status < 500:
        return False, status, f"got {status}: {body[:200]!r}", ""
    if timed and took < t.opts.header_timeout_s / 2:
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
