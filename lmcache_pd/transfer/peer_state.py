"""One consumer rank as a producer keeps it after the handshake: the peer, the pages it reserved
for us ahead, and what a push does with it: ask for pages, allocate, write, cancel.

One request is out on the alloc socket at a time, each reply read before the next request is
sent, by a deadline; a reservation asked for during a write is read before any other request.
An AllocRequest may be sent before the chunks are copied into staging (``ask_pages``), its
answer read once they are (``allocate``), or, if they never are, read and given back
(``withdraw``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

from lmcache_pd import protocol
from lmcache_pd.auth import seal
from lmcache_pd.config import PDConfig
from lmcache_pd.errors import BufferFull, PDError, PeerRestarted, ProtocolError, TransferError
from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.transfer.channel import wait_for_transfer
from lmcache_pd.transfer.handshake import Peer
from lmcache_pd.transfer.reservations import Reservations
from lmcache_pd.transfer.sockets import ask, error_from_reply, receive, send

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Write:
    """One WRITE: the consumer's pages, the chunks' sizes and staged addresses (one each), the
    notification that says they landed, and the allocation to cancel if it fails (None for
    reserved pages)."""

    pages: list[int]
    sizes: list[int]
    addresses: list[int]
    done: protocol.Message
    alloc_id: int | None


@dataclass(frozen=True, slots=True)
class Asked:
    """An AllocRequest sent, its answer not read yet, and by when pages must be granted."""

    request: protocol.AllocRequest
    deadline: float


class PeerState:
    """A consumer rank we shook hands with; used by the producer's owner thread only."""

    def __init__(self, peer: Peer, config: PDConfig) -> None:
        self.peer = peer
        self.reservations = Reservations(
            peer, reserved_pages=config.reserved_pages, alloc_timeout_s=config.alloc_timeout_s
        )
        self._alloc_timeout_s = config.alloc_timeout_s
        self._max_alloc_retries = config.max_alloc_retries

    def ask_pages(self, spec: DisaggSpec, specs: list[protocol.ChunkSpec]) -> Asked:
        """Send the AllocRequest for ``specs`` now; its answer is read by ``allocate`` (or
        ``withdraw``) before anything else is sent on the alloc socket."""
        request = protocol.AllocRequest(
            version=protocol.PROTOCOL_VERSION, req_id=spec.req_id, chunks=specs
        )
        asked = Asked(request, time.monotonic() + self._alloc_timeout_s)
        send(self.peer.alloc_socket, request, spec.req_id)
        return asked

    def allocate(self, spec: DisaggSpec, asked: Asked) -> protocol.AllocResponse:
        """The pages ``asked`` for, asking again for a full buffer up to ``max_alloc_retries``
        times, all by the deadline set when it was sent."""
        socket, request, deadline = self.peer.alloc_socket, asked.request, asked.deadline
        for attempt in range(self._max_alloc_retries + 1):
            if attempt:
                send(socket, request, spec.req_id)
            reply = receive(socket, "AllocRequest", protocol.ALLOC_REPLIES, deadline, spec.req_id)
            if isinstance(reply, protocol.AllocResponse):
                self._check_allocation(spec, reply, len(request.chunks))
                return reply
            error = error_from_reply(spec.req_id, reply)
            wait_s = reply.retry_after_s
            if isinstance(error, BufferFull) and self.give_back_reserved(spec):
                wait_s = 0.0  # our own reserved pages made room: ask again at once
            if (
                not isinstance(error, BufferFull)
                or attempt == self._max_alloc_retries
                or time.monotonic() + wait_s >= deadline
            ):
                raise error
            logger.info("req %s: consumer buffer full, retry in %.3f s", spec.req_id, wait_s)
            time.sleep(wait_s)
        raise AssertionError("unreachable: the last attempt raises")

    def withdraw(self, spec: DisaggSpec, asked: Asked) -> None:
        """Nothing will be written for ``asked`` (its chunks could not be copied): read its
        answer and give back any pages it brought. ``PeerTimeout`` if none comes by its
        deadline: the caller forgets the peer, so that a late answer is never read as
        another's."""
        reply = receive(
            self.peer.alloc_socket,
            "AllocRequest",
            protocol.ALLOC_REPLIES,
            asked.deadline,
            spec.req_id,
        )
        if isinstance(reply, protocol.AllocResponse) and reply.agent_name == self.peer.name:
            self.cancel(spec, reply.alloc_id)

    def write(self, spec: DisaggSpec, write: Write, deadline: float) -> None:
        """One WRITE of ``write``'s chunks with its notification, done by ``deadline`` (a
        ``time.monotonic()`` value); pages for the next small push are asked for meanwhile."""
        peer = self.peer
        base, page_bytes = peer.buffer.base_addr, peer.page_bytes
        segments = [
            (address, base + page * page_bytes, size)
            for address, page, size in zip(write.addresses, write.pages, write.sizes, strict=True)
        ]
        notif = seal(peer.keys, protocol.encode(write.done))
        try:
            handle = peer.channel.post_write(peer.name, segments, peer.buffer, notif)
        except TransferError as exc:
            self.cancel(spec, write.alloc_id)
            raise TransferError(f"req {spec.req_id}: {exc}") from exc
        self.reservations.ask(spec.req_id)
        try:
            wait_for_transfer(peer.channel, handle, deadline, f"req {spec.req_id} to {peer.name}")
        except TransferError as exc:
            # A failed write that NIXL let us release writes no more: its pages can go back
            # now. A timed-out one might still land, so its pages wait for their lease.
            if peer.channel.release(handle):
                self.cancel(spec, write.alloc_id)
            raise TransferError(f"req {spec.req_id}: {exc}") from exc
        except BaseException:
            peer.channel.release(handle)
            raise
        peer.channel.release(handle)

    def give_back_reserved(self, spec: DisaggSpec) -> bool:
        """Give back every reservation of this consumer we hold or set aside and it has not
        taken back yet (an AllocCancel each: we write nothing into them, having one thread),
        for a push that found its buffer full; True if there were any."""
        ids = self.reservations.give_back()
        if ids:
            logger.info("req %s: buffer full, giving back %d reservations", spec.req_id, len(ids))
        for reservation_id in ids:
            self.cancel(spec, reservation_id)
        return bool(ids)

    def cancel(self, spec: DisaggSpec, alloc_id: int | None) -> None:
        """Best effort: tell the consumer that ``alloc_id`` will not be written (None: reserved
        pages, which lapse with their lease)."""
        if alloc_id is None:
            return
        with contextlib.suppress(PDError):  # the socket must hold no answer due to another ask
            self.reservations.settle(spec.req_id)
        cancel = protocol.AllocCancel(
            version=protocol.PROTOCOL_VERSION, req_id=spec.req_id, alloc_id=alloc_id
        )
        deadline = time.monotonic() + protocol.CANCEL_TIMEOUT_S
        try:
            ask(self.peer.alloc_socket, cancel, protocol.ALLOC_REPLIES, deadline, spec.req_id)
        except PDError as exc:
            logger.warning("req %s: could not cancel alloc %d: %s", spec.req_id, alloc_id, exc)

    def close(self) -> None:
        """Close the alloc socket and drop the NIXL peer (best effort)."""
        self.peer.alloc_socket.close(linger=0)
        with contextlib.suppress(PDError):
            self.peer.channel.remove_peer(self.peer.name)

    def _check_allocation(
        self, spec: DisaggSpec, reply: protocol.AllocResponse, count: int
    ) -> None:
        """Never write where the consumer's own buffer does not reach."""
        if reply.req_id != spec.req_id or len(reply.pages) != count:
            raise ProtocolError(f"req {spec.req_id}: AllocResponse does not match the request")
        if reply.agent_name != self.peer.name:
            # Those pages are the new consumer's: give them back, we will ask again.
            self.cancel(spec, reply.alloc_id)
            raise PeerRestarted(
                f"req {spec.req_id}: the consumer at {spec.receiver_host}:"
                f"{spec.receiver_alloc_port} is now {reply.agent_name}, not {self.peer.name}"
            )
        self.peer.check_pages(spec.req_id, reply.pages)
