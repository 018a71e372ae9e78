"""Chunk store: which key sits in which page, who holds it, which writes are due, who was let go.

Example tests name one behaviour each, most with a negative control (the same steps without the
fault); a state machine then drives allocate / confirm / cancel / release / claim / expire over a
small buffer and a small key space against a model of its own.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_pd.errors import AllocationError, BufferFull, ProtocolError, RequestDropped
from lmcache_pd.protocol import (
    PROTOCOL_VERSION,
    RESERVED_LEASE_S,
    AllocCancel,
    AllocRequest,
    ChunkSpec,
    ReservedWriteDone,
    WriteDone,
)
from lmcache_pd.transfer.allocator import PageAllocator, PageState
from lmcache_pd.transfer.chunk_store import HOLD_LAPSED, RELEASED, ChunkStore
from lmcache_pd.transfer.receive_buffer import LandedChunk

PAGE_BYTES = 64
LEASE_S = 3.0
CLAIM_S = 2.0
HOLD_S = 5.0
DROPPED_MEMORY_S = 3.0


def make_store(num_pages: int = 8, cache_pages: int = 0, reserve_share: float = 1.0) -> ChunkStore:
    allocator = PageAllocator(num_pages=num_pages, page_bytes=PAGE_BYTES, lease_s=LEASE_S)
    return ChunkStore(
        allocator,
        claim_s=CLAIM_S,
        hold_s=HOLD_S,
        dropped_memory_s=DROPPED_MEMORY_S,
        cache_pages=cache_pages,
        reserve_share=reserve_share,
    )


def landed_and_released(store: ChunkStore, req_id: str, *keys: bytes) -> None:
    """``req_id``'s chunks land, are loaded, and the request lets them go."""
    allocation = store.allocate(alloc_request(req_id, *keys), now=0.0)
    store.confirm(write_done(req_id, allocation.alloc_id))
    store.release(req_id, now=0.0)


def alloc_request(req_id: str, *keys: bytes, nbytes: int = PAGE_BYTES) -> AllocRequest:
    chunks = [ChunkSpec(key=key, nbytes=nbytes) for key in keys]
    return AllocRequest(version=PROTOCOL_VERSION, req_id=req_id, chunks=chunks)


def write_done(req_id: str, alloc_id: int, checksums: list[int] | None = None) -> WriteDone:
    return WriteDone(
        version=PROTOCOL_VERSION, req_id=req_id, alloc_id=alloc_id, checksums=checksums
    )


def alloc_cancel(req_id: str, alloc_id: int) -> AllocCancel:
    return AllocCancel(version=PROTOCOL_VERSION, req_id=req_id, alloc_id=alloc_id)


def snapshot(store: ChunkStore) -> tuple:
    """Everything a refused call must leave as it was (reads private state on purpose)."""
    allocator = store._allocator
    return (
        tuple(allocator._free),
        tuple(allocator._state),
        tuple(allocator._refs),
        {key: frozenset(pages) for key, pages in store._pages.pages_of_key.items()},
        {
            page: (info.key, info.nbytes, info.alloc_id, frozenset(info.holders), info.checksum)
            for page, info in store._pages.items()
        },
        {req: (frozenset(hold.pages), hold.deadline) for req, hold in store._holds.items()},
        frozenset(store._holds.claimed),
        dict(store._pending),
        dict(store._dropped),
    )


def refs(store: ChunkStore, page: int) -> int:
    return store._allocator._refs[page]


# A key in flight for two requests.


@pytest.mark.parametrize("let_go", ["cancel", "release", None])
def test_second_write_of_a_key_let_go_first_does_not_lose_the_first(let_go: str | None) -> None:
    store = make_store()
    first = store.allocate(alloc_request("a", b"k"), now=0.0)
    second = store.allocate(alloc_request("b", b"k"), now=0.0)
    [page_a], [page_b] = first.pages, second.pages
    assert page_a is not None and page_b is not None and page_a != page_b
    if let_go == "cancel":
        assert store.cancel(alloc_cancel("b", second.alloc_id)) is True
    elif let_go == "release":
        store.release("b", now=0.0)
    assert store.landed(b"k") is None  # nothing has landed yet
    store.confirm(write_done("a", first.alloc_id))
    landed = store.landed(b"k")
    assert landed is not None and landed.page == page_a


@pytest.mark.parametrize("lapses", [True, False])
def test_first_write_of_a_key_lapsing_does_not_lose_the_second(lapses: bool) -> None:
    store = make_store()
    first = store.allocate(alloc_request("a", b"k"), now=0.0)
    second = store.allocate(alloc_request("b", b"k"), now=1.0)
    [page_b] = second.pages
    store.claim("a", now=0.0)  # keep both holds alive past the first lease
    store.claim("b", now=1.0)
    lapsed_writes, lapsed_holds = store.expire(LEASE_S if lapses else LEASE_S - 0.5)
    assert lapsed_writes == (["a"] if lapses else [])
    assert lapsed_holds == []
    store.confirm(write_done("b", second.alloc_id))
    landed = store.landed(b"k")
    assert landed is not None and landed.page == page_b
    if lapses:
        with pytest.raises(ProtocolError):
            store.confirm(write_done("a", first.alloc_id))
    else:
        store.confirm(write_done("a", first.alloc_id))
    assert store.landed(b"k") is not None


@pytest.mark.parametrize("released_first", ["a", "b"])
def test_both_writes_of_a_key_land_and_it_is_served_while_either_holds_it(
    released_first: str,
) -> None:
    store = make_store()
    first = store.allocate(alloc_request("a", b"k"), now=0.0)
    second = store.allocate(alloc_request("b", b"k"), now=0.0)
    page_of = {"a": first.pages[0], "b": second.pages[0]}
    store.confirm(write_done("a", first.alloc_id))
    store.confirm(write_done("b", second.alloc_id))
    assert store.landed(b"k").page in page_of.values()
    released_last = "b" if released_first == "a" else "a"
    assert store.release(released_first, now=0.0) == 1
    assert store.landed(b"k").page == page_of[released_last]
    assert store.release(released_last, now=0.0) == 1
    assert store.landed(b"k") is None
    assert store.used_pages == 0


