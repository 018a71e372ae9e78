"""Pools whose members change while the proxy serves: instances a cluster engine adds, restarts
on new addresses, or drains away.

A ``MemberSource`` (Ray's pools controller, ``ray_pools.py``) says who serves now; ``Membership``
asks it every ``interval_s`` and makes the proxy's pools equal to the answer, keeping the
``Upstream`` of an instance that stays (its outstanding count, its health), adding new ones and
taking out those gone. With each question it reports how many requests the proxy still has at
every instance, those taken out included, so that the engine stops a draining instance only when
nothing of this proxy is left on it. Everything here runs on the proxy's event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Annotated, Literal, Protocol

import msgspec

from lmcache_pd.protocol import Port, RankPorts
from lmcache_pd.proxy.config import KVEventsAddress
from lmcache_pd.proxy.routing import Periodic, Pool, Role, Upstream

logger = logging.getLogger(__name__)

# The proxy's question: requests it has in flight per instance URL.
Outstanding = dict[str, int]


class Member(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One instance that takes requests now."""

    name: str
    role: Literal["prefill", "decode"]
    url: Annotated[str, msgspec.Meta(pattern=r"^https?://[^/]+$")]
    # Decode only: where its connector receives KV (the DisaggSpec prefill is told).
    receiver_host: str | None = None
    init_port: Port | RankPorts | None = None
    alloc_port: Port | RankPorts | None = None
    # Where it publishes its KV events, for the proxy's KV routing (None: it does not).
    kv_events: KVEventsAddress | None = None

    @property
    def receiver(self) -> tuple[str, int | list[int], int | list[int]] | None:
        if self.receiver_host is None or self.init_port is None or self.alloc_port is None:
            return None
        return (self.receiver_host, self.init_port, self.alloc_port)


class MemberSource(Protocol):
    """Who serves now; raises on failure (the proxy then keeps what it had). Asked every
    ``interval_s``."""

    interval_s: float

    async def members(self, outstanding: Outstanding) -> list[Member]: ...


class Membership:
    """Keeps ``pools`` equal to what ``source`` says, every ``interval_s``."""

    def __init__(
        self,
        source: MemberSource,
        pools: dict[Role, Pool],
        on_failure: Callable[[], None],
        on_leave: Callable[[Upstream], None] = lambda _: None,
    ) -> None:
        """``on_failure``: the source did not answer; ``on_leave``: an instance left its pool
        (what is kept of it, its metrics series, can go)."""
        self._source = source
        self._on_leave = on_leave
        self._pools = pools
        self._interval_s = source.interval_s
        self._on_failure = on_failure
        # Taken out of their pool with requests still running there: reported until idle.
        self._leaving: dict[str, Upstream] = {}
        self._failing = False
        self.periodic = Periodic("membership", self.refresh, source.interval_s)

    def outstanding(self) -> Outstanding:
        """Requests in flight per instance, those of instances taken out included."""
        counts = {m.url: m.outstanding for pool in self._pools.values() for m in pool.members}
        self._leaving = {url: m for url, m in self._leaving.items() if m.outstanding}
        return counts | {url: m.outstanding for url, m in self._leaving.items()}

    async def refresh(self) -> bool:
        """One question to the source and its answer applied; False if the source failed (the
        pools stay as they were, logged once per failing spell)."""
        try:
            async with asyncio.timeout(max(self._interval_s, 5.0)):  # not wait_for: task_stop.py
                members = await self._source.members(self.outstanding())
        except Exception as exc:  # whatever the engine raised: keep serving on what we have
            self._on_failure()
            if not self._failing:
                logger.warning("cannot learn the pools' members (keeping the last known): %r", exc)
            self._failing = True
            return False
        if self._failing:
            logger.info("pools' members known again")
        self._failing = False
        for role, pool in self._pools.items():
            self._apply(pool, [m for m in members if m.role == role.value])
        return True

    def _apply(self, pool: Pool, members: list[Member]) -> None:
        wanted = {member.url: member for member in members}
        # An instance back on its address with other KV or event ports is another instance.
        current = {
            upstream.url: upstream
            for upstream in pool.members
            if upstream.url in wanted
            and wanted[upstream.url].receiver == upstream.receiver
            and wanted[upstream.url].kv_events == upstream.kv_events
        }
        kept = list(current.values())
        for upstream in pool.members:
            url = upstream.url
            if current.get(url) is not upstream:
                logger.info("%s instance %s left the pool", pool.role.value, url)
                self._on_leave(upstream)
                if upstream.outstanding:
                    self._leaving[url] = upstream
        for url, member in wanted.items():
            if url not in current:
                logger.info("%s instance %s (%s) joined", pool.role.value, url, member.name)
                kept.append(Upstream(url, pool.role, member.receiver, member.kv_events))
        if kept != pool.members:
            pool.replace(kept)
