"""The consumer's alloc port: its answers to a producer's requests once hands are shaken.

An AllocRequest gets a page per chunk (None for a chunk already here) or an error reply that
says why not (buffer full, too large, request let go); a ReserveRequest gets pages ahead of any
push; an AllocCancel gives back pages that will not be written; a KVAbandoned lets a request go
(its KV will not come, or is not wanted). Every answer is counted. A producer is known by its
connection to the port (``ProducerId``): allocations and reservations count towards its share
of the buffer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from lmcache_pd import protocol
from lmcache_pd.errors import AllocationError, BufferFull, ProtocolError, RequestDropped
from lmcache_pd.protocol import ErrorCode
from lmcache_pd.transfer.chunk_store import ChunkStore
from lmcache_pd.transfer.consumer_stats import ConsumerStats
from lmcache_pd.transfer.producer_shares import ProducerId
from lmcache_pd.transfer.sockets import refusal

logger = logging.getLogger(__name__)

AllocPortRequest = (
    protocol.AllocRequest | protocol.ReserveRequest | protocol.AllocCancel | protocol.KVAbandoned
)


class AllocPort:
    """Answers allocation requests for one consumer rank; the consumer's service thread's own."""

    def __init__(
        self,
        *,
        agent_name: str,
        store: ChunkStore,
        stats: ConsumerStats,
        lock: threading.Lock,
        on_found_held: Callable[[], None],
    ) -> None:
        """``store`` and ``stats`` are used under ``lock``, as the consumer's other threads use
        them. ``on_found_held`` is called when an allocation finds chunks landed already (the
        landed board has news)."""
        self._agent_name = agent_name
        self._store = store
        self._stats = stats
        self._lock = lock
        self._on_found_held = on_found_held

    def answer(self, request: AllocPortRequest, producer: ProducerId) -> protocol.Message:
        """The reply to one decoded alloc-port request from ``producer``."""
        if isinstance(request, protocol.AllocCancel):
            return self._on_cancel(request)
        if isinstance(request, protocol.KVAbandoned):
            return self._on_abandoned(request)
        if isinstance(request, protocol.ReserveRequest):
            return self._on_reserve(request, producer)
        return self._on_allocate(request, producer)

    def _on_allocate(
        self, request: protocol.AllocRequest, producer: ProducerId
    ) -> protocol.Message:
        req_id = request.req_id
        stats = self._stats
        with self._lock:
            stats.alloc_requests += 1
            try:
                allocation = self._store.allocate(request, time.monotonic(), producer)
            except RequestDropped as exc:
                stats.refused_dropped += 1
                logger.info("req %s: push refused, the request was let go (%s)", req_id, exc.reason)
                return refusal(ErrorCode.DROPPED, str(exc), req_id)
            except BufferFull as exc:
                stats.refused_buffer_full += 1
                logger.warning("req %s: buffer full: %s", req_id, exc)
                return refusal(ErrorCode.BUFFER_FULL, str(exc), req_id, exc.retry_after_s)
            except AllocationError as exc:
                stats.refused_too_large += 1
                logger.warning("req %s: refused: %s", req_id, exc)
                return refusal(ErrorCode.TOO_LARGE, str(exc), req_id)
            except ProtocolError as exc:
                stats.malformed_messages += 1
                logger.warning("req %s: bad request: %s", req_id, exc)
                return refusal(ErrorCode.BAD_REQUEST, str(exc), req_id)
            stats.chunks_allocated += allocation.new_pages
            stats.chunks_already_held += len(allocation.pages) - allocation.new_pages
        if allocation.new_pages < len(allocation.pages):
            self._on_found_held()
        logger.debug(
            "req %s: alloc %d, %d chunks to write, %d already held",
            req_id,
            allocation.alloc_id,
            allocation.new_pages,
            len(allocation.pages) - allocation.new_pages,
        )
        return protocol.AllocResponse(
            version=protocol.PROTOCOL_VERSION,
            req_id=req_id,
            agent_name=self._agent_name,
            alloc_id=allocation.alloc_id,
            pages=allocation.pages,
        )

    def _on_reserve(
        self, request: protocol.ReserveRequest, producer: ProducerId
    ) -> protocol.Message:
        with self._lock:
            try:
                reservation_id, pages = self._store.reserve(
                    request.pages, time.monotonic(), producer
                )
            except BufferFull as exc:
                # Not an error of anyone's: the producer asks for pages per push meanwhile.
                logger.debug("no pages to reserve ahead: %s", exc)
                return refusal(ErrorCode.BUFFER_FULL, str(exc), "", exc.retry_after_s)
            self._stats.pages_reserved += len(pages)
        return protocol.Reservation(
            version=protocol.PROTOCOL_VERSION,
            agent_name=self._agent_name,
            reservation_id=reservation_id,
            pages=pages,
        )

    def _on_cancel(self, cancel: protocol.AllocCancel) -> protocol.CancelAck:
        with self._lock:
            known = self._store.cancel(cancel)
            self._stats.allocations_cancelled += known
        logger.info(
            "req %s: producer cancelled alloc %d (%s)",
            cancel.req_id,
            cancel.alloc_id,
            "pages released" if known else "nothing pending",
        )
        return protocol.CancelAck(
            version=protocol.PROTOCOL_VERSION,
            req_id=cancel.req_id,
            alloc_id=cancel.alloc_id,
            known=known,
        )

    def _on_abandoned(self, abandoned: protocol.KVAbandoned) -> protocol.AbandonAck:
        """The request's KV will not come, or is not wanted: free what it holds, fail its load
        at the next step, refuse its later pushes."""
        req_id = abandoned.req_id
        with self._lock:
            known = self._store.knows(req_id)
            if not abandoned.write_in_flight:
                self._store.cancel_writes_of(req_id)
            self._store.release(req_id, time.monotonic(), abandoned.reason.value)
            self._stats.requests_abandoned += 1
        logger.warning(
            "req %s: KV abandoned (%s%s)%s",
            req_id,
            abandoned.reason.value,
            f": {abandoned.detail}" if abandoned.detail else "",
            "; its pages are freed" if known else "",
        )
        return protocol.AbandonAck(version=protocol.PROTOCOL_VERSION, req_id=req_id, known=known)
