"""The consumer's bookkeeping: which key sits in which page, who holds it, which writes are due.

Pure state over a ``PageAllocator``: no sockets, no NIXL, no threads (the consumer serialises
calls under its lock). A page's references are its allocation's lease (until the write is
confirmed) plus one per request that holds it; a request holds every chunk it asked room for,
written by it or already there, until it is released or its hold times out.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field

from lmcache_pd.allocator import PageAllocator, PageState
from lmcache_pd.errors import AllocationError, ProtocolError
from lmcache_pd.protocol import AllocCancel, AllocRequest, WriteDone

logger = logging.getLogger(__name__)


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


@dataclass(frozen=True, slots=True)
class LandedChunk:
    """Where a landed chunk's bytes are and what they should hash to."""

    page: int
    nbytes: int
    checksum: int | None


class ChunkStore:
    """Keys, pages, holds and pending writes of one consumer rank."""

    def __init__(self, allocator: PageAllocator, hold_s: float) -> None:
        self._allocator = allocator
        self._hold_s = hold_s
        self._by_key: dict[bytes, int] = {}
        self._pages: dict[int, PageInfo] = {}
        self._holds: dict[str, Hold] = {}
        self._hold_deadlines: deque[tuple[float, str]] = deque()
        self._pending: dict[int, PendingWrite] = {}
        self._alloc_ids = itertools.count(1)

    @property
    def used_pages(self) -> int:
        return self._allocator.used_pages

    @property
    def pending_writes(self) -> int:
        return len(self._pending)

    def allocate(self, request: AllocRequest, now: float) -> Allocation:
        """Room for every chunk of ``request`` that has not landed here, all or nothing.

        A chunk still being written for another request gets a page of its own: sharing it
        would tie this request to a write that may fail. The key then names the newer page.

        Raises ``AllocationError`` (``BufferFull`` if only for now) or ``ProtocolError`` for a
        request that makes no sense (a chunk larger than a page, a key twice).
        """
        page_bytes = self._allocator.page_bytes
        keys = [chunk.key for chunk in request.chunks]
        if len(set(keys)) != len(keys):
            raise ProtocolError("the same chunk key appears twice in one request")
        for index, chunk in enumerate(request.chunks):
            if chunk.nbytes > page_bytes:
                raise AllocationError(
                    f"chunk {index} has {chunk.nbytes} bytes, a page holds {page_bytes}"
                )
        missing = {index for index, key in enumerate(keys) if self.landed(key) is None}
        fresh = iter(self._allocator.allocate(len(missing), now))
        alloc_id = next(self._alloc_ids)
        hold = self._hold(request.req_id, now)
        pages: list[int | None] = []
        written: list[int] = []
        for index, chunk in enumerate(request.chunks):
            if index in missing:
                page = next(fresh)
                self._by_key[chunk.key] = page
                self._pages[page] = PageInfo(chunk.key, chunk.nbytes, alloc_id)
                written.append(page)
                pages.append(page)
            else:
                page = self._by_key[chunk.key]
                pages.append(None)
            if page not in hold.pages:
                self._allocator.incref(page)
                hold.pages.add(page)
                self._pages[page].holders.add(request.req_id)
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
            info = self._pages[page]
            info.checksum = None if done.checksums is None else done.checksums[index]
            nbytes += info.nbytes
            if self._allocator.confirm(page):
                self._forget(page)
        return len(pending.pages), nbytes

    def cancel(self, cancel: AllocCancel) -> bool:
        """The write of ``cancel.alloc_id`` will never come: its keys are forgotten at once, its
        pages stay with their holders until released. False if nothing was pending."""
        pending = self._pending.get(cancel.alloc_id)
        if pending is None or pending.req_id != cancel.req_id:
            return False
        del self._pending[cancel.alloc_id]
        for page in pending.pages:
            info = self._pages[page]
            if self._by_key.get(info.key) == page:
                del self._by_key[info.key]
            if self._allocator.confirm(page):
                self._forget(page)
        return True

    def landed(self, key: bytes) -> LandedChunk | None:
        """The chunk with ``key`` if its write was confirmed, else None."""
        page = self._by_key.get(key)
        if page is None or self._allocator.state(page) is not PageState.LIVE:
            return None
        info = self._pages[page]
        return LandedChunk(page, info.nbytes, info.checksum)

    def release(self, req_id: str) -> int:
        """Drop everything ``req_id`` holds; returns how many pages that freed."""
        hold = self._holds.pop(req_id, None)
        if hold is None:
            return 0
        freed = 0
        for page in hold.pages:
            self._pages[page].holders.discard(req_id)
            if self._allocator.decref(page):
                self._forget(page)
                freed += 1
        return freed

    def expire(self, now: float) -> tuple[list[str], list[str]]:
        """Take back pages whose writes never came and holds nobody released.

        Returns (request ids whose pending write lapsed, request ids whose hold lapsed).
        """
        lapsed_writes: list[str] = []
        for page in self._allocator.expire(now):
            info = self._pages[page]
            pending = self._pending.pop(info.alloc_id, None)
            if pending is not None:
                lapsed_writes.append(pending.req_id)
            for holder in info.holders:
                self._holds[holder].pages.discard(page)
            self._forget(page)
        lapsed_holds: list[str] = []
        while self._hold_deadlines and self._hold_deadlines[0][0] <= now:
            _, req_id = self._hold_deadlines.popleft()
            hold = self._holds.get(req_id)
            if hold is not None and hold.deadline <= now:
                self.release(req_id)
                lapsed_holds.append(req_id)
        return lapsed_writes, lapsed_holds

    def _hold(self, req_id: str, now: float) -> Hold:
        """The request's hold, made or extended; a later AllocRequest of it renews the deadline."""
        deadline = now + self._hold_s
        hold = self._holds.setdefault(req_id, Hold(set(), deadline))
        hold.deadline = deadline
        self._hold_deadlines.append((deadline, req_id))
        return hold

    def _forget(self, page: int) -> None:
        info = self._pages.pop(page)
        if self._by_key.get(info.key) == page:
            del self._by_key[info.key]
