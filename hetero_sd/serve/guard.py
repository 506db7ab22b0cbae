"""The ASGI middleware every HTTP request passes before any route runs:

1. the Host header (a loopback bind answers only to loopback names and
   --allowed-hosts, so a web page cannot drive it through DNS rebinding: 403);
2. the API key (every path but /health; 401), which also gives the request its
   key's priority cap and its tenant (the prefix cache keeps tenants apart);
3. the body, read here, counted as it arrives, chunked or not: past the cap 413,
   not complete within the body timeout 408. The route then reads it from memory.

Refusals are OpenAI's JSON error bodies and cost no more than the bytes read.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import time

from fastapi.responses import JSONResponse

from hetero_sd.serve import protocol as p
from hetero_sd.serve.limits import LOOPBACK_NAMES, ServeLimits, host_name, is_loopback


def error(status: int, message: str, kind: str = "invalid_request_error", headers: dict | None = None):
    return JSONResponse(p.error_body(message, status, kind), status_code=status, headers=headers)


def tenant_of(key: str) -> str:
    """A key's tenant name: a digest, so the key itself is kept nowhere but the key table."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class Guard:
    def __init__(self, app, api_keys: dict[str, float], limits: ServeLimits, bind: str = "127.0.0.1"):
        self.app, self.api_keys, self.limits = app, api_keys, limits
        names = set(limits.allowed_hosts)
        # Hosts are checked on loopback binds, and on any bind once --allowed-hosts names some
        self.hosts = None if "*" in names or not (is_loopback(bind) or names) else \
            names | set(LOOPBACK_NAMES) if is_loopback(bind) else names

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        refusal = self._refuse(scope, headers)
        if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
            body, refusal = await self._read_body(receive, headers)
            if refusal is None:
                receive = _replay(body, receive)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _refuse(self, scope, headers: dict):
        if self.hosts is not None:
            host = host_name(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.hosts:
                return error(403, f"the Host {host!r} is not served here (a loopback server answers to "
                                  "localhost and 127.0.0.1; widen it with --allowed-hosts)", "permission_error")
        state = scope.setdefault("state", {})
        state["tenant"] = ""
        if self.api_keys and scope["path"] != "/health":
            given = headers.get(b"authorization", b"").decode("latin-1").encode()
            # every key compared in constant time, so timing tells nothing about any of them
            matches = [key for key in self.api_keys if hmac.compare_digest(given, f"Bearer {key}".encode())]
            if not matches:
                return error(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                             "authentication_error", {"WWW-Authenticate": "Bearer"})
            state["key_priority"] = self.api_keys[matches[0]]
            state["tenant"] = tenant_of(matches[0])
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limits.max_body):
            return self._too_large()
        return None

    def _too_large(self):
        return error(413, f"the request body must be at most {self.limits.max_body} bytes")

    async def _read_body(self, receive, headers: dict):
        """(the whole body, None) or (None, the refusal), counting bytes as they arrive."""
        chunks, size = [], 0
        deadline = time.monotonic() + self.limits.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return None, error(408, f"the request body did not arrive within {self.limits.body_timeout_s:g} s")
            if message["type"] == "http.disconnect":
                return None, _gone
            size += len(message.get("body", b""))
            if size > self.limits.max_body:
                return None, self._too_large()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks), None


async def _gone(scope, receive, send):
    """A client that left while sending its body: nothing to answer."""


def _replay(body: bytes, receive):
    """The ASGI receive the route sees: the body read already, then the client's own
    messages (a disconnect), so the route still learns when its client leaves."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
