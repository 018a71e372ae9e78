"""How much of a consumer rank's buffer each producer holds, and the share it may hold while
another producer waits for room.

A producer is known by its connection to the alloc port (``ProducerId``: the routing id ZMQ
gives that connection). A page counts towards a producer while it waits for that producer's
write, or while a request that producer allocated for holds it and no decode has claimed that
request yet; pages reserved ahead count towards the producer they were reserved for. A page
held by requests of two producers counts towards both. Once a decode claims a request, its pages
are that decode's, and count towards nobody.

Alone, a producer may fill the buffer. Once a producer is refused an allocation for room, it
waits, until it is given room or ``SHARE_ENFORCED_S`` has passed; while any producer waits,
every other one is held to ``max_share`` of the buffer: one producer (or a peer posing as one)
cannot keep the rest from it.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from lmcache_pd.errors import BufferFull
from lmcache_pd.protocol import BUFFER_FULL_RETRY_AFTER_S, SHARE_ENFORCED_S
from lmcache_pd.transfer.consumer_stats import LimitCounts

# A producer's connection to the alloc port, as the consumer's ROUTER socket names it.
ProducerId = bytes
# The producer of callers that know of only one (the chunk store's own tests).
ONE_PRODUCER: ProducerId = b""
# Producers remembered as waiting for room at once (the longest waiting are forgotten first).
MAX_WAITING = 64

_NOBODY: frozenset[ProducerId] = frozenset()


class ProducerShares:
    """Pages counted per producer, and who was refused for room lately; the chunk store tells
    it what each page counts towards whenever that may change."""

    def __init__(self, num_pages: int, max_share: float, counts: LimitCounts) -> None:
        if not 0 < max_share <= 1:
            raise ValueError(f"need 0 < max_share <= 1, got {max_share}")
        self._num_pages = num_pages
        self._max_pages = max(1, int(num_pages * max_share))
        self._counts = counts
        self._owners: dict[int, frozenset[ProducerId]] = {}
        self._pages: Counter[ProducerId] = Counter()
        # Producers refused for room and not served since, and when, the earliest first.
        self._waiting: OrderedDict[ProducerId, float] = OrderedDict()

    def pages_of(self, producer: ProducerId) -> int:
        """Pages counted towards ``producer`` (those reserved ahead are the caller's to add)."""
        return self._pages[producer]

    def count(self, page: int, owners: frozenset[ProducerId]) -> None:
        """``page`` counts towards ``owners`` from now on (none: it is freed, idle, or a
        decode's)."""
        before = self._owners.pop(page, _NOBODY)
        if owners:
            self._owners[page] = owners
        for producer in before - owners:
            self._pages[producer] -= 1
            if not self._pages[producer]:
                del self._pages[producer]
        for producer in owners - before:
            self._pages[producer] += 1

    def refused_for_room(self, producer: ProducerId, now: float) -> None:
        """``producer`` was refused an allocation because the buffer is full: it waits."""
        self._waiting.pop(producer, None)
        self._waiting[producer] = now
        while len(self._waiting) > MAX_WAITING:
            self._waiting.popitem(last=False)

    def served(self, producer: ProducerId) -> None:
        """``producer`` was given room: it no longer waits."""
        self._waiting.pop(producer, None)

    def check(self, producer: ProducerId, held: int, more: int, now: float) -> None:
        """Raise ``BufferFull`` if ``producer``, holding ``held`` pages, may not take ``more``:
        it would go past its share while another producer waits for room."""
        if held + more <= self._max_pages or not self._another_waits(producer, now):
            return
        self._counts.refused_producer_share += 1
        raise BufferFull(
            f"this producer holds {held} of {self._num_pages} pages and asks {more} more, while "
            f"another producer waits for room: at most {self._max_pages} (max_producer_share)",
            BUFFER_FULL_RETRY_AFTER_S,
        )

    def _another_waits(self, producer: ProducerId, now: float) -> bool:
        while self._waiting and now - next(iter(self._waiting.values())) >= SHARE_ENFORCED_S:
            self._waiting.popitem(last=False)
        return any(waiting != producer for waiting in self._waiting)