@pytest.mark.parametrize("second_holder", [True, False])
def test_landed_chunk_shared_by_two_requests_stays_until_both_release(second_holder: bool) -> None:
    store = make_store()
    first = store.allocate(alloc_request("a", b"k"), now=0.0)
    [page] = first.pages
    store.confirm(write_done("a", first.alloc_id))
    if second_holder:
        shared = store.allocate(alloc_request("b", b"k"), now=0.0)
        assert shared.pages == [None] and shared.new_pages == 0
        assert store.pending_writes == 0  # nothing to write: no lease, no pending entry
        assert refs(store, page) == 2
    store.release("a", now=0.0)
    if second_holder:
        assert store.landed(b"k").page == page
        assert store.release("b", now=0.0) == 1
    assert store.landed(b"k") is None
    assert store.used_pages == 0


# Requests let go.


def test_allocation_for_a_released_request_is_refused_and_holds_nothing() -> None:
    store = make_store()
    allocation = store.allocate(alloc_request("a", b"k0", b"k1"), now=0.0)
    store.confirm(write_done("a", allocation.alloc_id))
    assert store.release("a", now=1.0, reason="client_gone") == 2
    with pytest.raises(RequestDropped) as refused:
        store.allocate(alloc_request("a", b"k2"), now=1.5)
    assert refused.value.reason == "client_gone"
    assert store.used_pages == 0 and store.held_requests == 0 and not store.knows("a")
    # Control: another request is served, and the released one again once its memory lapses.
    store.allocate(alloc_request("b", b"k2"), now=1.5)
    store.expire(1.0 + DROPPED_MEMORY_S - 0.5)
    with pytest.raises(RequestDropped):
        store.allocate(alloc_request("a", b"k2"), now=1.0 + DROPPED_MEMORY_S - 0.5)
    store.expire(1.0 + DROPPED_MEMORY_S)
    assert store.dropped_reason("a") is None
    store.allocate(alloc_request("a", b"k3"), now=1.0 + DROPPED_MEMORY_S)


def test_release_is_idempotent_and_keeps_the_first_reason() -> None:
    store = make_store()
    store.allocate(alloc_request("a", b"k"), now=0.0)
    store.release("a", now=0.0, reason="client_gone")
    assert store.release("a", now=0.0, reason=RELEASED) == 0
    assert store.dropped_reason("a") == "client_gone"


@pytest.mark.parametrize("claimed", [False, True])
def test_unclaimed_hold_lapses_at_claim_s_and_a_claimed_one_at_hold_s(claimed: bool) -> None:
    store = make_store()
    allocation = store.allocate(alloc_request("a", b"k"), now=0.0)
    store.confirm(write_done("a", allocation.alloc_id))
    if claimed:
        assert store.claim("a", now=0.0) is None
    assert store.expire(CLAIM_S - 0.5) == ([], [])
    assert store.expire(CLAIM_S) == ([], [] if claimed else ["a"])
    assert (store.landed(b"k") is not None) is claimed
    if claimed:
        assert store.expire(HOLD_S - 0.5) == ([], [])
        assert store.expire(HOLD_S) == ([], ["a"])
    assert store.used_pages == 0
    assert store.dropped_reason("a") == HOLD_LAPSED


def test_a_later_allocation_renews_the_hold() -> None:
    store = make_store()
    store.allocate(alloc_request("a", b"k0"), now=0.0)
    store.allocate(alloc_request("a", b"k1"), now=1.5)
    assert store.expire(CLAIM_S)[1] == []
    assert store.expire(1.5 + CLAIM_S)[1] == ["a"]


@pytest.mark.parametrize("lapsed", [True, False])
def test_claim_after_the_hold_lapsed_returns_the_reason(lapsed: bool) -> None:
    store = make_store()
    store.allocate(alloc_request("a", b"k"), now=0.0)
    store.expire(CLAIM_S if lapsed else CLAIM_S - 0.5)
    assert store.claim("a", now=CLAIM_S) == (HOLD_LAPSED if lapsed else None)
    assert store.knows("a") is not lapsed


def test_claim_of_a_released_request_returns_its_reason() -> None:
    store = make_store()
    store.release("a", now=0.0, reason="client_gone")
    assert store.claim("a", now=0.0) == "client_gone"
    assert not store.knows("a")


# Cancel and confirm.


@pytest.mark.parametrize("sender", ["a", "b"])
def test_cancel_frees_the_pages_at_once(sender: str) -> None:
    store = make_store(num_pages=3)
    allocation = store.allocate(alloc_request("a", b"k0", b"k1", b"k2"), now=0.0)
    cancelled = store.cancel(alloc_cancel(sender, allocation.alloc_id))
    if sender == "b":  # control: a cancel of another request's allocation changes nothing
        assert cancelled is False and store.used_pages == 3
        return
    assert cancelled is True
    assert store.used_pages == 0 and store.pending_writes == 0
    assert store._holds["a"].pages == set()
    assert store.cancel(alloc_cancel("a", allocation.alloc_id)) is False
    again = store.allocate(alloc_request("a", b"k0", b"k1", b"k2"), now=0.0)
    assert again.new_pages == 3


@pytest.mark.parametrize(
    "fault", ["unknown", "lapsed", "cancelled", "confirmed", "other_req", "checksums", None]
)
def test_bad_confirm_is_a_protocol_error_and_changes_nothing(fault: str | None) -> None:
    store = make_store()
    allocation = store.allocate(alloc_request("a", b"k0", b"k1"), now=0.0)
    done = write_done("a", allocation.alloc_id, checksums=[7, 8])
    if fault == "unknown":
        done = write_done("a", allocation.alloc_id + 100)
    elif fault == "lapsed":
        store.claim("a", now=0.0)
        store.expire(LEASE_S)
    elif fault == "cancelled":
        store.cancel(alloc_cancel("a", allocation.alloc_id))
    elif fault == "confirmed":
        store.confirm(done)
    elif fault == "other_req":
        done = write_done("b", allocation.alloc_id)
    elif fault == "checksums":
        done = write_done("a", allocation.alloc_id, checksums=[7])
    if fault is None:  # control
        assert store.confirm(done) == (2, 2 * PAGE_BYTES)
        assert store.landed(b"k0").checksum == 7 and store.landed(b"k1").checksum == 8
        return
    before = snapshot(store)
    with pytest.raises(ProtocolError):
        store.confirm(done)
    assert snapshot(store) == before


