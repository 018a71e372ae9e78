"""Which pages each request holds on a consumer rank, and when each hold lapses.

A request holds every chunk it asked room for, written by it or already there, until it is
released or its hold lapses: ``claim_s`` after its last allocation until a decode claims it (its
KV may never be wanted: the client left, or decode computed the prompt itself), ``hold_s`` once
claimed. The pages' own side of a hold (their holders, their references) is ``ChunkStore``'s.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass

from lmcache_pd.transfer.owned_mapping import OwnedMapping
from lmcache_pd.transfer.producer_shares import ProducerId

# Stale entries (of holds renewed or let go) the deadline heap may hold beyond one per hold
# before it is rebuilt: a peer renewing one hold again and again must not grow it.
STALE_DEADLINES = 1024


@dataclass(slots=True)
class Hold:
    """The pages one request holds, when the hold lapses if never released, and the producer
    whose allocation made it (pages it holds count towards that producer's share until a
    decode claims it)."""

    pages: set[int]
    deadline: float
    producer: ProducerId


class Holds(OwnedMapping[str, Hold]):
    """The hold of each request, the requests a decode claimed, and the chunks each claimed
    request's decode does not need."""

    def __init__(self, *, claim_s: float, hold_s: float) -> None:
        if not 0 < claim_s <= hold_s:
            raise ValueError(f"need 0 < claim_s <= hold_s, got {claim_s=} {hold_s=}")
        self._claim_s = claim_s
        self._hold_s = hold_s
        super().__init__()
        # A heap: holds have two lengths (claimed or not), so deadlines come out of order. A
        # renewed hold's old entry stays in it and is skipped when it comes up.
        self.deadlines: list[tuple[float, str]] = []
        self.claimed: set[str] = set()
        # Per claimed request, chunk keys its decode has in its own cache: never written for it.
        self._not_needed: dict[str, frozenset[bytes]] = {}

    def hold(self, req_id: str, now: float, producer: ProducerId) -> Hold:
        """The request's hold, made (as ``producer``'s) or extended; a later AllocRequest of it
        renews the deadline."""
        deadline = now + (self._hold_s if req_id in self.claimed else self._claim_s)
        hold = self._entries.get(req_id)
        if hold is None:
            hold = self._entries[req_id] = Hold(set(), deadline, producer)
            self._push_deadline(deadline, req_id)
        else:
            self._renew(hold, req_id, deadline)
        return hold

    def claim(self, req_id: str, now: float, not_needed: frozenset[bytes]) -> Hold | None:
        """A decode will load ``req_id``: its hold lasts ``hold_s`` from now on, and chunks in
        ``not_needed`` are never written for it. Returns its hold, if it has one yet."""
        self.claimed.add(req_id)
        if not_needed:
            self._not_needed[req_id] = not_needed
        hold = self._entries.get(req_id)
        if hold is not None:
            self._renew(hold, req_id, now + self._hold_s)
        return hold

    def not_needed(self, req_id: str) -> frozenset[bytes]:
        """Chunk keys the decode that claimed ``req_id`` has already."""
        return self._not_needed.get(req_id, frozenset())

    def knows(self, req_id: str) -> bool:
        """Whether ``req_id`` holds pages or was claimed."""
        return req_id in self._entries or req_id in self.claimed

    def unclaimed(self) -> Iterator[tuple[str, Hold]]:
        """The holds of requests no decode has claimed yet."""
        return (
            (req_id, hold) for req_id, hold in self._entries.items() if req_id not in self.claimed
        )

    def let_go(self, req_id: str) -> Hold | None:
        """Forget ``req_id``'s claim and hold; returns the hold, whose pages the caller lets go."""
        self.claimed.discard(req_id)
        self._not_needed.pop(req_id, None)
        return self._entries.pop(req_id, None)

    def next_lapsed(self, now: float) -> str | None:
        """A request whose hold lapsed by ``now``, None when no other did. Holds lapse in the
        order of their deadlines; the caller lets each go before asking for the next."""
        while self.deadlines and self.deadlines[0][0] <= now:
            deadline, req_id = heapq.heappop(self.deadlines)
            hold = self._entries.get(req_id)
            # Only at its current deadline's own entry (an older one is stale).
            if hold is not None and hold.deadline == deadline:
                return req_id
        return None

    def _renew(self, hold: Hold, req_id: str, deadline: float) -> None:
        hold.deadline = deadline
        self._push_deadline(deadline, req_id)

    def _push_deadline(self, deadline: float, req_id: str) -> None:
        heapq.heappush(self.deadlines, (deadline, req_id))
        if len(self.deadlines) > len(self._entries) + STALE_DEADLINES:
            self.deadlines = [(held.deadline, held_id) for held_id, held in self._entries.items()]
            heapq.heapify(self.deadlines)
