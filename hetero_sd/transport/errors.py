"""Errors a transport raises; all are HeteroSDError, so the engine can catch one family."""
from __future__ import annotations

from hetero_sd.ir.errors import HeteroSDError


class TransportError(HeteroSDError):
    """A channel could not be created, attached or used as asked."""


class TransportTimeout(TransportError, TimeoutError):
    """A send or receive did not complete within its timeout: the peer may be hung."""


class PeerClosed(TransportError, ConnectionError):
    """The other end closed the channel or its process died."""


class CorruptRecord(TransportError):
    """A record failed validation (stale sequence number, bad length or checksum)."""


class RecordTooLarge(TransportError):
    """A record does not fit in the channel, whose size was fixed when it was created."""
