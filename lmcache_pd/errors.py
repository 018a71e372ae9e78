"""The error tree of lmcache-pd, grouped by what the caller can do about each failure.

Lower layers (NIXL, ZMQ, msgspec) raise their own exceptions; the module that touches them maps
those to one of these at the boundary, so callers only ever catch ``PDError`` subclasses.
"""

from __future__ import annotations


class PDError(Exception):
    """Base of every error lmcache-pd raises on purpose."""


class ConfigError(PDError):
    """A configuration file, environment override or constructor argument is invalid."""


class ProtocolError(PDError):
    """A message on one of our sockets is malformed, of the wrong version, or out of bounds."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version; nothing in the body was trusted."""


class PeerTimeout(PDError):
    """A peer did not answer, or a transfer did not finish, before its deadline."""


class PeerUnreachable(PeerTimeout):
    """The consumer did not answer its handshake: down, stopped, or cut off from us."""


class WriteTimeout(PeerTimeout):
    """A write was not done by its deadline: it may still land, so its pages wait their lease."""


class PeerRestarted(PDError):
    """The consumer answering on a known address is a new process: our handshake is stale."""


class PeerError(PDError):
    """A peer answered with an error reply; ``code`` says which kind."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


class AllocationError(PDError):
    """The consumer cannot hold this request at all (larger than its buffer, too many chunks)."""


class BufferFull(AllocationError):
    """The consumer's buffer is full right now; retrying after ``retry_after_s`` may succeed."""

    def __init__(self, detail: str, retry_after_s: float) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class RequestDropped(AllocationError):
    """The consumer let this request go (released, lapsed or abandoned): its KV is not wanted."""

    def __init__(self, detail: str, reason: str) -> None:
        super().__init__(detail)
        self.reason = reason


class TransferError(PDError):
    """A NIXL transfer failed (remote disconnected, backend error) or could not be posted."""


class IntegrityError(PDError):
    """A landed chunk's bytes do not match the checksum its producer sent with it."""


class Incompatible(PDError):
    """The two sides' KV formats or layouts differ (the message names the field and both
    values): the handshake is refused and their requests are recomputed."""


class TransportUnusable(TransferError):
    """No transport tried with a consumer passed the handshake's self-test (the message names
    the peer and every transport tried)."""
