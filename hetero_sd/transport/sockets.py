"""Stream transports: loopback TCP (for comparison, and for draft and target on
different hosts one day) and multiprocessing.Pipe (the benchmark's baseline).

TCP frames are a 4-byte little-endian length then the record, written with one
sendall (TCP_NODELAY: a record leaves at once). A client proves it holds the
address (which carries a random token) before the server talks to it, so
another local user cannot hijack a listening worker port.
"""
from __future__ import annotations

import hmac
import secrets
import socket
import struct
import time

from hetero_sd.transport.base import Transport
from hetero_sd.transport.errors import PeerClosed, RecordTooLarge, TransportError, TransportTimeout

_LEN = struct.Struct("<I")
MAX_FRAME = 1 << 30
_TOKEN_BYTES = 16


def _recv_exact(sock: socket.socket, n: int, timeout: float | None) -> bytes:
    buf, got = bytearray(n), 0
    view = memoryview(buf)
    deadline = None if timeout is None else time.monotonic() + timeout
    if deadline is None:
        sock.settimeout(None)  # a previous zero-timeout poll left the socket non-blocking
    while got < n:
        if deadline is not None:
            sock.settimeout(max(deadline - time.monotonic(), 0.0))
        try:
            k = sock.recv_into(view[got:])
        except (socket.timeout, BlockingIOError):
            if got:  # part of a frame arrived: the stream is now out of step
                raise TransportError("timed out in the middle of a TCP frame; the channel "
                                     "is unusable") from None
            raise TransportTimeout(f"no record within {timeout:.3g} s") from None
        except OSError as exc:
            raise PeerClosed(f"TCP peer connection failed: {exc}") from None
        if k == 0:
            raise PeerClosed("the TCP peer closed the connection")
        got += k
    return bytes(buf)


class TcpTransport(Transport):
    """One end of a TCP channel. `listen()` gives the server end at once; it
    accepts its client on the first send/recv (or `accept()`)."""

    kind = "tcp"
    max_record = MAX_FRAME

    def __init__(self, sock: socket.socket | None, listener: socket.socket | None = None,
                 token: bytes = b"", address: str | None = None):
        self._sock, self._listener, self._token, self.address = sock, listener, token, address

    @classmethod
    def listen(cls, host: str = "127.0.0.1", port: int = 0) -> "TcpTransport":
        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lst.bind((host, port))
        lst.listen(1)
        token = secrets.token_bytes(_TOKEN_BYTES)
        h, p = lst.getsockname()[:2]
        return cls(None, lst, token, f"tcp://{h}:{p}/{token.hex()}")

    @classmethod
    def connect(cls, address: str, timeout: float | None = 10.0) -> "TcpTransport":
        try:
            hostport, token = address.removeprefix("tcp://").rsplit("/", 1)
            host, port = hostport.rsplit(":", 1)
            token_bytes = bytes.fromhex(token)
            sock = socket.create_connection((host, int(port)), timeout=timeout)
        except ValueError:
            raise TransportError(f"{address!r} is not tcp://HOST:PORT/TOKEN") from None
        except OSError as exc:
            raise PeerClosed(f"cannot connect to {address}: {exc}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(token_bytes)
        return cls(sock)

    def accept(self, timeout: float | None = None) -> None:
        if self._sock is not None:
            return
        if self._listener is None:
            raise PeerClosed("this end of the channel is closed")
        self._listener.settimeout(timeout)
        try:
            sock, _ = self._listener.accept()
        except (socket.timeout, BlockingIOError):
            raise TransportTimeout(f"no TCP client connected within {timeout:.3g} s") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        got = _recv_exact(sock, _TOKEN_BYTES, timeout)
        if not hmac.compare_digest(got, self._token):
            sock.close()
            raise TransportError("a TCP client connected without the channel's token")
        self._listener.close()
        self._listener, self._sock = None, sock

    def send(self, record: bytes, timeout: float | None = None) -> None:
        if len(record) > MAX_FRAME:
            raise RecordTooLarge(f"record of {len(record)} bytes exceeds the {MAX_FRAME}-byte frame limit")
        self.accept(timeout)
        self._sock.settimeout(timeout)
        try:
            self._sock.sendall(_LEN.pack(len(record)) + record)
        except socket.timeout:
            raise TransportTimeout(f"TCP send did not complete within {timeout:.3g} s") from None
        except OSError as exc:
            raise PeerClosed(f"TCP send failed: {exc}") from None

    def recv(self, timeout: float | None = None) -> bytes:
        self.accept(timeout)
        (n,) = _LEN.unpack(_recv_exact(self._sock, 4, timeout))
        if n > MAX_FRAME:
            raise TransportError(f"TCP frame header claims {n} bytes (limit {MAX_FRAME}): stream corrupt")
        return _recv_exact(self._sock, n, timeout) if n else b""

    def close(self) -> None:
        for s in (self._sock, self._listener):
            if s is not None:
                s.close()
        self._sock = self._listener = None


class PipeTransport(Transport):
    """One end of a multiprocessing.Pipe (a socketpair); its address is the
    other end's Connection, which multiprocessing passes to a child."""

    kind = "pipe"

    def __init__(self, conn, address=None):
        self._conn, self.address = conn, address

    @classmethod
    def listen(cls) -> "PipeTransport":
        import multiprocessing
        mine, theirs = multiprocessing.Pipe(duplex=True)
        return cls(mine, theirs)

    def send(self, record: bytes, timeout: float | None = None) -> None:
        try:
            self._conn.send_bytes(record)
        except (OSError, EOFError) as exc:
            raise PeerClosed(f"pipe send failed: {exc}") from None

    def recv(self, timeout: float | None = None) -> bytes:
        try:
            ready = timeout is None or self._conn.poll(timeout)
            if ready:
                return self._conn.recv_bytes()
        except (OSError, EOFError) as exc:
            raise PeerClosed(f"the pipe peer closed: {exc or 'end of file'}") from None
        raise TransportTimeout(f"no record within {timeout:.3g} s")

    def handed_over(self) -> None:
        # Our copy of the child's end must go, or we never see EOF when the child dies.
        if self.address is not None:
            self.address.close()
            self.address = None

    def close(self) -> None:
        # The peer's end (self.address) is left alone: in one process it is the
        # client's own Connection; across processes handed_over() closed our copy.
        if self._conn is not None:
            self._conn.close()
            self._conn = None
