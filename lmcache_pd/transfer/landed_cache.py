"""Landed chunks a consumer rank keeps after their requests, evicted least recently used first.

With ``cache_pages`` > 0, a confirmed write's lease reference becomes the cache's own, so a page
nobody holds any more keeps its chunk, and a later request whose prompt shares it is answered
"already held" instead of having it written again. Such idle pages are evicted, least recently
used first, only when an allocation needs their room or more than ``cache_pages`` of them are
idle; a page a request holds or a write still leases is never evicted.
"""

from __future__ import annotations

from collections import OrderedDict

from lmcache_pd.transfer.allocator import PageAllocator
from lmcache_pd.transfer.consumer_stats import CacheCounts


class LandedCache:
    """The landed pages holding the cache's reference, and the idle ones among them.

    Methods that evict return the pages evicted: freed, their chunks gone, for the caller to
    forget."""

    def __init__(self, allocator: PageAllocator, cache_pages: int, counts: CacheCounts) -> None:
        if cache_pages < 0:
            raise ValueError(f"need cache_pages >= 0, got {cache_pages}")
        self._allocator = allocator
        self._cache_pages = cache_pages
        self._counts = counts
        self._cached: set[int] = set()
        # The cached pages nobody holds, oldest use first: the order of eviction.
        self.idle: OrderedDict[int, None] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self._cache_pages > 0

    def keep(self, page: int, *, held: bool) -> list[int]:
        """The write into leased ``page`` landed: its lease's reference becomes the cache's; it
        is idle at once unless ``held``."""
        self._allocator.confirm(page, keep=True)
        self._cached.add(page)
        return [] if held else self.unheld(page)

    def held(self, page: int) -> None:
        """A request holds ``page`` from now on: not idle, whether cached or not."""
        self.idle.pop(page, None)

    def unheld(self, page: int) -> list[int]:
        """Nobody holds ``page`` any more: if cached, it is the most recently used idle page,
        and the oldest go while more than ``cache_pages`` are idle."""
        if page not in self._cached:
            return []
        self.idle[page] = None
        evicted = []
        while len(self.idle) > self._cache_pages:
            evicted.append(self._evict(next(iter(self.idle))))
        return evicted

    def drop(self, page: int) -> list[int]:
        """Nobody holds ``page`` any more and its request asked to keep nothing: if cached, it
        leaves the cache at once, freed (counted ``not_kept``)."""
        if page not in self._cached:
            return []
        self._cached.discard(page)
        self._counts.not_kept += 1
        freed = self._allocator.decref(page)  # the cache's reference was the last
        assert freed, f"dropped page {page} is still referenced"
        return [page]

    def make_room(self, needed: int, keep: set[int]) -> list[int]:
        """Evict idle pages, oldest first and none of ``keep``, until ``needed`` pages are free;
        none at all if that would still not be enough (the allocation is refused)."""
        short = needed - self._allocator.free_pages
        if short <= 0:
            return []
        victims = [page for page in self.idle if page not in keep][:short]
        if len(victims) < short:
            return []
        return [self._evict(page) for page in victims]

    def _evict(self, page: int) -> int:
        del self.idle[page]
        self._cached.discard(page)
        self._counts.evictions += 1
        freed = self._allocator.decref(page)  # the cache's reference was the last
        assert freed, f"evicted page {page} is still referenced"
        return page