@pytest.mark.parametrize("asked", [[b"k0", b"k1", b"k2", b"k3", b"k4"], [b"k0", b"k1", b"k2"]])
def test_allocation_is_all_or_nothing_when_the_buffer_is_short(asked: list[bytes]) -> None:
    store = make_store(num_pages=4)
    held = store.allocate(alloc_request("a", b"k0", b"k1"), now=0.0)
    store.confirm(write_done("a", held.alloc_id))
    # b needs a page for each key not landed: 3 of 2 free (refused), or 1 (control: served).
    if len(asked) == 5:
        before = snapshot(store)
        with pytest.raises(BufferFull):
            store.allocate(alloc_request("b", *asked), now=0.0)
        assert snapshot(store) == before
        assert not store.knows("b")
    else:
        allocation = store.allocate(alloc_request("b", *asked), now=0.0)
        assert allocation.pages[:2] == [None, None] and allocation.new_pages == 1
        assert refs(store, store.landed(b"k0").page) == 2


# Landed chunks kept as a cache.


@pytest.mark.parametrize("cache_pages", [4, 0], ids=["cache", "no_cache"])
def test_a_landed_chunk_outlives_its_request_and_is_not_written_again(cache_pages: int) -> None:
    store = make_store(cache_pages=cache_pages)
    landed_and_released(store, "a", b"k0", b"k1")
    assert store.used_pages == 0  # held by nobody: cached (or freed), not in use
    assert store.cached_pages == (2 if cache_pages else 0)
    allocation = store.allocate(alloc_request("b", b"k0", b"k1", b"k2"), now=1.0)
    if cache_pages:
        assert allocation.pages[:2] == [None, None] and allocation.new_pages == 1
        assert store.landed(b"k0", "b") is not None  # b holds it: loadable, never evicted
        assert store.cached_pages == 0 and store.used_pages == 3
    else:  # control: without the cache both chunks are written again
        assert allocation.new_pages == 3
    counts = store.cache_counts
    assert (counts.hits, counts.bytes_not_resent) == (
        (2, 2 * PAGE_BYTES) if cache_pages else (0, 0)
    )


def test_idle_cached_chunks_are_evicted_oldest_first_only_for_room() -> None:
    store = make_store(num_pages=4, cache_pages=4)
    landed_and_released(store, "a", b"old")
    landed_and_released(store, "b", b"mid")
    held = store.allocate(alloc_request("c", b"held"), now=0.0)
    store.confirm(write_done("c", held.alloc_id))  # c still holds its chunk
    store.allocate(alloc_request("d", b"mid"), now=0.0)  # used again: now the newest
    store.release("d", now=0.0)
    assert store.cached_pages == 2 and store.used_pages == 1
    store.allocate(alloc_request("e", b"new1"), now=0.0)  # a free page: nothing evicted
    assert store.cache_counts.evictions == 0
    store.allocate(alloc_request("f", b"new2"), now=0.0)  # full: the least recently used goes
    assert store.landed(b"old") is None and store.landed(b"mid") is not None
    assert store.landed(b"held") is not None
    before = snapshot(store)
    with pytest.raises(BufferFull):  # 2 pages asked, 1 could be made: nothing is evicted
        store.allocate(alloc_request("g", b"x", b"y"), now=0.0)
    assert snapshot(store) == before and store.cache_counts.evictions == 1


@pytest.mark.parametrize("pinned", [True, False], ids=["answered_held", "evicted_first"])
def test_a_cached_chunk_evicted_under_a_lookup_is_written_again_never_read_stale(
    pinned: bool,
) -> None:
    """A lookup saw ``k0`` cached. If its request's allocation came first, the answer "already
    held" pinned it: pressure for room finds nothing to evict. If pressure came first, ``k0`` is
    gone: the request finds nothing of its own to load (it waits for a write or recomputes)
    and its allocation gets a new page to be written, never another chunk's bytes."""
    store = make_store(num_pages=3, cache_pages=3)
    landed_and_released(store, "a", b"k0")
    assert store.landed(b"k0") is not None  # what the lookup saw
    if pinned:
        assert store.allocate(alloc_request("b", b"k0"), now=0.0).pages == [None]
        with pytest.raises(BufferFull):
            store.allocate(alloc_request("x", b"x0", b"x1", b"x2"), now=0.0)
        assert store.landed(b"k0", "b") is not None
    else:
        landed_and_released(store, "x", b"x0", b"x1", b"x2")
        assert store.cache_counts.evictions == 1 and store.landed(b"k0") is None
        assert store.landed(b"k0", "b") is None
        again = store.allocate(alloc_request("b", b"k0"), now=0.0)
        assert again.new_pages == 1 and store.landed(b"k0", "b") is None  # until written


def test_idle_cached_chunks_are_capped_at_cache_pages() -> None:
    store = make_store(num_pages=8, cache_pages=1)
    landed_and_released(store, "a", b"k0", b"k1", b"k2")
    assert store.cached_pages == 1 and store.cache_counts.evictions == 2
    assert store.landed(b"k2") is not None  # the most recently let go stays


@pytest.mark.parametrize(
    "decode_has", [frozenset({b"k0", b"k2"}), frozenset()], ids=["has", "none"]
)
def test_chunks_decode_has_itself_are_let_go_at_its_claim_and_never_written(
    decode_has: frozenset[bytes],
) -> None:
    store = make_store()
    first = store.allocate(alloc_request("a", b"k0", b"k1"), now=0.0)
    store.confirm(write_done("a", first.alloc_id))
    assert store.claim("a", now=0.0, not_needed=decode_has) is None
    # k0 (decode's own cache has it) goes back at the claim; k1 stays for the load
    assert (store.landed(b"k0", "a") is None) == bool(decode_has)
    assert store.landed(b"k1", "a") is not None
    later = store.allocate(alloc_request("a", b"k2", b"k3"), now=0.0)
    if decode_has:  # k2 is not written at all, k3 is
        assert later.pages[0] is None and later.new_pages == 1
        assert store.used_pages == 2 and store.cache_counts.not_needed == 1
    else:  # control: both are written
        assert later.new_pages == 2 and store.used_pages == 4


