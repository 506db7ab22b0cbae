"""What the server bounds, and who may reach it: the limits a hostile or broken client
meets before it can cost the server memory, threads or other tenants' data.

    limits = ServeLimits(header_timeout_s=10, body_timeout_s=30, stall_timeout_s=30)
    ServerState(engine, name, limits=limits, bind="127.0.0.1")

Every field has a `hetero-sd serve` flag of the same meaning (serve/cli.py); the
defaults are what a server on a workstation wants. `Connection` is the HTTP
protocol uvicorn runs with them: it closes a connection whose request head has
not arrived within header_timeout_s (a slowloris client), which uvicorn itself
never does. Bodies, Hosts and keys are checked by serve/guard.py.
"""
from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from hetero_sd.errors import HeteroSDError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class ServeLimits:
    max_body: int = 8 * 2**20  # bytes; a body is counted as it arrives (chunked or not), 413 past it
    header_timeout_s: float = 10.0  # a connection with no complete request head by then is closed
    body_timeout_s: float = 30.0  # a body not complete by then: 408
    keep_alive_s: float = 5.0  # an idle kept-alive connection is closed after this
    max_connections: int = 256  # open connections and requests; past it, 503
    stall_timeout_s: float = 30.0  # a stream whose client has read nothing for this long is cancelled
    request_timeout_s: float = 600.0  # a request's deadline; past it, it ends with finish_reason "timeout"
    max_schema_bytes: int = 64 * 2**10  # a response_format schema or tools list, as JSON
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted beside the loopback names ("*": any)

    def __post_init__(self):
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s", "stall_timeout_s",
                     "request_timeout_s"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise HeteroSDError(f"{name} must be a finite number of seconds > 0, got {value}")
        for name in ("max_body", "max_connections", "max_schema_bytes"):
            if getattr(self, name) < 1:
                raise HeteroSDError(f"{name} must be >= 1, got {getattr(self, name)}")


def is_loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """A Host header's name, lower-cased, without its port ("[::1]:8000" -> "::1")."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def connection_class(limits: ServeLimits):
    """uvicorn's h11 protocol, closing connections that send no complete request head in time."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Connection(H11Protocol):
        _head_timer = None

        def _awaiting_head(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(limits.header_timeout_s, self._head_timeout)

        def _head_timeout(self) -> None:
            self._head_timer = None
            # Still no complete head since the timer was armed: the client is too slow, or silent
            if self._awaiting_head() and not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._awaiting_head():  # (a kept-alive connection's next request starts its clock)
                self._arm()
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if not self._awaiting_head():  # the head arrived: the request's own timeouts apply
                self._disarm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

    return Connection
