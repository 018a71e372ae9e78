"""What each used page of a consumer rank's buffer holds, and the pages that stand for each key.

A key may name several pages at once: two requests whose prompts share a prefix can each be
writing that chunk (neither write may be trusted to land for the other), and whichever lands
first serves both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmcache_pd.transfer.allocator import PageAllocator, PageState
from lmcache_pd.transfer.owned_mapping import OwnedMapping
from lmcache_pd.transfer.producer_shares import ProducerId
from lmcache_pd.transfer.receive_buffer import LandedChunk


@dataclass(slots=True)
class PageInfo:
    """What a used page holds, the producer that writes (or wrote) it, and the request it was
    written for (``pushed_for``). ``uncached``: that request asked to keep nothing and let go of
    it: it leaves the cache once nobody holds it (at once, or when its write lands)."""

    key: bytes
    nbytes: int
    alloc_id: int
    writer: ProducerId
    holders: set[str] = field(default_factory=set)
    checksum: int | None = None
    pushed_for: str | None = None
    uncached: bool = False


class PageTable(OwnedMapping[int, PageInfo]):
    """The chunk of each used page, by page, and the pages of each key; landed or not is the
    allocator's to say."""

    def __init__(self, allocator: PageAllocator) -> None:
        self._allocator = allocator
        super().__init__()
        self.pages_of_key: dict[bytes, set[int]] = {}

    def add(self, page: int, info: PageInfo) -> None:
        """``page`` stands for ``info.key`` from now on."""
        self.pages_of_key.setdefault(info.key, set()).add(page)
        self._entries[page] = info

    def live_page(self, key: bytes) -> int | None:
        """A page where the chunk with ``key`` landed, None if none."""
        for page in self.pages_of_key.get(key, ()):
            if self._allocator.state(page) is PageState.LIVE:
                return page
        return None

    def landed(self, key: bytes, among: set[int] | frozenset[int] | None) -> LandedChunk | None:
        """The chunk with ``key`` where it landed (in one of the pages ``among``, if given)."""
        for page in self.pages_of_key.get(key, ()):
            if among is not None and page not in among:
                continue
            if self._allocator.state(page) is PageState.LIVE:
                info = self._entries[page]
                return LandedChunk(page, info.nbytes, info.checksum)
        return None

    def unkey(self, page: int) -> None:
        """``page`` no longer stands for its key (its write was cancelled, or it is freed)."""
        key = self._entries[page].key
        pages = self.pages_of_key.get(key)
        if pages is not None:
            pages.discard(page)
            if not pages:
                del self.pages_of_key[key]

    def forget(self, page: int) -> None:
        """``page`` is freed: it holds nothing."""
        self.unkey(page)
        del self._entries[page]