def test_a_write_still_in_flight_is_not_cached_until_it_lands() -> None:
    store = make_store(cache_pages=4)
    allocation = store.allocate(alloc_request("a", b"k0"), now=0.0)
    store.release("a", now=0.0)  # decode let go before the write landed
    assert store.cached_pages == 0 and store.used_pages == 1  # leased until it lands
    store.confirm(write_done("a", allocation.alloc_id))
    assert (store.cached_pages, store.used_pages) == (1, 0)


@pytest.mark.parametrize("uncache", [True, False], ids=["keep_nothing", "keep"])
def test_a_request_that_keeps_nothing_takes_its_chunks_out_of_the_cache(uncache: bool) -> None:
    """Released with ``uncache`` (``lmcache.skip_save``, ``priority_limit``), the chunks pushed
    for a request leave the cache at once, and one whose write was still in flight as it lands
    (counted ``not_kept``); a chunk it found landed for an earlier request stays, and so does
    one another request still holds, for that request. The control keeps them all."""
    store = make_store(cache_pages=8)
    landed_and_released(store, "earlier", b"k0")
    allocation = store.allocate(alloc_request("a", b"k0", b"k1", b"k2"), now=0.0)
    assert allocation.pages[0] is None  # k0: landed for "earlier", now held by "a" too
    store.confirm(write_done("a", allocation.alloc_id))
    store.allocate(alloc_request("b", b"k2"), now=0.0)  # b holds k2 as well
    in_flight = store.allocate(alloc_request("a2", b"k3"), now=0.0)
    store.release("a", now=0.0, uncache=uncache)
    store.release("a2", now=0.0, uncache=uncache)
    store.confirm(write_done("a2", in_flight.alloc_id))  # lands after its request let go
    assert store.landed(b"k0") is not None and store.landed(b"k2", "b") is not None
    assert (store.landed(b"k1") is None) == uncache
    assert (store.landed(b"k3") is None) == uncache
    assert store.cache_counts.not_kept == (2 if uncache else 0)
    store.release("b", now=0.0)  # b asked for nothing of the kind: k2 stays cached
    assert store.landed(b"k2") is not None
    assert store.cached_pages == (2 if uncache else 4) and store.used_pages == 0


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (alloc_request("a", b"k0", b"k0"), ProtocolError),
        # The allocate docstring says ProtocolError; the code (and the consumer's TOO_LARGE reply)
        # treat a chunk larger than a page as an AllocationError.
        (alloc_request("a", b"k0", nbytes=PAGE_BYTES + 1), AllocationError),
        (alloc_request("a", *(b"k%d" % i for i in range(9))), AllocationError),
    ],
    ids=["duplicate_key", "chunk_larger_than_page", "more_chunks_than_pages"],
)
def test_malformed_allocation_is_refused_and_changes_nothing(
    request_: AllocRequest, error: type[Exception]
) -> None:
    store = make_store(num_pages=8)
    before = snapshot(store)
    with pytest.raises(error) as refused:
        store.allocate(request_, now=0.0)
    assert not isinstance(refused.value, BufferFull)  # never "retry later"
    assert snapshot(store) == before


# The state machine.

NUM_PAGES = 8
KEYS = [b"k%d" % i for i in range(5)]
REQ_IDS = ["r0", "r1", "r2", "r3", "r4", "r5"]
UNKNOWN_ALLOC_ID = 10**6


@dataclass
class ModelPage:
    key: bytes
    nbytes: int
    alloc_id: int
    live: bool = False
    pushed_for: str = ""  # the request it was written for
    uncached: bool = False  # that request let it go, keeping nothing: freed once landed


@dataclass
class ModelPending:
    req_id: str
    pages: tuple[int, ...]
    deadline: float


