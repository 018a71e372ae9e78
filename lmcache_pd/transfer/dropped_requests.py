"""Requests a consumer rank let go (released, lapsed or abandoned), remembered a while.

A request let go is remembered for ``dropped_memory_s`` so that its late pushes are refused
instead of holding pages again, and a decode that claims it hears why its KV will not come.
"""

from __future__ import annotations

from collections import deque

from lmcache_pd.transfer.owned_mapping import OwnedMapping


class DroppedRequests(OwnedMapping[str, str]):
    """Why each request was let go, by request id, until ``memory_s`` after."""

    def __init__(self, memory_s: float) -> None:
        self._memory_s = memory_s
        super().__init__()
        # When each is forgotten, in the order they were let go (which is that order too).
        self.forget_at: deque[tuple[float, str]] = deque()

    def remember(self, req_id: str, reason: str, now: float) -> None:
        """``req_id`` was let go for ``reason``; idempotent: the first reason stays."""
        if req_id not in self._entries:
            self._entries[req_id] = reason
            self.forget_at.append((now + self._memory_s, req_id))

    def forget_lapsed(self, now: float) -> None:
        """Forget the requests let go ``memory_s`` or longer before ``now``."""
        while self.forget_at and self.forget_at[0][0] <= now:
            _, req_id = self.forget_at.popleft()
            self._entries.pop(req_id, None)
