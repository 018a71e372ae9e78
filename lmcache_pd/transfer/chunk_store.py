"""The consumer's bookkeeping: which key sits in which page, who holds it, which writes are due,
and which requests were let go.

Pure state over a ``PageAllocator``: no sockets, no NIXL, no threads (the consumer serialises
calls under its lock). A page's references are its allocation's lease (until the write is
confirmed) plus one per request that holds it; a request holds every chunk it asked room for,
written by it or already there, until it is released or its hold lapses.

A key may name several pages at once: two requests whose prompts share a prefix can each be
writing that chunk (neither write may be trusted to land for the other), and whichever lands
first serves both. Holds lapse after ``claim_s`` until a decode claims the request (its KV may
never be wanted: the client left, or decode computed the prompt itself), after ``hold_s`` once
claimed. A request released, lapsed or abandoned is remembered for ``dropped_memory_s`` so that
its late pushes are refused instead of holding pages again.

Landed chunks outlive their requests as a cache (``cache_pages`` > 0): a confirmed write's lease
reference becomes the cache's own, so a page nobody holds any more keeps its chunk, and a later
request whose prompt shares it is answered "already held" instead of having it written again.
Such idle pages are evicted, least recently used first, only when an allocation needs their room
or more than ``cache_pages`` of them are idle; a page a request holds or a write still leases is
never evicted.

A producer may hold pages reserved ahead (``reserve``), tied to no key, so that a small push
writes at once and says afterwards where each chunk went (``land_reserved``). Unwritten, they go
back ``RESERVED_LEASE_S`` after they were handed out. A chunk that turns out to be here already,
or not needed, or of a request let go, gives its page straight back.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from lmcache_pd.errors import AllocationError, BufferFull, ProtocolError, RequestDropped
from lmcache_pd.protocol import (
    BUFFER_FULL_RETRY_AFTER_S,
    DROPPED_MEMORY_S,
    RESERVED_FRESH_S,
    RESERVED_LEASE_S,
    AllocCancel,
    AllocRequest,
    ReservedWriteDone,
    WriteDone,
)
from lmcache_pd.transfer.allocator import PageAllocator, PageState
from lmcache_pd.transfer.consumer_stats import CacheCounts
from lmcache_pd.transfer.receive_buffer import LandedChunk

logger = logging.getLogger(__name__)

# At most this share of the pages is reserved ahead for producers at once.
RESERVE_SHARE = 0.125

# Why a request was let go when nobody said otherwise.
RELEASED = "released"
HOLD_LAPSED = "hold_lapsed"


@dataclass(slots=True)
class PageInfo:
    """What a used page holds."""

    key: bytes
    nbytes: int
    alloc_id: int
    holders: set[str] = field(default_factory=set)
    checksum: int | None = None


@dataclass(slots=True)
class Hold:
    """The pages one request holds, and when the hold lapses if never released."""

    pages: set[int]
    deadline: float


@dataclass(frozen=True, slots=True)
class PendingWrite:
    """An allocation whose pages wait for the producer's WriteDone."""

    req_id: str
    pages: tuple[int, ...]


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
    ) -> None:
        if not 0 < claim_s <= hold_s:
            raise ValueError(f"need 0 < claim_s <= hold_s, got {claim_s=} {hold_s=}")
        if cache_pages < 0:
            raise ValueError(f"need cache_pages >= 0, got {cache_pages}")
        self._cache_pages = cache_pages
        # Landed pages holding the cache's reference, and those of them nobody holds (oldest
        # use first: the order of eviction).
        self._cached: set[int] = set()
        self._idle: OrderedDict[int, None] = OrderedDict()
        self.cache_counts = CacheCounts()
        self._allocator = allocator
        self._claim_s = claim_s
        self._hold_s = hold_s
        self._dropped_memory_s = dropped_memory_s
        self._pages_of_key: dict[bytes, set[int]] = {}
        self._pages: dict[int, PageInfo] = {}
        self._holds: dict[str, Hold] = {}
        # A heap: holds have two lengths (claimed or not), so deadlines come out of order.
        self._hold_deadlines: list[tuple[float, str]] = []
        self._claimed: set[str] = set()
        self._pending: dict[int, PendingWrite] = {}
        self._dropped: dict[str, str] = {}
        # Per claimed request, chunk keys its decode has in its own cache: never written for it.
        self._not_needed: dict[str, frozenset[bytes]] = {}
        self._dropped_until: deque[tuple[float, str]] = deque()
        self._alloc_ids = itertools.count(1)
        # Pages reserved ahead and not written yet, per reservation id, and the way back; when
        # each reservation was handed out (in order: they lapse RESERVED_LEASE_S after).
        self._reserved: dict[int, set[int]] = {}
        self._reservation_of: dict[int, int] = {}
        self._reserved_until: deque[tuple[float, int]] = deque()
        self._max_reserved = max(1, int(allocator.num_pages * reserve_share))
        self._last_reserved_at = float("-inf")

    @property
    def used_pages(self) -> int:
        """Pages held by a request or waiting for a write (idle cached ones and those reserved
        ahead are not)."""
        return self._allocator.used_pages - len(self._idle) - len(self._reservation_of)

    @property
    def cached_pages(self) -> int:
        """Landed pages nobody holds, kept for a later request that shares their chunk."""
        return len(self._idle)

    @property
    def reserved_pages(self) -> int:
        """Pages reserved ahead for producers and not written yet."""
        return len(self._reservation_of)

    def expecting_writes(self, now: float) -> bool:
        """Whether a write's notification may come soon: an allocation waits for one, or pages
        were reserved ahead within ``RESERVED_FRESH_S`` (a producer writes into them only that
        soon)."""
        return bool(self._pending) or (
            bool(self._reservation_of) and now - self._last_reserved_at < RESERVED_FRESH_S
        )

    @property
    def pending_writes(self) -> int:
        return len(self._pending)

    @property
    def held_requests(self) -> int:
        return len(self._holds)

    def allocate(self, request: AllocRequest, now: float) -> Allocation:
        """Room for every chunk of ``request`` that has not landed here, all or nothing.

        A chunk still being written for another request gets a page of its own: sharing it
        would tie this request to a write that may fail.

        Raises ``RequestDropped`` for a request already let go, ``AllocationError``
        (``BufferFull`` if only for now; a chunk larger than a page) or ``ProtocolError`` for a
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
        skip = self._not_needed.get(request.req_id, frozenset())
        held = [self._live_page(key) for key in keys]
        needed = sum(page is None and key not in skip for page, key in zip(held, keys, strict=True))
        self._make_room(needed, {page for page in held if page is not None})
        fresh = iter(self._allocator.allocate(needed, now))
        alloc_id = next(self._alloc_ids)
        hold = self._hold(request.req_id, now)
        pages: list[int | None] = []
        written: list[int] = []
        for chunk, live in zip(request.chunks, held, strict=True):
            if chunk.key in skip:
                pages.append(None)  # written for nobody: "already held" to the producer
                self.cache_counts.not_needed += 1
                continue
            if live is None:
                page = next(fresh)
                self._pages_of_key.setdefault(chunk.key, set()).add(page)
                self._pages[page] = PageInfo(chunk.key, chunk.nbytes, alloc_id)
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
            self._pending[alloc_id] = PendingWrite(request.req_id, tuple(written))
        return Allocation(alloc_id, pages)

    def confirm(self, done: WriteDone) -> tuple[int, int]:
        """The write of ``done.alloc_id`` landed; returns the chunks and bytes it brought.

        Raises ``ProtocolError`` for an allocation that is unknown (its lease ran out, or it never
        existed) or a checksum list of the wrong length.
        """
        pending = self._pending.get(done.alloc_id)
        if pending is None or pending.req_id != done.req_id:
            raise ProtocolError(
                f"req {done.req_id}: no pending write {done.alloc_id} (lease expired or unknown)"
            )
        if done.checksums is not None and len(done.checksums) != len(pending.pages):
            raise ProtocolError(
                f"req {done.req_id}: {len(done.checksums)} checksums for "
                f"{len(pending.pages)} chunks"
            )
        del self._pending[done.alloc_id]
        nbytes = 0
        for index, page in enumerate(pending.pages):
            nbytes += self._land(page, None if done.checksums is None else done.checksums[index])
        return len(pending.pages), nbytes

    def reserve(self, count: int, now: float) -> tuple[int, list[int]]:
        """Up to ``count`` pages tied to no chunk, for a producer to write later pushes into at
        once (taken back after ``RESERVED_LEASE_S`` unless written); returns (reservation id,
        pages). Fewer when more would take over ``reserve_share`` of the buffer (many producers
        may not starve allocations); ``BufferFull`` when none can be had."""
        count = min(count, self._max_reserved - len(self._reservation_of))
        if count < 1:
            raise BufferFull(
                f"{len(self._reservation_of)} pages reserved ahead already, at most "
                f"{self._max_reserved}",
                BUFFER_FULL_RETRY_AFTER_S,
            )
        self._make_room(count, set())
        pages = self._allocator.allocate(count, now)
        self._last_reserved_at = now
        reservation_id = next(self._alloc_ids)
        self._reserved[reservation_id] = set(pages)
        self._reserved_until.append((now + RESERVED_LEASE_S, reservation_id))
        for page in pages:
            self._reservation_of[page] = reservation_id
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
            len(done.pages) != len(keys)
            or (done.checksums is not None and len(done.checksums) != len(keys))
            or len(set(keys)) != len(keys)
            or len(set(done.pages)) != len(done.pages)
            or not reserved.issuperset(done.pages)
        ):
            raise ProtocolError(
                f"req {done.req_id}: ReservedWriteDone does not match reservation "
                f"{done.reservation_id} (lease expired, or pages, keys and checksums differ)"
            )
        for page in done.pages:
            self._leave_reservation(page)
        dropped = done.req_id in self._dropped
        skip = self._not_needed.get(done.req_id, frozenset())
        hold = None if dropped else self._hold(done.req_id, now)
        kept = nbytes = 0
        for index, (chunk, page) in enumerate(zip(done.chunks, done.pages, strict=True)):
            live = self._live_page(chunk.key)
            if hold is not None and live is not None and chunk.key not in skip:
                self._add_holder(hold, done.req_id, live)
            nbytes += chunk.nbytes
            if dropped or live is not None or chunk.key in skip:
                self._allocator.free(page)
                continue
            self._pages_of_key.setdefault(chunk.key, set()).add(page)
            self._pages[page] = PageInfo(chunk.key, chunk.nbytes, done.reservation_id)
            assert hold is not None
            self._add_holder(hold, done.req_id, page)
            self._land(page, None if done.checksums is None else done.checksums[index])
            kept += 1
        self.cache_counts.misses += kept
        return len(done.chunks), nbytes

    def _leave_reservation(self, page: int) -> None:
        """``page`` is no longer reserved ahead (written into, or freed by its lease)."""
        reservation_id = self._reservation_of.pop(page)
        reserved = self._reserved[reservation_id]
        reserved.discard(page)
        if not reserved:
            del self._reserved[reservation_id]

    def _unreserve(self, reservation_id: int) -> None:
        """Free the unwritten pages of a reservation (given back, or lapsed)."""
        for page in self._reserved.pop(reservation_id, set()):
            del self._reservation_of[page]
            self._allocator.free(page)

    def _land(self, page: int, checksum: int | None) -> int:
        """The write into leased ``page`` landed: its lease's reference goes to the cache (or
        away); returns the chunk's bytes."""
        info = self._pages[page]
        info.checksum = checksum
        if self._cache_pages:
            self._allocator.confirm(page, keep=True)
            self._cached.add(page)
            if not info.holders:
                self._idle_now(page)
        elif self._allocator.confirm(page):
            self._forget(page)
        return info.nbytes

    def cancel(self, cancel: AllocCancel) -> bool:
        """The write of ``cancel.alloc_id`` will never come: its pages are freed at once and
        their keys may be sent again; or, for a reservation, its unwritten pages go back. False
        if nothing was pending."""
        if cancel.alloc_id in self._reserved:
            self._unreserve(cancel.alloc_id)
            return True
        pending = self._pending.get(cancel.alloc_id)
        if pending is None or pending.req_id != cancel.req_id:
            return False
        self._cancel(cancel.alloc_id)
        return True

    def cancel_writes_of(self, req_id: str) -> int:
        """Every pending write of ``req_id`` will never come (its producer says none is in
        flight): free their pages now. Returns how many allocations that was."""
        ids = [alloc_id for alloc_id, pending in self._pending.items() if pending.req_id == req_id]
        for alloc_id in ids:
            self._cancel(alloc_id)
        return len(ids)

    def _cancel(self, alloc_id: int) -> None:
        pending = self._pending.pop(alloc_id)
        for page in pending.pages:
            self._unkey(page)
            # Nobody else can hold it: only landed pages are shared.
            for holder in self._pages[page].holders:
                self._holds[holder].pages.discard(page)
            self._pages[page].holders.clear()
            self._allocator.free(page)
            self._forget(page)

    def unclaimed_landed(self) -> dict[str, int]:
        """Per request no decode has claimed yet, how many of the chunks it holds have landed:
        once that is all of its prompt's, its decode can load it before its first step."""
        return {
            req_id: sum(self._allocator.state(page) is PageState.LIVE for page in hold.pages)
            for req_id, hold in self._holds.items()
            if req_id not in self._claimed
        }

    def landed(self, key: bytes, holder: str | None = None) -> LandedChunk | None:
        """The chunk with ``key`` if a write of it was confirmed, else None. With ``holder``,
        only a page that request holds: a load must read bytes whose page cannot be freed and
        rewritten for another request while it reads them."""
        hold = None if holder is None else self._holds.get(holder)
        held = None if holder is None else (hold.pages if hold is not None else frozenset())
        for page in self._pages_of_key.get(key, ()):
            if held is not None and page not in held:
                continue
            if self._allocator.state(page) is PageState.LIVE:
                info = self._pages[page]
                return LandedChunk(page, info.nbytes, info.checksum)
        return None

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
        self._claimed.add(req_id)
        if not_needed:
            self._not_needed[req_id] = not_needed
        hold = self._holds.get(req_id)
        if hold is not None:
            self._renew(hold, req_id, now + self._hold_s)
            for page in sorted(p for p in hold.pages if self._pages[p].key in not_needed):
                hold.pages.discard(page)
                self._unhold(req_id, page)
        return None

    def dropped_reason(self, req_id: str) -> str | None:
        """Why ``req_id`` was let go, or None while it is not."""
        return self._dropped.get(req_id)

    def release(self, req_id: str, now: float, reason: str = RELEASED) -> int:
        """Let ``req_id`` go: drop everything it holds and refuse its later allocations for
        ``dropped_memory_s``; returns how many pages that freed. Idempotent: the first reason
        stays."""
        self._claimed.discard(req_id)
        self._not_needed.pop(req_id, None)
        if req_id not in self._dropped:
            self._dropped[req_id] = reason
            self._dropped_until.append((now + self._dropped_memory_s, req_id))
        hold = self._holds.pop(req_id, None)
        if hold is None:
            return 0
        # A set: sorted, so that the order pages join the cache in is defined.
        return sum(self._unhold(req_id, page) for page in sorted(hold.pages))

    def _unhold(self, req_id: str, page: int) -> bool:
        """``req_id`` (whose hold no longer names ``page``) lets go of it; True if that freed
        it, else it stays for its other holders, its write, or the cache."""
        info = self._pages[page]
        info.holders.discard(req_id)
        if self._allocator.decref(page):
            self._forget(page)
            return True
        if page in self._cached and not info.holders:
            self._idle_now(page)
        return False

    def knows(self, req_id: str) -> bool:
        """Whether ``req_id`` holds pages or was claimed here."""
        return req_id in self._holds or req_id in self._claimed

    def expire(self, now: float) -> tuple[list[str], list[str]]:
        """Take back pages whose writes never came and holds nobody released, and forget
        requests let go long ago.

        Returns (request ids whose pending write lapsed, request ids whose hold lapsed).
        """
        lapsed_writes: list[str] = []
        for page in self._allocator.expire(now):
            if page in self._reservation_of:  # reserved ahead, never written: just freed
                self._leave_reservation(page)
                continue
            info = self._pages[page]
            pending = self._pending.pop(info.alloc_id, None)
            if pending is not None:
                lapsed_writes.append(pending.req_id)
            for holder in info.holders:
                self._holds[holder].pages.discard(page)
            self._forget(page)
        while self._reserved_until and self._reserved_until[0][0] <= now:
            self._unreserve(self._reserved_until.popleft()[1])
        lapsed_holds: list[str] = []
        while self._hold_deadlines and self._hold_deadlines[0][0] <= now:
            deadline, req_id = heapq.heappop(self._hold_deadlines)
            hold = self._holds.get(req_id)
            # Only at its current deadline's own entry (an older one is stale): holds lapse in
            # the order of their deadlines, which is the order their pages join the cache.
            if hold is not None and hold.deadline == deadline:
                self.release(req_id, now, HOLD_LAPSED)
                lapsed_holds.append(req_id)
        while self._dropped_until and self._dropped_until[0][0] <= now:
            _, req_id = self._dropped_until.popleft()
            self._dropped.pop(req_id, None)
        return lapsed_writes, lapsed_holds

    def _hold(self, req_id: str, now: float) -> Hold:
        """The request's hold, made or extended; a later AllocRequest of it renews the deadline."""
        deadline = now + (self._hold_s if req_id in self._claimed else self._claim_s)
        hold = self._holds.get(req_id)
        if hold is None:
            hold = self._holds[req_id] = Hold(set(), deadline)
            heapq.heappush(self._hold_deadlines, (deadline, req_id))
        else:
            self._renew(hold, req_id, deadline)
        return hold

    def _add_holder(self, hold: Hold, req_id: str, page: int) -> None:
        """``req_id`` (whose hold is ``hold``) holds ``page`` from now on, if not yet."""
        if page not in hold.pages:
            self._allocator.incref(page)
            hold.pages.add(page)
            self._pages[page].holders.add(req_id)
            self._idle.pop(page, None)

    def _renew(self, hold: Hold, req_id: str, deadline: float) -> None:
        # The entry of the old deadline stays in the heap and is skipped when it comes up.
        hold.deadline = deadline
        heapq.heappush(self._hold_deadlines, (deadline, req_id))

    def _idle_now(self, page: int) -> None:
        """Nobody holds cached ``page`` any more: it is the most recently used idle page, and
        the oldest go while more than ``cache_pages`` are idle."""
        self._idle[page] = None
        while len(self._idle) > self._cache_pages:
            self._evict(next(iter(self._idle)))

    def _make_room(self, needed: int, keep: set[int]) -> None:
        """Evict idle cached pages, oldest first and none of ``keep``, until ``needed`` pages
        are free; none at all if that would still not be enough (the allocation is refused)."""
        short = needed - self._allocator.free_pages
        if short <= 0:
            return
        victims = [page for page in self._idle if page not in keep][:short]
        if len(victims) == short:
            for page in victims:
                self._evict(page)

    def _evict(self, page: int) -> None:
        del self._idle[page]
        self._cached.discard(page)
        self.cache_counts.evictions += 1
        freed = self._allocator.decref(page)  # the cache's reference was the last
        assert freed, f"evicted page {page} is still referenced"
        self._forget(page)

    def _live_page(self, key: bytes) -> int | None:
        for page in self._pages_of_key.get(key, ()):
            if self._allocator.state(page) is PageState.LIVE:
                return page
        return None

    def _unkey(self, page: int) -> None:
        """``page`` no longer stands for its key (its write was cancelled, or it is freed)."""
        key = self._pages[page].key
        pages = self._pages_of_key.get(key)
        if pages is not None:
            pages.discard(page)
            if not pages:
                del self._pages_of_key[key]

    def _forget(self, page: int) -> None:
        self._unkey(page)
        del self._pages[page]
