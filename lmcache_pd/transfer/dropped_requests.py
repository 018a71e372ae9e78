"""Requests a consumer rank let go (released, lapsed or abandoned), remembered a while.

A request let go is remembered for ``dropped_memory_s`` so that its late pushes are refused
instead of holding pages again, and a decode that claims it hears why its KV will not come. At
most ``max_entries`` are remembered: any peer of the alloc port can let go of request ids it
makes up, so beyond that the oldest are forgotten early (a late push of one of them may then
hold pages again, until its claim deadline).
"""

from __future__ import annotations

import logging
from collections import deque

from lmcache_pd.protocol import MAX_DROPPED_REQUESTS
from lmcache_pd.transfer.consumer_stats import LimitCounts
from lmcache_pd.transfer.owned_mapping import OwnedMapping

logger = logging.getLogger(__name__)


class DroppedRequests(OwnedMapping[str, str]):
    """Why each request was let go, by request id, until ``memory_s`` after, or until
    ``max_entries`` later ones pushed it out."""

    def __init__(
        self, memory_s: float, counts: LimitCounts, max_entries: int = MAX_DROPPED_REQUESTS
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"need max_entries >= 1, got {max_entries}")
        self._memory_s = memory_s
        self._max_entries = max_entries
        self._counts = counts
        # Whether requests are being forgotten early (logged once each time it starts).
        self._overflowing = False
        super().__init__()
        # When each is forgotten, in the order they were let go (which is that order too).
        self.forget_at: deque[tuple[float, str]] = deque()

    def remember(self, req_id: str, reason: str, now: float) -> None:
        """``req_id`` was let go for ``reason``; idempotent: the first reason stays."""
        if req_id in self._entries:
            return
        if len(self._entries) >= self._max_entries:
            self._forget_oldest(req_id)
        self._entries[req_id] = reason
        self.forget_at.append((now + self._memory_s, req_id))

    def forget_lapsed(self, now: float) -> None:
        """Forget the requests let go ``memory_s`` or longer before ``now``."""
        while self.forget_at and self.forget_at[0][0] <= now:
            _, req_id = self.forget_at.popleft()
            self._entries.pop(req_id, None)
        if self._overflowing and len(self._entries) < self._max_entries:
            self._overflowing = False

    def _forget_oldest(self, newcomer: str) -> None:
        _, req_id = self.forget_at.popleft()
        del self._entries[req_id]
        self._counts.dropped_forgotten_early += 1
        if not self._overflowing:
            self._overflowing = True
            logger.warning(
                "req %s: %d requests let go are remembered already: the oldest are forgotten "
                "early from now on (their late pushes may hold pages again until their claim "
                "deadline)",
                newcomer,
                self._max_entries,
            )