class ChunkStoreMachine(RuleBasedStateMachine):
    """Random allocate / confirm / cancel / release / claim / expire against a model."""

    CACHE_PAGES = 0  # idle landed pages kept as a cache (0: none, freed at once)

    def __init__(self) -> None:
        super().__init__()
        self.allocator = PageAllocator(num_pages=NUM_PAGES, page_bytes=PAGE_BYTES, lease_s=LEASE_S)
        self.store = ChunkStore(
            self.allocator,
            claim_s=CLAIM_S,
            hold_s=HOLD_S,
            dropped_memory_s=DROPPED_MEMORY_S,
            cache_pages=self.CACHE_PAGES,
        )
        self.idle: dict[int, None] = {}  # landed pages nobody holds, least recently used first
        self.not_needed: dict[str, set[bytes]] = {}  # per claimed request: never written for it
        self.now = 0.0
        self.pages: dict[int, ModelPage] = {}
        self.holds: dict[str, set[int]] = {}
        self.hold_deadlines: dict[str, float] = {}
        self.claimed: set[str] = set()
        self.pending: dict[int, ModelPending] = {}
        self.dropped: dict[str, tuple[str, float]] = {}  # req -> (reason, forgotten at)
        self.gone_alloc_ids: list[int] = []  # confirmed, cancelled or lapsed
        self.last_written: dict[int, bytes] = {}  # page -> key of its last confirmed write
        self.drained = False

    # Model helpers.

    def _live_pages(self, key: bytes) -> set[int]:
        return {p for p, info in self.pages.items() if info.live and info.key == key}

    def _held(self, page: int) -> bool:
        return any(page in pages for pages in self.holds.values())

    def _free(self, page: int) -> None:
        del self.pages[page]
        for pages in self.holds.values():
            pages.discard(page)

    def _unheld(self, page: int) -> bool:
        """Landed ``page`` lost its last holder: cached (the oldest idle ones evicted beyond
        CACHE_PAGES), or freed without a cache. Returns whether it was freed at once."""
        if not self.CACHE_PAGES:
            self._free(page)
            return True
        self.idle[page] = None
        while len(self.idle) > self.CACHE_PAGES:
            self._evict(next(iter(self.idle)))
        return False

    def _evict(self, page: int) -> None:
        del self.idle[page]
        self._free(page)

    def _release(self, req_id: str, reason: str, uncache: bool = False) -> int:
        self.claimed.discard(req_id)
        self.not_needed.pop(req_id, None)
        self.dropped.setdefault(req_id, (reason, self.now + DROPPED_MEMORY_S))
        self.hold_deadlines.pop(req_id, None)
        freed = 0
        for page in sorted(self.holds.pop(req_id, set())):
            info = self.pages[page]
            if uncache and info.pushed_for == req_id and not self._held(page):
                info.uncached = True
            if info.live and not self._held(page):
                if info.uncached:
                    self._free(page)
                    freed += 1
                else:
                    freed += self._unheld(page)
        return freed

    def _alloc_ids(self, data: st.DataObject) -> tuple[int, str]:
        """An allocation id (pending, gone or unknown) and who says it is theirs."""
        # Mostly a pending one from its own request, so that writes land often enough.
        kind = data.draw(st.sampled_from(["pending"] * 4 + ["gone", "unknown"]), label="kind")
        if kind == "pending" and self.pending:
            alloc_id = data.draw(st.sampled_from(list(self.pending)), label="alloc_id")
        elif kind == "gone" and self.gone_alloc_ids:
            alloc_id = data.draw(st.sampled_from(self.gone_alloc_ids[-4:]), label="alloc_id")
        else:
            alloc_id = UNKNOWN_ALLOC_ID
        pending = self.pending.get(alloc_id)
        owner = pending.req_id if pending else REQ_IDS[0]
        if data.draw(st.integers(0, 3), label="sender") == 0:  # a quarter from someone else
            return alloc_id, data.draw(st.sampled_from(REQ_IDS), label="req_id")
        return alloc_id, owner

    def _confirm(self, alloc_id: int, req_id: str, with_checksums: bool) -> None:
        pending = self.pending.get(alloc_id)
        if pending is None or pending.req_id != req_id:
            before = snapshot(self.store)
            with pytest.raises(ProtocolError):
                self.store.confirm(write_done(req_id, alloc_id))
            assert snapshot(self.store) == before
            return
        checksums = [100 + i for i in range(len(pending.pages))] if with_checksums else None
        count, nbytes = self.store.confirm(write_done(req_id, alloc_id, checksums))
        assert count == len(pending.pages)
        assert nbytes == sum(self.pages[p].nbytes for p in pending.pages)
        del self.pending[alloc_id]
        self.gone_alloc_ids.append(alloc_id)
        for index, page in enumerate(pending.pages):
            info = self.pages[page]
            info.live = True
            self.last_written[page] = info.key
            if info.uncached:
                self._free(page)
            elif not self._held(page):
                self._unheld(page)
            else:
                expected = None if checksums is None else checksums[index]
                assert self.store._pages[page].checksum == expected

    def _cancel(self, alloc_id: int, req_id: str) -> None:
        pending = self.pending.get(alloc_id)
        if pending is None or pending.req_id != req_id:
            before = snapshot(self.store)
            assert self.store.cancel(alloc_cancel(req_id, alloc_id)) is False
            assert snapshot(self.store) == before
            return
        assert self.store.cancel(alloc_cancel(req_id, alloc_id)) is True
        del self.pending[alloc_id]
        self.gone_alloc_ids.append(alloc_id)
        for page in pending.pages:
            self._free(page)

    def _allocate_malformed(self, req_id: str, keys: list[bytes], fault: str) -> None:
        if fault == "duplicate":
            request, error = alloc_request(req_id, *keys, keys[0]), ProtocolError
        else:
            request, error = alloc_request(req_id, *keys, nbytes=PAGE_BYTES + 1), AllocationError
        if req_id in self.dropped:
            error = RequestDropped
        before = snapshot(self.store)
        with pytest.raises(error):
            self.store.allocate(request, self.now)
        assert snapshot(self.store) == before

    # Rules.

    @rule(
        req_id=st.sampled_from(REQ_IDS),
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True),
        nbytes=st.integers(1, PAGE_BYTES),
        fault=st.sampled_from([None] * 6 + ["duplicate", "too_large"]),
    )
    def allocate(self, req_id: str, keys: list[bytes], nbytes: int, fault: str | None) -> None:
        if fault is not None:
            self._allocate_malformed(req_id, keys, fault)
            return
        request = alloc_request(req_id, *keys, nbytes=nbytes)
        skip = self.not_needed.get(req_id, set())
        need = [key for key in keys if key not in skip and not self._live_pages(key)]
        # Which landed page a shared chunk gets is the store's choice: it must be a live one.
        shared = {key: self.store.landed(key) for key in keys if key not in need + list(skip)}
        short = len(need) - (NUM_PAGES - len(self.pages))
        landed = [self.store.landed(key) for key in keys]
        kept = {chunk.page for chunk in landed if chunk is not None}
        evictable = [page for page in self.idle if page not in kept]
        if req_id in self.dropped or short > len(evictable):
            error = RequestDropped if req_id in self.dropped else BufferFull
            before = snapshot(self.store)
            with pytest.raises(error) as refused:
                self.store.allocate(request, self.now)
            if req_id in self.dropped:
                assert refused.value.reason == self.dropped[req_id][0]
            assert snapshot(self.store) == before
            return
        for page in evictable[: max(0, short)]:
            self._evict(page)
        allocation = self.store.allocate(request, self.now)
        assert len(allocation.pages) == len(keys)
        assert allocation.new_pages == len(need)
        hold = self.holds.setdefault(req_id, set())
        written: list[int] = []
        for key, page in zip(keys, allocation.pages, strict=True):
            if key in skip:  # decode has it: neither written nor held
                assert page is None
                continue
            if key in shared:
                assert page is None
                page = shared[key].page
                assert page in self._live_pages(key)
                self.idle.pop(page, None)
            else:
                assert page is not None and page not in self.pages
                self.pages[page] = ModelPage(key, nbytes, allocation.alloc_id, pushed_for=req_id)
                written.append(page)
            hold.add(page)
        self.hold_deadlines[req_id] = self.now + (HOLD_S if req_id in self.claimed else CLAIM_S)
        if written:
            assert allocation.alloc_id not in self.pending
            self.pending[allocation.alloc_id] = ModelPending(
                req_id, tuple(written), self.now + LEASE_S
            )

    @rule(data=st.data(), with_checksums=st.booleans())
    def confirm(self, data: st.DataObject, with_checksums: bool) -> None:
        self._confirm(*self._alloc_ids(data), with_checksums)

    @precondition(lambda self: self.pending)
    @rule(data=st.data())
    def confirm_with_wrong_checksum_count(self, data: st.DataObject) -> None:
        alloc_id = data.draw(st.sampled_from(list(self.pending)))
        pending = self.pending[alloc_id]
        checksums = [1] * (len(pending.pages) + data.draw(st.sampled_from([-1, 1])))
        before = snapshot(self.store)
        with pytest.raises(ProtocolError):
            self.store.confirm(write_done(pending.req_id, alloc_id, checksums))
        assert snapshot(self.store) == before

    @rule(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        self._cancel(*self._alloc_ids(data))

    @rule(
        req_id=st.sampled_from(REQ_IDS),
        reason=st.sampled_from([RELEASED, "client_gone"]),
        uncache=st.sampled_from([False, False, True]),  # keeping nothing: lmcache.skip_save
    )
    def release(self, req_id: str, reason: str, uncache: bool) -> None:
        expected = self._release(req_id, reason, uncache)
        assert self.store.release(req_id, self.now, reason, uncache=uncache) == expected

    @rule(
        req_id=st.sampled_from(REQ_IDS),
        skip=st.lists(st.sampled_from(KEYS), max_size=2, unique=True),
    )
    def claim(self, req_id: str, skip: list[bytes]) -> None:
        not_needed = frozenset(skip)  # decode's own cache has these
        if req_id in self.dropped:
            before = snapshot(self.store)
            assert self.store.claim(req_id, self.now, not_needed) == self.dropped[req_id][0]
            assert snapshot(self.store) == before
            return
        assert self.store.claim(req_id, self.now, not_needed) is None
        self.claimed.add(req_id)
        if skip:
            self.not_needed[req_id] = set(skip)
        if req_id in self.holds:
            self.hold_deadlines[req_id] = self.now + HOLD_S
            for page in sorted(self.holds[req_id]):
                if self.pages[page].key in not_needed:
                    self.holds[req_id].discard(page)
                    if self.pages[page].live and not self._held(page):
                        self._unheld(page)

    @rule(dt=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0]))
    def advance_and_expire(self, dt: float) -> None:
        self.now += dt
        lapsed_writes, lapsed_holds = self.store.expire(self.now)
        expected_writes = []
        for alloc_id, pending in list(self.pending.items()):
            if pending.deadline <= self.now:
                expected_writes.append(pending.req_id)
                del self.pending[alloc_id]
                self.gone_alloc_ids.append(alloc_id)
                for page in pending.pages:
                    self._free(page)
        expected_holds = []
        # in the order the store lets them go (and caches their pages): by deadline, then id
        for deadline, req_id in sorted((d, r) for r, d in self.hold_deadlines.items()):
            if deadline <= self.now:
                expected_holds.append(req_id)
                self._release(req_id, HOLD_LAPSED)
        for req_id, (_, until) in list(self.dropped.items()):
            if until <= self.now:
                del self.dropped[req_id]
        assert sorted(lapsed_writes) == sorted(expected_writes)
        assert sorted(lapsed_holds) == sorted(expected_holds)

    # Once a run, part-way: it lets every request go, so more often would starve the others.
    @precondition(lambda self: not self.drained and self.now >= 4.0)
    @rule(data=st.data())
    def let_everything_go(self, data: st.DataObject) -> None:
        """Confirm or cancel every pending write, release every request: no page stays."""
        self.drained = True
        # In the order they were made: ids are random, and the draws must not depend on them.
        for alloc_id in list(self.pending):
            req_id = self.pending[alloc_id].req_id
            if data.draw(st.booleans(), label=f"confirm {alloc_id}"):
                self._confirm(alloc_id, req_id, with_checksums=False)
            else:
                self._cancel(alloc_id, req_id)
        for req_id in REQ_IDS:
            assert self.store.release(req_id, self.now) == self._release(req_id, RELEASED)
        assert self.store.used_pages == 0
        assert self.store.pending_writes == 0 and self.store.held_requests == 0

    # Invariants. They read private state on purpose: they check internal consistency.

    @invariant()
    def no_page_is_lost_or_double_owned(self) -> None:
        allocator, store = self.allocator, self.store
        assert allocator.used_pages + allocator.free_pages == NUM_PAGES
        assert len(set(allocator._free)) == allocator.free_pages
        used = {p for p in range(NUM_PAGES) if allocator._state[p] is not PageState.FREE}
        assert used == set(store._pages)
        keyed = [page for pages in store._pages.pages_of_key.values() for page in pages]
        assert len(keyed) == len(set(keyed)), "a page under two keys"
        assert set(keyed) == used
        for key, pages in store._pages.pages_of_key.items():
            assert pages, f"empty page set left for {key!r}"
            assert all(store._pages[page].key == key for page in pages)

    @invariant()
    def references_are_the_lease_plus_one_per_holder(self) -> None:
        holders: dict[int, set[str]] = defaultdict(set)
        for req_id, hold in self.store._holds.items():
            for page in hold.pages:
                holders[page].add(req_id)
        assert set(holders) <= set(self.store._pages), "a hold names a free page"
        for page, info in self.store._pages.items():
            leased = self.allocator._state[page] is PageState.LEASED
            cached = bool(self.CACHE_PAGES) and not leased  # a landed page: the cache's ref
            assert self.allocator._refs[page] == int(leased) + int(cached) + len(holders[page])
            assert info.holders == holders[page]
        assert list(self.store._cache.idle) == list(self.idle), "idle pages or their order differ"
        assert self.store.used_pages == len(self.pages) - len(self.idle)

    @invariant()
    def store_agrees_with_the_model(self) -> None:
        store = self.store
        assert set(store._pages) == set(self.pages)
        for page, info in self.pages.items():
            assert store._pages[page].key == info.key
            assert store._pages[page].alloc_id == info.alloc_id
            state = PageState.LIVE if info.live else PageState.LEASED
            assert self.allocator.state(page) is state
        assert {r: hold.pages for r, hold in store._holds.items()} == self.holds
        assert {r: hold.deadline for r, hold in store._holds.items()} == self.hold_deadlines
        assert {a: (p.req_id, p.pages) for a, p in store._pending.items()} == {
            a: (p.req_id, p.pages) for a, p in self.pending.items()
        }

    @invariant()
    def landed_is_a_page_last_written_with_that_key(self) -> None:
        for key in KEYS:
            landed = self.store.landed(key)
            live = self._live_pages(key)
            if landed is None:
                assert not live, f"{key!r} landed in {live} but is not found"
            else:
                assert landed.page in live
                assert self.last_written.get(landed.page) == key

    @invariant()
    def let_go_requests_hold_nothing(self) -> None:
        for req_id in REQ_IDS:
            reason = self.dropped.get(req_id, (None, 0.0))[0]
            assert self.store.dropped_reason(req_id) == reason
            if reason is not None:
                assert req_id not in self.store._holds
                assert not self.store.knows(req_id)

    def teardown(self) -> None:
        if sys.exc_info()[0] is not None:
            return  # a step failed: its error is the one to report, not what follows from it
        for index, alloc_id in enumerate(list(self.pending)):
            req_id = self.pending[alloc_id].req_id
            if index % 2:
                self._confirm(alloc_id, req_id, with_checksums=False)
            else:
                self._cancel(alloc_id, req_id)
        for req_id in REQ_IDS:
            assert self.store.release(req_id, self.now) == self._release(req_id, RELEASED)
        assert self.store.used_pages == 0
        self.now += max(LEASE_S, HOLD_S, DROPPED_MEMORY_S)
        assert self.store.expire(self.now) == ([], [])
        store = self.store
        assert set(store._pages) == set(self.idle)  # only cached chunks nobody holds remain
        assert not (store._holds or store._pending)
        assert not (store._dropped or store._dropped.forget_at or store._holds.claimed)
        assert not store._holds.deadlines, "stale hold deadlines outlived every hold"


