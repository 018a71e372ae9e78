"""The consumer's bookkeeping: the one owner of its parts, and the only code that joins them.

Pure state over a ``PageAllocator``: no sockets, no NIXL, no threads (the consumer serialises
calls under its lock, so no part takes a lock of its own). A page's references are its
allocation's lease (until the write is confirmed) plus one per request that holds it, plus the
cache's once it landed (``cache_pages`` > 0). A chunk that turns out to be here already, or not
needed, or of a request let go, gives its page straight back.

The parts, one job each: what each page holds and the pages of each key (``page_table.py``),
the holds per request and their deadlines (``holds.py``), the writes allocations wait for
(``pending_writes.py``), the requests let go (``dropped_requests.py``), the landed chunks kept
for reuse (``landed_cache.py``), the pages reserved ahead for producers
(``reserved_pages.py``), and the pages each producer holds room with (``producer_shares.py``).

Whatever a peer sends, the state stays bounded: pages by the buffer, holds by
``max_held_requests``, requests let go by ``max_dropped_requests``, one producer's pages by its
share while another waits. Allocation and reservation ids are 63 random bits, so no peer can
name another's.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lmcache_pd.errors import AllocationError, BufferFull, ProtocolError, RequestDropped
from lmcache_pd.protocol import (
    BUFFER_FULL_RETRY_AFTER_S,
    DROPPED_MEMORY_S,
    MAX_BOARD_ENTRIES,
    MAX_DROPPED_REQUESTS,
    MAX_HELD_REQUESTS,
    MAX_PRODUCER_SHARE,
    AllocCancel,
    AllocRequest,
    ReservedWriteDone,
    WriteDone,
)
from lmcache_pd.transfer.allocator import PageAllocator, PageState
from lmcache_pd.transfer.consumer_stats import CacheCounts, LimitCounts
from lmcache_pd.transfer.dropped_requests import DroppedRequests
from lmcache_pd.transfer.holds import Hold, Holds
from lmcache_pd.transfer.landed_cache import LandedCache
from lmcache_pd.transfer.page_table import PageInfo, PageTable
from lmcache_pd.transfer.pending_writes import PendingWrite, PendingWrites
from lmcache_pd.transfer.producer_shares import ONE_PRODUCER, ProducerId, ProducerShares
from lmcache_pd.transfer.receive_buffer import LandedChunk
from lmcache_pd.transfer.reserved_pages import ReservedPages

# At most this share of the pages is reserved ahead for producers at once.
RESERVE_SHARE = 0.125

# Why a request was let go when nobody said otherwise.
RELEASED = "released"
HOLD_LAPSED = "hold_lapsed"


@dataclass(frozen=True, slots=True)
class Allocation:
    """The answer to one AllocRequest: a page per chunk, None where the chunk is already held."""

    alloc_id: int
    pages: list[int | None]

    @property
    def new_pages(self) -> int:
        return sum(page is not None for page in self.pages)


class ChunkStore:
    """Keys, pages, holds, pending writes, let-go requests and cached chunks of one consumer
    rank."""

    def __init__(
        self,
        allocator: PageAllocator,
        *,
        claim_s: float,
        hold_s: float,
        dropped_memory_s: float = DROPPED_MEMORY_S,
        cache_pages: int = 0,
        reserve_share: float = RESERVE_SHARE,
        max_producer_share: float = MAX_PRODUCER_SHARE,
        max_held_requests: int = MAX_HELD_REQUESTS,
        max_dropped_requests: int = MAX_DROPPED_REQUESTS,
    ) -> None:
        self._holds = Holds(claim_s=claim_s, hold_s=hold_s)
        self._max_held_requests = max_held_requests
        self.cache_counts = CacheCounts()
        self.limit_counts = LimitCounts()
        self._cache = LandedCache(allocator, cache_pages, self.cache_counts)
        self._allocator = allocator
        self._pages = PageTable(allocator)
        self._pending = PendingWrites()
        self._dropped = DroppedRequests(dropped_memory_s, self.limit_counts, max_dropped_requests)
        self._reserved = ReservedPages(allocator, reserve_share)
        self._shares = ProducerShares(allocator.num_pages, max_producer_share, self.limit_counts)
        # Bumped when a chunk lands or a page is freed: what ``landed_keys`` says may differ.
        self.keys_version = 0

    @property
    def used_pages(self) -> int:
        """Pages held by a request or waiting for a write (idle cached ones and those reserved
        ahead are not)."""
        return self._allocator.used_pages - len(self._cache.idle) - self._reserved.page_count

    def landed_keys(self) -> list[bytes]:
        """The keys of the chunks landed here and not freed, held or kept by the cache: what
        a producer pushing them would be told is here already."""
        return [key for key in self._pages.pages_of_key if self._pages.live_page(key) is not None]

    @property
    def cached_pages(self) -> int:
        """Landed pages nobody holds, kept for a later request that shares their chunk."""
        return len(self._cache.idle)

    @property
    def reserved_pages(self) -> int:
        """Pages reserved ahead for producers and not written yet."""
        return self._reserved.page_count

    def expecting_writes(self, now: float) -> bool:
        """Whether a write's notification may come soon: an allocation waits for one, or pages
        were reserved ahead within ``RESERVED_FRESH_S`` (a producer writes into them only that
        soon)."""
        return bool(self._pending) or self._reserved.fresh(now)

    @property
    def pending_writes(self) -> int:
        return len(self._pending)

    @property
    def held_requests(self) -> int:
        return len(self._holds)

    @property
    def dropped_requests(self) -> int:
        """Requests let go and remembered, to refuse their late pushes."""
        return len(self._dropped)

    def allocate(
        self, request: AllocRequest, now: float, producer: ProducerId = ONE_PRODUCER
    ) -> Allocation:
        """Room for every chunk of ``request`` that has not landed here, all or nothing, for
        ``producer`` (whose share of the buffer it counts towards until a decode claims it).

        A chunk still being written for another request gets a page of its own: sharing it
        would tie this request to a write that may fail.

        Raises ``RequestDropped`` for a request already let go, ``AllocationError``
        (``BufferFull`` if only for now: no room, too many requests held, or ``producer`` over
        its share while another waits; a chunk larger than a page) or ``ProtocolError`` for a
        request that makes no sense (a key twice).
        """
        reason = self._dropped.get(request.req_id)
        if reason is not None:
            raise RequestDropped(f"req {request.req_id} was let go here ({reason})", reason)
        page_bytes = self._allocator.page_bytes
        keys = [chunk.key for chunk in request.chunks]
        if len(set(keys)) != len(keys):
            raise ProtocolError("the same chunk key appears twice in one request")
        for index, chunk in enumerate(request.chunks):
            if chunk.nbytes > page_bytes:
                raise AllocationError(
                    f"chunk {index} has {chunk.nbytes} bytes, a page holds {page_bytes}"
                )
        skip = self._holds.not_needed(request.req_id)
        held = [self._pages.live_page(key) for key in keys]
        needed = sum(page is None and key not in skip for page, key in zip(held, keys, strict=True))
        self._check_holds(request.req_id)
        if needed <= self._allocator.num_pages:  # else refused as too large, whoever asks
            self._shares.check(producer, self._pages_held_by(producer), needed, now)
        self._forget_all(self._cache.make_room(needed, {page for page in held if page is not None}))
        try:
            fresh = iter(self._allocator.allocate(needed, now))
        except BufferFull:
            self._shares.refused_for_room(producer, now)
            raise
        self._shares.served(producer)
        alloc_id = self._new_id()
        hold = self._holds.hold(request.req_id, now, producer)
        pages: list[int | None] = []
        written: list[int] = []
        for chunk, live in zip(request.chunks, held, strict=True):
            if chunk.key in skip:
                pages.append(None)  # written for nobody: "already held" to the producer
                self.cache_counts.not_needed += 1
                continue
            if live is None:
                page = next(fresh)
                info = PageInfo(chunk.key, chunk.nbytes, alloc_id, producer)
                info.pushed_for = request.req_id
                self._pages.add(page, info)
                written.append(page)
                pages.append(page)
            else:
                page = live
                pages.append(None)
                self.cache_counts.hits += 1
                self.cache_counts.bytes_not_resent += self._pages[page].nbytes
            self._add_holder(hold, request.req_id, page)
        self.cache_counts.misses += needed
        if written:
            self._pending.add(alloc_id, PendingWrite(request.req_id, tuple(written)))
        return Allocation(alloc_id, pages)

    def confirm(self, done: WriteDone) -> tuple[int, int]:
        """The write of ``done.alloc_id`` landed; returns the chunks and bytes it brought.

        Raises ``ProtocolError`` for an allocation that is unknown (its lease ran out, or it never
        existed) or a checksum list of the wrong length.
        """
        pending = self._pending.of(done.alloc_id, done.req_id)
        if pending is None:
            raise ProtocolError(
                f"req {done.req_id}: no pending write {done.alloc_id} (lease expired or unknown)"
            )
        if done.checksums is not None and len(done.checksums) != len(pending.pages):
            raise ProtocolError(
                f"req {done.req_id}: {len(done.checksums)} checksums for "
                f"{len(pending.pages)} chunks"
            )
        self._pending.take(done.alloc_id)
        nbytes = 0
        for index, page in enumerate(pending.pages):
            nbytes += self._land(page, None if done.checksums is None else done.checksums[index])
        return len(pending.pages), nbytes

    def reserve(
        self, count: int, now: float, producer: ProducerId = ONE_PRODUCER
    ) -> tuple[int, list[int]]:
        """Up to ``count`` pages tied to no chunk, for ``producer`` to write later pushes into
        at once (taken back after ``RESERVED_LEASE_S`` unless written); returns (reservation
        id, pages). Fewer when more would take over ``reserve_share`` of the buffer (many
        producers may not starve allocations); ``BufferFull`` when none can be had, or
        ``producer`` is over its share while another waits."""
        count = self._reserved.room_for(count)
        self._shares.check(producer, self._pages_held_by(producer), count, now)
        self._forget_all(self._cache.make_room(count, set()))
        pages = self._allocator.allocate(count, now)
        self._shares.served(producer)
        reservation_id = self._new_id()
        self._reserved.add(reservation_id, pages, now, producer)
        return reservation_id, pages

    def land_reserved(self, done: ReservedWriteDone, now: float) -> tuple[int, int]:
        """Chunks of ``done.req_id`` landed in reserved pages: each becomes its key's page,
        held for the request, as if allocated and confirmed; returns the chunks and bytes that
        landed. A chunk already here is held where it is, and one decode does not need or of a
        request let go is not kept: their pages go back at once.

        Raises ``ProtocolError`` for pages not (or no longer) in that reservation, keys or pages
        twice, or lists of different lengths.
        """
        reserved = self._reserved.get(done.reservation_id, set())
        keys = [chunk.key for chunk in done.chunks]
        if (
            not done.pages
            or len(done.pages) != len(keys)
            or (done.checksums is not None and len(done.checksums) != len(keys))
            or len(set(keys)) != len(keys)
            or len(set(done.pages)) != len(done.pages)
            or not reserved.issuperset(done.pages)
        ):
            raise ProtocolError(
                f"req {done.req_id}: ReservedWriteDone does not match reservation "
                f"{done.reservation_id} (lease expired, or pages, keys and checksums differ)"
            )
        producer = self._reserved.producer_of[done.reservation_id]
        for page in done.pages:
            self._reserved.leave(page)
        dropped = done.req_id in self._dropped
        skip = self._holds.not_needed(done.req_id)
        hold = None if dropped else self._holds.hold(done.req_id, now, producer)
        kept = nbytes = 0
        for index, (chunk, page) in enumerate(zip(done.chunks, done.pages, strict=True)):
            live = self._pages.live_page(chunk.key)
            if hold is not None and live is not None and chunk.key not in skip:
                self._add_holder(hold, done.req_id, live)
            nbytes += chunk.nbytes
            if dropped or live is not None or chunk.key in skip:
                self._allocator.free(page)
                continue
            info = PageInfo(chunk.key, chunk.nbytes, done.reservation_id, producer)
            info.pushed_for = done.req_id
            self._pages.add(page, info)
            assert hold is not None
            self._add_holder(hold, done.req_id, page)
            self._land(page, None if done.checksums is None else done.checksums[index])
            kept += 1
        self.cache_counts.misses += kept
        return len(done.chunks), nbytes

    def _land(self, page: int, checksum: int | None) -> int:
        """The write into leased ``page`` landed: its lease's reference goes to the cache (or
        away); returns the chunk's bytes."""
        info = self._pages[page]
        info.checksum = checksum
        self.keys_version += 1
        if self._cache.enabled and not info.uncached:
            self._forget_all(self._cache.keep(page, held=bool(info.holders)))
        else:
            # With the cache on, its request let go of it already, asking to keep nothing.
            self.cache_counts.not_kept += self._cache.enabled
            if self._allocator.confirm(page):
                self._forget(page)
                return info.nbytes
        self._recount(page)
        return info.nbytes

    def cancel(self, cancel: AllocCancel) -> bool:
        """The write of ``cancel.alloc_id`` will never come: its pages are freed at once and
        their keys may be sent again; or, for a reservation, its unwritten pages go back. False
        if nothing was pending."""
        if cancel.alloc_id in self._reserved:
            self._reserved.give_back(cancel.alloc_id)
            return True
        if self._pending.of(cancel.alloc_id, cancel.req_id) is None:
            return False
        self._cancel(cancel.alloc_id)
        return True

    def cancel_writes_of(self, req_id: str) -> int:
        """Every pending write of ``req_id`` will never come (its producer says none is in
        flight): free their pages now. Returns how many allocations that was."""
        ids = self._pending.ids_of(req_id)
        for alloc_id in ids:
            self._cancel(alloc_id)
        return len(ids)

    def _cancel(self, alloc_id: int) -> None:
        pending = self._pending.take(alloc_id)
        for page in pending.pages:
            self._pages.unkey(page)
            # Nobody else can hold it: only landed pages are shared.
            for holder in self._pages[page].holders:
                self._holds[holder].pages.discard(page)
            self._pages[page].holders.clear()
            self._allocator.free(page)
            self._forget(page)

    def unclaimed_landed(self) -> dict[str, int]:
        """Per request no decode has claimed yet, how many of the chunks it holds have landed,
        if any: once that is all of its prompt's, its decode can load it before its first step.
        At most ``MAX_BOARD_ENTRIES`` requests, those held longest first (decode schedules
        requests in the order they came); the others read as nothing landed yet."""
        landed: dict[str, int] = {}
        for req_id, hold in self._holds.unclaimed():
            count = sum(self._allocator.state(page) is PageState.LIVE for page in hold.pages)
            if count:
                landed[req_id] = count
                if len(landed) == MAX_BOARD_ENTRIES:
                    break
        return landed

    def landed(self, key: bytes, holder: str | None = None) -> LandedChunk | None:
        """The chunk with ``key`` if a write of it was confirmed, else None. With ``holder``,
        only a page that request holds: a load must read bytes whose page cannot be freed and
        rewritten for another request while it reads them."""
        hold = None if holder is None else self._holds.get(holder)
        held = None if holder is None else (hold.pages if hold is not None else frozenset())
        return self._pages.landed(key, held)

    def claim(
        self, req_id: str, now: float, not_needed: frozenset[bytes] = frozenset()
    ) -> str | None:
        """A decode will load ``req_id``: its hold lasts ``hold_s`` from now on, not
        ``claim_s``. Chunks in ``not_needed`` (decode's own prefix cache has them) are let go
        now, and allocations of them for this request are answered without a page, so they are
        not written. Returns why the request was let go if it was (its KV will not come)."""
        reason = self._dropped.get(req_id)
        if reason is not None:
            return reason
        hold = self._holds.claim(req_id, now, not_needed)
        if hold is not None:
            for page in sorted(p for p in hold.pages if self._pages[p].key in not_needed):
                hold.pages.discard(page)
                self._unhold(req_id, page)
            for page in hold.pages:  # a decode's now: no longer its producer's
                self._recount(page)
        return None

    def adopt(self, req_id: str, keys: Sequence[bytes], now: float) -> int:
        """Decode serves ``req_id`` alone and loads the leading ``keys`` it finds landed here
        (chunks pushed for earlier requests): ``req_id`` holds their pages, claimed, until it
        is released, so that none is evicted or rewritten while it reads them. Returns how many
        of ``keys`` it holds, from the first, up to the first that has not landed.

        Raises ``RequestDropped`` for a request already let go (an id used before)."""
        reason = self._dropped.get(req_id)
        if reason is not None:
            raise RequestDropped(f"req {req_id} was let go here ({reason})", reason)
        self._check_holds(req_id)
        pages = []
        for key in keys:
            page = self._pages.live_page(key)
            if page is None:
                break
            pages.append(page)
        if not pages:
            return 0
        hold = self._holds.hold(req_id, now, ONE_PRODUCER)
        self._holds.claim(req_id, now, frozenset())
        for page in pages:
            self._add_holder(hold, req_id, page)
        self.cache_counts.local_hits += len(pages)
        return len(pages)

    def dropped_reason(self, req_id: str) -> str | None:
        """Why ``req_id`` was let go, or None while it is not."""
        return self._dropped.get(req_id)

    def release(
        self, req_id: str, now: float, reason: str = RELEASED, *, uncache: bool = False
    ) -> int:
        """Let ``req_id`` go: drop everything it holds and refuse its later allocations for
        ``dropped_memory_s``; returns how many pages that freed. Idempotent: the first reason
        stays. With ``uncache`` (its request asked to keep nothing: ``lmcache.skip_save``), the
        chunks written for it that nobody else holds leave the cache as well; chunks it found
        here, landed for others, stay."""
        self._dropped.remember(req_id, reason, now)
        hold = self._holds.let_go(req_id)
        if hold is None:
            return 0
        # A set: sorted, so that the order pages join the cache in is defined.
        return sum(self._unhold(req_id, page, uncache) for page in sorted(hold.pages))

    def _unhold(self, req_id: str, page: int, uncache: bool = False) -> bool:
        """``req_id`` (whose hold no longer names ``page``) lets go of it; True if that freed
        it, else it stays for its other holders, its write, or the cache (not with ``uncache``,
        if it was written for ``req_id``)."""
        info = self._pages[page]
        info.holders.discard(req_id)
        if uncache and info.pushed_for == req_id and not info.holders:
            info.uncached = True
        if self._allocator.decref(page):
            self._forget(page)
            return True
        if not info.holders:
            evicted = self._cache.drop(page) if info.uncached else self._cache.unheld(page)
            self._forget_all(evicted)
            if page in evicted:
                return True
        self._recount(page)
        return False

    def knows(self, req_id: str) -> bool:
        """Whether ``req_id`` holds pages or was claimed here."""
        return self._holds.knows(req_id)

    def expire(self, now: float) -> tuple[list[str], list[str]]:
        """Take back pages whose writes never came and holds nobody released, and forget
        requests let go long ago.

        Returns (request ids whose pending write lapsed, request ids whose hold lapsed).
        """
        lapsed_writes: list[str] = []
        for page in self._allocator.expire(now):
            if self._reserved.is_reserved(page):  # reserved ahead, never written: just freed
                self._reserved.leave(page)
                continue
            info = self._pages[page]
            pending = self._pending.discard(info.alloc_id)
            if pending is not None:
                lapsed_writes.append(pending.req_id)
            for holder in info.holders:
                self._holds[holder].pages.discard(page)
            self._forget(page)
        self._reserved.give_back_lapsed(now)
        lapsed_holds: list[str] = []
        # Holds lapse in the order of their deadlines, which is the order their pages join the
        # cache.
        while (req_id := self._holds.next_lapsed(now)) is not None:
            self.release(req_id, now, HOLD_LAPSED)
            lapsed_holds.append(req_id)
        self._dropped.forget_lapsed(now)
        return lapsed_writes, lapsed_holds

    def _add_holder(self, hold: Hold, req_id: str, page: int) -> None:
        """``req_id`` (whose hold is ``hold``) holds ``page`` from now on, if not yet."""
        if page not in hold.pages:
            self._allocator.incref(page)
            hold.pages.add(page)
            self._pages[page].holders.add(req_id)
            self._cache.held(page)
            self._recount(page)

    def _forget_all(self, pages: Iterable[int]) -> None:
        """The pages the cache evicted are freed: their chunks are gone."""
        for page in pages:
            self._forget(page)

    def _forget(self, page: int) -> None:
        """``page`` is freed: it holds nothing, and counts towards nobody."""
        self.keys_version += 1
        self._pages.forget(page)
        self._shares.count(page, frozenset())

    def _recount(self, page: int) -> None:
        """Which producers ``page`` counts towards now: its writer while the write is due, and
        the producer of each request that holds it and no decode has claimed."""
        info = self._pages.get(page)
        owners: set[ProducerId] = set()
        if info is not None:
            if self._allocator.state(page) is PageState.LEASED:
                owners.add(info.writer)
            for holder in info.holders:
                if holder not in self._holds.claimed:
                    owners.add(self._holds[holder].producer)
        self._shares.count(page, frozenset(owners))

    def _pages_held_by(self, producer: ProducerId) -> int:
        return self._shares.pages_of(producer) + self._reserved.pages_of(producer)

    def _check_holds(self, req_id: str) -> None:
        """``BufferFull`` if ``req_id`` would be one request too many holding pages here."""
        if req_id in self._holds or len(self._holds) < self._max_held_requests:
            return
        self.limit_counts.refused_holds_full += 1
        raise BufferFull(
            f"{len(self._holds)} requests hold pages here already, at most "
            f"{self._max_held_requests}",
            BUFFER_FULL_RETRY_AFTER_S,
        )

    def _new_id(self) -> int:
        """An allocation or reservation id no peer can guess (they share one space: a cancel
        may name either)."""
        new_id = secrets.randbits(63)
        while new_id in self._pending or new_id in self._reserved:  # 2**-63 per id in use
            new_id = secrets.randbits(63)
        return new_id
