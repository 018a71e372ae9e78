"""Page allocator: property tests (no overlap, nothing lost, bounds) and leases."""

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from lmcache_pd.errors import AllocationError, BufferFull
from lmcache_pd.transfer.allocator import PageAllocator, PageState

NUM_PAGES = 16
PAGE_BYTES = 4096
LEASE_S = 10.0


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/confirm/incref/decref/expire against a model of who holds what."""

    def __init__(self) -> None:
        super().__init__()
        self.allocator = PageAllocator(num_pages=NUM_PAGES, page_bytes=PAGE_BYTES, lease_s=LEASE_S)
        self.now = 0.0
        self.refs: dict[int, int] = {}  # page -> references we believe it has
        self.leased: set[int] = set()

    @rule(count=st.integers(0, NUM_PAGES + 2))
    def allocate(self, count: int) -> None:
        free = NUM_PAGES - len(self.refs)
        if count > NUM_PAGES:
            with pytest.raises(AllocationError):
                self.allocator.allocate(count, self.now)
        elif count > free:
            with pytest.raises(BufferFull):
                self.allocator.allocate(count, self.now)
        else:
            pages = self.allocator.allocate(count, self.now)
            assert len(set(pages)) == count
            assert not set(pages) & set(self.refs)
            for page in pages:
                self.refs[page] = 1
                self.leased.add(page)

    @precondition(lambda self: self.leased)
    @rule(data=st.data())
    def confirm(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(sorted(self.leased)))
        self.leased.discard(page)
        freed = self.allocator.confirm(page)
        self._drop(page, freed)

    @precondition(lambda self: self.refs)
    @rule(data=st.data())
    def incref(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(sorted(self.refs)))
        self.allocator.incref(page)
        self.refs[page] += 1

    @precondition(lambda self: any(self.refs[p] > 1 or p not in self.leased for p in self.refs))
    @rule(data=st.data())
    def decref(self, data: st.DataObject) -> None:
        # Never drop a leased page's last (lease) reference: only confirm or expiry does.
        pages = [p for p in sorted(self.refs) if self.refs[p] > 1 or p not in self.leased]
        page = data.draw(st.sampled_from(pages))
        self._drop(page, self.allocator.decref(page))

    @rule(dt=st.floats(0, LEASE_S * 1.5))
    def advance_and_expire(self, dt: float) -> None:
        self.now += dt
        expired = self.allocator.expire(self.now)
        assert set(expired) <= self.leased
        for page in expired:
            self.leased.discard(page)
            del self.refs[page]

    def _drop(self, page: int, freed: bool) -> None:
        self.refs[page] -= 1
        assert freed == (self.refs[page] == 0)
        if freed:
            del self.refs[page]

    @invariant()
    def live_pages_are_disjoint_and_inside_the_buffer(self) -> None:
        ranges = sorted(
            (self.allocator.offset(p), self.allocator.offset(p) + PAGE_BYTES) for p in self.refs
        )
        for (_, end), (start, _) in itertools.pairwise(ranges):
            assert end <= start
        assert all(start >= 0 and end <= NUM_PAGES * PAGE_BYTES for start, end in ranges)

    @invariant()
    def counts_match_the_model(self) -> None:
        assert self.allocator.used_pages == len(self.refs)
        assert self.allocator.free_pages == NUM_PAGES - len(self.refs)
        assert self.allocator.leased_pages == len(self.leased)
        for page in range(NUM_PAGES):
            expected = (
                PageState.FREE
                if page not in self.refs
                else PageState.LEASED
                if page in self.leased
                else PageState.LIVE
            )
            assert self.allocator.state(page) is expected

    def teardown(self) -> None:
        for page in list(self.leased):
            self.leased.discard(page)
            self._drop(page, self.allocator.confirm(page))
        for page, count in list(self.refs.items()):
            for _ in range(count):
                self.allocator.decref(page)
        assert self.allocator.used_pages == 0


TestAllocatorProperties = AllocatorMachine.TestCase
TestAllocatorProperties.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_lease_takes_back_an_unconfirmed_page_whatever_holds_it() -> None:
    allocator = PageAllocator(num_pages=4, page_bytes=8, lease_s=1.0)
    [page] = allocator.allocate(1, now=0.0)
    allocator.incref(page)
    assert allocator.expire(0.5) == []
    assert allocator.expire(1.0) == [page]
    assert allocator.used_pages == 0
    assert allocator.leases_expired == 1


def test_confirmed_page_survives_its_lease() -> None:
    allocator = PageAllocator(num_pages=4, page_bytes=8, lease_s=1.0)
    [page] = allocator.allocate(1, now=0.0)
    allocator.incref(page)
    assert allocator.confirm(page) is False
    assert allocator.expire(5.0) == []
    assert allocator.decref(page) is True
    assert allocator.used_pages == 0


def test_reallocated_page_is_not_expired_by_its_old_lease() -> None:
    allocator = PageAllocator(num_pages=1, page_bytes=8, lease_s=1.0)
    [page] = allocator.allocate(1, now=0.0)
    allocator.confirm(page)
    [again] = allocator.allocate(1, now=0.9)
    assert again == page
    assert allocator.expire(1.5) == []
    assert allocator.expire(1.9) == [page]


def test_allocation_is_all_or_nothing() -> None:
    allocator = PageAllocator(num_pages=4, page_bytes=8, lease_s=None)
    allocator.allocate(3, now=0.0)
    with pytest.raises(BufferFull) as full:
        allocator.allocate(2, now=0.0)
    assert full.value.retry_after_s > 0
    assert allocator.free_pages == 1


def test_misuse_is_refused() -> None:
    allocator = PageAllocator(num_pages=2, page_bytes=8, lease_s=None)
    with pytest.raises(ValueError):
        allocator.decref(0)
    with pytest.raises(IndexError):
        allocator.offset(2)
    [page] = allocator.allocate(1, now=0.0)
    with pytest.raises(ValueError):
        allocator.confirm(page)
