"""Pages of a registered buffer: O(1) allocate and free, reference counts, and write leases.

The buffer itself (and its NIXL registration) belongs to its owner; this module only decides which
page goes to whom. A page is handed out with one reference, the allocation's own. With a lease,
that reference is held until the write into the page is confirmed (so a reader who lets go early
cannot have the page reused under a write still in flight), and if no confirmation comes within
``lease_s`` the page is taken back whatever else holds it: a producer that allocates and vanishes
leaks nothing. Not thread-safe: the owner serialises calls.
"""

from __future__ import annotations

import enum
import logging
from collections import deque

from lmcache_pd import protocol
from lmcache_pd.errors import AllocationError, BufferFull

logger = logging.getLogger(__name__)


class PageState(enum.Enum):
    FREE = "free"
    LEASED = "leased"  # handed out, the write into it not yet confirmed
    LIVE = "live"  # its write was confirmed


class PageAllocator:
    """Equal pages of ``page_bytes`` carved from a buffer of ``num_pages * page_bytes`` bytes."""

    def __init__(self, *, num_pages: int, page_bytes: int, lease_s: float | None) -> None:
        if num_pages < 1 or page_bytes < 1 or (lease_s is not None and lease_s <= 0):
            raise ValueError(f"bad allocator shape: {num_pages=} {page_bytes=} {lease_s=}")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.lease_s = lease_s
        self._free: deque[int] = deque(range(num_pages))
        self._state = [PageState.FREE] * num_pages
        self._refs = [0] * num_pages
        # Bumped on every allocation so that a lease entry of an earlier life is recognised.
        self._generation = [0] * num_pages
        # All leases last lease_s, so appending keeps this ordered by deadline.
        self._leases: deque[tuple[float, int, int]] = deque()
        self._leased = 0
        self.leases_expired = 0

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def offset(self, page: int) -> int:
        """Byte offset of ``page`` in the buffer."""
        self._check_page(page)
        return page * self.page_bytes

    def state(self, page: int) -> PageState:
        self._check_page(page)
        return self._state[page]

    def allocate(self, count: int, now: float) -> list[int]:
        """``count`` pages with one reference each (leased if this allocator has leases), or
        none at all.

        Raises ``AllocationError`` if the buffer can never hold ``count`` pages and ``BufferFull``
        if it cannot right now.
        """
        if count > self.num_pages:
            raise AllocationError(f"{count} pages asked, the buffer has {self.num_pages} in all")
        if count > len(self._free):
            raise BufferFull(
                f"{count} pages asked, {len(self._free)} of {self.num_pages} free",
                retry_after_s=protocol.BUFFER_FULL_RETRY_AFTER_S,
            )
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self._refs[page] = 1
            self._generation[page] += 1
            self._state[page] = PageState.LIVE
        if self.lease_s is not None:
            deadline = now + self.lease_s
            for page in pages:
                self._state[page] = PageState.LEASED
                self._leases.append((deadline, page, self._generation[page]))
            self._leased += count
            if len(self._leases) > 2 * self.num_pages:
                self._drop_stale_leases()
        return pages

    def confirm(self, page: int, *, keep: bool = False) -> bool:
        """End a page's lease because its write landed or will never come. The lease's reference
        is dropped (the page stays while others hold it; returns True when nobody did and the
        page was freed), or with ``keep`` handed to the caller (a cache of landed pages)."""
        if self.state(page) is not PageState.LEASED:
            raise ValueError(f"page {page} is {self._state[page].value}, not leased")
        self._state[page] = PageState.LIVE
        self._leased -= 1
        return False if keep else self.decref(page)

    def incref(self, page: int) -> None:
        if self.state(page) is PageState.FREE:
            raise ValueError(f"page {page} is free")
        self._refs[page] += 1

    def decref(self, page: int) -> bool:
        """Drop one reference; returns True when that freed the page."""
        if self.state(page) is PageState.FREE:
            raise ValueError(f"page {page} is already free")
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._release(page)
            return True
        return False

    def free(self, page: int) -> None:
        """Free ``page`` now whatever its references: the owner knows nothing in it is of use
        (its write was cancelled) and has forgotten every holder."""
        if self.state(page) is PageState.FREE:
            raise ValueError(f"page {page} is already free")
        self._release(page)

    def expire(self, now: float) -> list[int]:
        """Free every leased page whose write was not confirmed in time, whatever its references;
        returns them so that the owner can forget whoever held them."""
        expired: list[int] = []
        while self._leases and self._leases[0][0] <= now:
            _, page, generation = self._leases.popleft()
            if generation == self._generation[page] and self._state[page] is PageState.LEASED:
                self._release(page)
                expired.append(page)
        self.leases_expired += len(expired)
        return expired

    @property
    def leased_pages(self) -> int:
        """Pages still waiting for their write (the owner then polls for notifications often)."""
        return self._leased

    def _drop_stale_leases(self) -> None:
        """Forget lease entries of pages confirmed or freed since: at most one entry per page
        stays, so pages allocated and cancelled again and again do not grow the queue. Order
        (by deadline) is kept."""
        self._leases = deque(
            (deadline, page, generation)
            for deadline, page, generation in self._leases
            if generation == self._generation[page] and self._state[page] is PageState.LEASED
        )

    def _release(self, page: int) -> None:
        if self._state[page] is PageState.LEASED:
            self._leased -= 1
        self._state[page] = PageState.FREE
        self._refs[page] = 0
        self._free.append(page)

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside 0..{self.num_pages - 1}")
