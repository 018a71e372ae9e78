"""Pages a consumer rank reserved ahead for producers, tied to no key, until written or lapsed.

A producer may hold such pages so that a small push writes at once and says afterwards where each
chunk went (``ChunkStore.land_reserved``). Unwritten, they go back ``RESERVED_LEASE_S`` after they
were handed out. The producer's side of them is ``reservations.py``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator, Mapping

from lmcache_pd.errors import BufferFull
from lmcache_pd.protocol import BUFFER_FULL_RETRY_AFTER_S, RESERVED_FRESH_S, RESERVED_LEASE_S
from lmcache_pd.transfer.allocator import PageAllocator
from lmcache_pd.transfer.producer_shares import ProducerId


class ReservedPages(Mapping[int, set[int]]):
    """The unwritten pages of each reservation by its id, the producer it is for, the way back,
    and when each reservation lapses."""

    def __init__(self, allocator: PageAllocator, reserve_share: float) -> None:
        self._allocator = allocator
        self._reserved: dict[int, set[int]] = {}
        self.reservation_of: dict[int, int] = {}
        self.producer_of: dict[int, ProducerId] = {}  # by reservation
        self._pages_of_producer: Counter[ProducerId] = Counter()
        # When each reservation lapses, in the order they were handed out (which is that order).
        self._reserved_until: deque[tuple[float, int]] = deque()
        self._max_reserved = max(1, int(allocator.num_pages * reserve_share))
        self._last_reserved_at = float("-inf")

    def __getitem__(self, reservation_id: int) -> set[int]:
        return self._reserved[reservation_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._reserved)

    def __len__(self) -> int:
        return len(self._reserved)

    @property
    def page_count(self) -> int:
        """Pages reserved and not written yet."""
        return len(self.reservation_of)

    def pages_of(self, producer: ProducerId) -> int:
        """Pages reserved for ``producer`` and not written yet."""
        return self._pages_of_producer[producer]

    def fresh(self, now: float) -> bool:
        """Whether pages are reserved and some were handed out within ``RESERVED_FRESH_S`` (a
        producer writes into them only that soon)."""
        return bool(self.reservation_of) and now - self._last_reserved_at < RESERVED_FRESH_S

    def room_for(self, count: int) -> int:
        """How many of ``count`` pages may be reserved now: fewer when more would take over
        ``reserve_share`` of the buffer (many producers may not starve allocations);
        ``BufferFull`` when none."""
        count = min(count, self._max_reserved - len(self.reservation_of))
        if count < 1:
            raise BufferFull(
                f"{len(self.reservation_of)} pages reserved ahead already, at most "
                f"{self._max_reserved}",
                BUFFER_FULL_RETRY_AFTER_S,
            )
        return count

    def add(self, reservation_id: int, pages: list[int], now: float, producer: ProducerId) -> None:
        """``pages`` were just allocated and handed out to ``producer`` as reservation
        ``reservation_id``."""
        self._last_reserved_at = now
        self._reserved[reservation_id] = set(pages)
        self.producer_of[reservation_id] = producer
        self._pages_of_producer[producer] += len(pages)
        self._reserved_until.append((now + RESERVED_LEASE_S, reservation_id))
        if len(self._reserved_until) > 2 * len(self._reserved) + self._max_reserved:
            # Reservations given back early leave their entries: a producer reserving and
            # cancelling again and again must not grow the queue. Order is kept.
            self._reserved_until = deque(
                entry for entry in self._reserved_until if entry[1] in self._reserved
            )
        for page in pages:
            self.reservation_of[page] = reservation_id

    def is_reserved(self, page: int) -> bool:
        return page in self.reservation_of

    def leave(self, page: int) -> None:
        """``page`` is no longer reserved ahead (written into, or freed by its lease)."""
        reservation_id = self.reservation_of.pop(page)
        reserved = self._reserved[reservation_id]
        reserved.discard(page)
        self._uncount(reservation_id, 1)
        if not reserved:
            del self._reserved[reservation_id]
            del self.producer_of[reservation_id]

    def give_back(self, reservation_id: int) -> None:
        """Free the unwritten pages of a reservation (given back, or lapsed)."""
        pages = self._reserved.pop(reservation_id, set())
        if pages:
            self._uncount(reservation_id, len(pages))
            del self.producer_of[reservation_id]
        for page in pages:
            del self.reservation_of[page]
            self._allocator.free(page)

    def give_back_lapsed(self, now: float) -> None:
        """Free the unwritten pages of reservations handed out ``RESERVED_LEASE_S`` or longer
        before ``now``."""
        while self._reserved_until and self._reserved_until[0][0] <= now:
            self.give_back(self._reserved_until.popleft()[1])

    def _uncount(self, reservation_id: int, pages: int) -> None:
        producer = self.producer_of[reservation_id]
        self._pages_of_producer[producer] -= pages
        if not self._pages_of_producer[producer]:
            del self._pages_of_producer[producer]