TestChunkStoreMachine = ChunkStoreMachine.TestCase
TestChunkStoreMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


class CachingChunkStoreMachine(ChunkStoreMachine):
    """The same, with landed chunks kept as a cache of at most 3 idle pages."""

    CACHE_PAGES = 3


TestCachingChunkStoreMachine = CachingChunkStoreMachine.TestCase
TestCachingChunkStoreMachine.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None
)


def test_a_load_reads_only_pages_its_request_holds() -> None:
    """Two copies of a key landed for two requests: a load for one must not read the other's
    page, which can be freed and rewritten for a third request while the load reads it."""
    store = make_store(num_pages=2)
    first = store.allocate(alloc_request("a", b"k"), 0.0)
    second = store.allocate(alloc_request("b", b"k"), 0.0)
    store.confirm(write_done("a", first.alloc_id))
    store.confirm(write_done("b", second.alloc_id))
    mine = store.landed(b"k", "b")
    assert mine is not None and mine.page == second.pages[0]
    store.release("a", 0.0)
    assert store.allocate(alloc_request("c", b"x"), 0.0).pages == [
        first.pages[0]
    ]  # a's page reused
    assert store.landed(b"k", "b") == mine  # b still reads its own
    assert store.landed(b"k", "c") is None  # control: c holds no copy of k


