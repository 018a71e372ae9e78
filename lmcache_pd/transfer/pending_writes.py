"""Allocations on a consumer rank whose pages wait for the producer's WriteDone."""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_pd.transfer.owned_mapping import OwnedMapping


@dataclass(frozen=True, slots=True)
class PendingWrite:
    """An allocation whose pages wait for the producer's WriteDone."""

    req_id: str
    pages: tuple[int, ...]


class PendingWrites(OwnedMapping[int, PendingWrite]):
    """The write each allocation id waits for, until it is confirmed, cancelled or lapses."""

    def __init__(self) -> None:
        super().__init__()

    def add(self, alloc_id: int, write: PendingWrite) -> None:
        self._entries[alloc_id] = write

    def of(self, alloc_id: int, req_id: str) -> PendingWrite | None:
        """The write ``alloc_id`` waits for if it is ``req_id``'s, else None (a peer's message
        names both: one that does not match is refused)."""
        write = self._entries.get(alloc_id)
        return write if write is not None and write.req_id == req_id else None

    def ids_of(self, req_id: str) -> list[int]:
        """The allocations of ``req_id`` still waiting for their writes."""
        return [alloc_id for alloc_id, write in self._entries.items() if write.req_id == req_id]

    def take(self, alloc_id: int) -> PendingWrite:
        """The write ``alloc_id`` waited for, no longer pending (it landed, or never will)."""
        return self._entries.pop(alloc_id)

    def discard(self, alloc_id: int) -> PendingWrite | None:
        """Like ``take``, for an id that may have no write pending."""
        return self._entries.pop(alloc_id, None)
