"""Pages one consumer rank reserved for a producer ahead of its pushes, as the producer keeps them.

A push of at most ``reserved_pages`` chunks writes into such pages without asking first, and its
notification says which chunk went where. The next reservation is asked for (``ask``) while a
write is in flight, and its answer read before the next push (``take``), so under steady traffic
small pushes pay no round trip at all. Reserved pages are used only while fresh; stale or replaced
ones are set aside, and given back (``give_back``) when a push finds the consumer's buffer full
before the consumer took them back itself.

Asks and answers share the peer's alloc socket with allocations and cancels: an answer still on
its way would be read as theirs, so ``settle`` reads it first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

from lmcache_pd import protocol
from lmcache_pd.errors import ProtocolError
from lmcache_pd.transfer.handshake import Peer
from lmcache_pd.transfer.sockets import receive, send

# Pages asked for at once, in pushes of ``reserved_pages`` chunks: one round trip (off the push's
# path, but still a send and a receive on its thread) per this many small pushes.
RESERVE_BATCH = 4


@dataclass(slots=True)
class Reserved:
    """Pages a consumer reserved for us ahead, not written yet, and when we asked for them: a
    write into them must end within ``RESERVED_WRITE_S`` of that."""

    reservation_id: int
    pages: list[int]
    asked_at: float


class Reservations:
    """The pages ``peer`` reserved for us: held, asked for, and set aside; used by the
    producer's owner thread only."""

    def __init__(self, peer: Peer, *, reserved_pages: int, alloc_timeout_s: float) -> None:
        """``reserved_pages``: the most chunks a push may write into reserved pages (0: none
        are asked for). ``alloc_timeout_s``: how long an answer that is due may be waited for."""
        self._peer = peer
        self._reserved_pages = reserved_pages
        self._alloc_timeout_s = alloc_timeout_s
        self._held: Reserved | None = None
        # When we asked for pages ahead whose answer we have not read yet.
        self._asked_at: float | None = None
        # Reservations no longer used (stale or replaced), and when asked: given back if a push
        # finds the buffer full before the consumer took them back itself.
        self._set_aside: list[tuple[int, float]] = []

    def take(self, req_id: str, count: int) -> Reserved | None:
        """``count`` pages reserved ahead for this push, or None: it asks first. Either way no
        answer to our ReserveRequest is left on its way (it would be read as the answer to the
        AllocRequest); asked for during the last write, it is here already, or nearly."""
        self._collect(req_id, wait=False)
        reserved = self._take(count)
        if reserved is None:
            self._collect(req_id, wait=True)
            reserved = self._take(count)
        return reserved

    def ask(self, req_id: str) -> None:
        """Ask the consumer for pages ahead, unless we hold enough or asked already; the answer
        is read before the next push (``take``, ``settle``), not waited for now."""
        want = self._reserved_pages
        held = self._held
        if (
            want == 0
            or self._asked_at is not None
            or (held is not None and len(held.pages) >= want)
        ):
            return
        pages = min(want * RESERVE_BATCH, protocol.MAX_RESERVED_PAGES)
        request = protocol.ReserveRequest(version=protocol.PROTOCOL_VERSION, pages=pages)
        send(self._peer.alloc_socket, request, req_id)
        self._asked_at = time.monotonic()

    def settle(self, req_id: str) -> None:
        """Read the answer to our ReserveRequest if one is due, by ``alloc_timeout_s``, so that
        the next reply on the socket is the next request's."""
        self._collect(req_id, wait=True)

    def give_back(self) -> list[int]:
        """Stop using every reservation we hold or set aside and the consumer has not taken back
        yet; their ids, for the caller to cancel."""
        self._put_aside()
        ids = [reservation_id for reservation_id, _ in self._set_aside]
        self._set_aside = []
        return ids

    def _take(self, count: int) -> Reserved | None:
        """``count`` pages reserved ahead, if we hold that many and asked for them within
        ``RESERVED_FRESH_S`` (and half the write budget). Under steady traffic each push asks
        for the next ones, so they are always that fresh."""
        reserved = self._held
        if reserved is None or count > min(len(reserved.pages), self._reserved_pages):
            return None  # a larger push asks first, and is told which chunks not to write
        if time.monotonic() - reserved.asked_at > min(
            protocol.RESERVED_FRESH_S, self._peer.write_budget_s / 2
        ):
            self._put_aside()  # unwritten, the consumer takes them back at their lease
            return None
        taken = Reserved(reserved.reservation_id, reserved.pages[:count], reserved.asked_at)
        reserved.pages = reserved.pages[count:]
        if not reserved.pages:
            self._held = None
        return taken

    def _collect(self, req_id: str, *, wait: bool) -> None:
        """Read the answer to our ReserveRequest if one is due: if it is here already, or, with
        ``wait``, by ``alloc_timeout_s`` (``PeerTimeout`` after that; the caller forgets the
        peer, so that a late answer is never read as another's). No pages (the consumer's
        buffer is full) only means that pushes ask first meanwhile."""
        asked_at = self._asked_at
        if asked_at is None:
            return
        socket = self._peer.alloc_socket
        if wait:
            deadline = time.monotonic() + self._alloc_timeout_s
            reply = receive(socket, "ReserveRequest", protocol.ALLOC_REPLIES, deadline, req_id)
        else:
            try:  # one call, no poll: this is on every small push's path
                reply = protocol.ALLOC_REPLIES.decode(socket.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
        self._asked_at = None
        if isinstance(reply, protocol.Reservation) and reply.agent_name == self._peer.name:
            self._peer.check_pages(req_id, reply.pages)
            self._put_aside()
            self._held = Reserved(reply.reservation_id, list(reply.pages), asked_at)
        elif not isinstance(reply, protocol.ErrorReply | protocol.Reservation):
            raise ProtocolError(f"req {req_id}: {type(reply).__name__} to a ReserveRequest")

    def _put_aside(self) -> None:
        """Stop using the reservation we hold (stale, or replaced by a newer one); its unwritten
        pages stay the consumer's until their lease or ``give_back``."""
        now = time.monotonic()
        kept = [
            (reservation_id, asked_at)
            for reservation_id, asked_at in self._set_aside
            if now - asked_at < protocol.RESERVED_LEASE_S  # else taken back already
        ]
        if self._held is not None:
            kept.append((self._held.reservation_id, self._held.asked_at))
            self._held = None
        self._set_aside = kept