def test_a_request_whose_own_write_is_pending_waits_for_it() -> None:
    store = make_store(num_pages=2)
    first = store.allocate(alloc_request("a", b"k"), 0.0)
    store.allocate(alloc_request("b", b"k"), 0.0)  # its own page: a's write had not landed
    store.confirm(write_done("a", first.alloc_id))
    assert store.landed(b"k") is not None  # landed somewhere
    assert store.landed(b"k", "b") is None  # but not in a page b holds


# Pages reserved ahead of a push (protocol 5): written first, told where afterwards.


def reserved_done(
    req_id: str,
    reservation_id: int,
    pages: list[int],
    *keys: bytes,
    checksums: list[int] | None = None,
) -> ReservedWriteDone:
    return ReservedWriteDone(
        version=PROTOCOL_VERSION,
        req_id=req_id,
        reservation_id=reservation_id,
        chunks=[ChunkSpec(key=key, nbytes=PAGE_BYTES) for key in keys],
        pages=pages,
        checksums=checksums,
    )


@pytest.mark.parametrize("cache_pages", [0, 4])
def test_a_reserved_page_becomes_the_chunk_written_into_it(cache_pages: int) -> None:
    store = make_store(cache_pages=cache_pages)
    reservation_id, pages = store.reserve(2, now=0.0)
    # Reserved pages are nobody's yet: neither used nor cached, and not free either.
    assert (store.reserved_pages, store.used_pages, store._allocator.free_pages) == (2, 0, 6)
    done = reserved_done("a", reservation_id, pages[:1], b"k0", checksums=[7])
    assert store.land_reserved(done, now=0.0) == (1, PAGE_BYTES)
    assert store.landed(b"k0", "a") == LandedChunk(pages[0], PAGE_BYTES, 7)
    assert (store.reserved_pages, store.used_pages) == (1, 1)
    # The other page stays reserved, for the next push.
    later = reserved_done("b", reservation_id, pages[1:], b"k1")
    assert store.land_reserved(later, now=0.0) == (1, PAGE_BYTES)
    assert store.reserved_pages == 0 and store._reserved == {}
    store.release("a", now=0.0)
    store.release("b", now=0.0)
    assert store.used_pages == 0 and store.cached_pages == min(cache_pages, 2)


@pytest.mark.parametrize("case", ["held_already", "not_needed", "dropped", None])
def test_a_reserved_page_not_needed_goes_back_at_once(case: str | None) -> None:
    store = make_store(cache_pages=4)
    if case == "held_already":
        landed_and_released(store, "earlier", b"k0")  # k0 is cached here
    elif case == "not_needed":
        store.claim("a", now=0.0, not_needed=frozenset({b"k0"}))
    elif case == "dropped":
        store.release("a", now=0.0)
    reservation_id, pages = store.reserve(1, now=0.0)
    landed = store.land_reserved(reserved_done("a", reservation_id, pages, b"k0"), now=0.0)
    assert landed == (1, PAGE_BYTES)  # it landed, whether kept or not
    if case is None:  # control: the page is kept as k0's, for a
        assert store.landed(b"k0", "a").page == pages[0]
        return
    assert store._allocator.state(pages[0]) is PageState.FREE and store.reserved_pages == 0
    if case == "held_already":  # a holds the copy that was here first
        assert store.landed(b"k0", "a").page != pages[0]
    else:
        assert store.landed(b"k0", "a") is None


@pytest.mark.parametrize(
    "fault", ["other_reservation", "unreserved_page", "page_twice", "lengths", "lapsed", None]
)
def test_bad_reserved_write_is_a_protocol_error_and_changes_nothing(fault: str | None) -> None:
    store = make_store()
    reservation_id, pages = store.reserve(2, now=0.0)
    done = reserved_done("a", reservation_id, pages, b"k0", b"k1")
    if fault == "other_reservation":
        done = reserved_done("a", reservation_id + 100, pages, b"k0", b"k1")
    elif fault == "unreserved_page":
        done = reserved_done("a", reservation_id, [pages[0], 7], b"k0", b"k1")
    elif fault == "page_twice":
        done = reserved_done("a", reservation_id, [pages[0], pages[0]], b"k0", b"k1")
    elif fault == "lengths":
        done = reserved_done("a", reservation_id, pages, b"k0", b"k1", checksums=[1])
    elif fault == "lapsed":  # unwritten, the pages went back with their lease
        store.expire(LEASE_S)
        assert store.reserved_pages == 0 and store._allocator.free_pages == 8
    if fault is None:  # control
        assert store.land_reserved(done, now=0.0) == (2, 2 * PAGE_BYTES)
        return
    before = (snapshot(store), dict(store._reserved), dict(store._reserved.reservation_of))
    with pytest.raises(ProtocolError):
        store.land_reserved(done, now=0.0)
    assert (snapshot(store), dict(store._reserved), dict(store._reserved.reservation_of)) == before


def test_reserving_is_all_or_nothing_and_evicts_idle_cached_chunks_for_room() -> None:
    store = make_store(num_pages=3, cache_pages=3)
    landed_and_released(store, "a", b"k0", b"k1")
    held = store.allocate(alloc_request("b", b"k2"), now=0.0)
    store.confirm(write_done("b", held.alloc_id))
    with pytest.raises(BufferFull):  # b holds one page: two more at most
        store.reserve(3, now=0.0)
    assert store.reserved_pages == 0 and store.cached_pages == 2
    store.reserve(2, now=0.0)
    assert store.reserved_pages == 2 and store.cached_pages == 0


def test_reservations_take_at_most_their_share_of_the_buffer() -> None:
    store = make_store(num_pages=8, reserve_share=0.25)  # 2 pages
    _, pages = store.reserve(1, now=0.0)
    assert len(pages) == 1  # control: within the share
    _, pages = store.reserve(4, now=0.0)
    assert len(pages) == 1  # what the share leaves
    with pytest.raises(BufferFull, match="at most 2"):
        store.reserve(1, now=0.0)
    assert store.reserved_pages == 2 and store._allocator.free_pages == 6


@pytest.mark.parametrize("how", ["lapsed", "given_back", None])
def test_unwritten_reserved_pages_go_back_at_their_lease_or_when_given_back(
    how: str | None,
) -> None:
    allocator = PageAllocator(num_pages=8, page_bytes=PAGE_BYTES, lease_s=60.0)
    store = ChunkStore(allocator, claim_s=CLAIM_S, hold_s=HOLD_S, reserve_share=1.0)
    reservation_id, pages = store.reserve(2, now=0.0)
    store.expire(RESERVED_LEASE_S - 0.1)
    assert store.reserved_pages == 2  # an allocation's lease is longer; this one not over yet
    if how == "lapsed":
        store.expire(RESERVED_LEASE_S)
    elif how == "given_back":
        assert store.cancel(alloc_cancel("any", reservation_id)) is True
    done = reserved_done("a", reservation_id, pages, b"k0", b"k1")
    if how is None:  # control
        assert store.land_reserved(done, now=RESERVED_LEASE_S - 0.1) == (2, 2 * PAGE_BYTES)
        return
    assert store.reserved_pages == 0 and allocator.free_pages == 8
    with pytest.raises(ProtocolError):  # a write after that is never taken for a chunk
        store.land_reserved(done, now=RESERVED_LEASE_S)


def test_an_adopted_chunk_is_not_evicted_until_its_local_load_releases_it() -> None:
    """Decode serving a request alone takes a hold of chunks landed for an earlier request: the
    leading run of them that is here, none of which an allocation can evict meanwhile; released,
    they are idle in the cache again. A key that never landed ends the run."""
    store = make_store(num_pages=3, cache_pages=3)
    landed_and_released(store, "earlier", b"k0", b"k1")
    assert set(store.landed_keys()) == {b"k0", b"k1"}
    assert store.adopt("local-1", [b"k0", b"k1", b"never", b"k0"], now=0.0) == 2
    assert store.cached_pages == 0  # held: not idle, not evictable
    with pytest.raises(BufferFull):  # two pages held, one free: three chunks cannot fit
        store.allocate(alloc_request("other", b"a", b"b", b"c"), now=0.0)
    assert store.landed(b"k0", "local-1") is not None
    store.release("local-1", now=0.0)
    assert store.cached_pages == 2
    assert store.adopt("local-2", [b"never"], now=0.0) == 0
    with pytest.raises(RequestDropped):  # a name used before is refused
        store.adopt("local-1", [b"k0"], now=0.0)
