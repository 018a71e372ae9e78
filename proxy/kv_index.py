"""The proxy's KV index: one event feed per instance that publishes, kept equal to the pools.

``held_tokens(member, keys)`` says how many leading tokens of a prompt an instance's
prefix cache holds, as far as its events told; ``landed_after`` how far its landed chunks
carry on from there. The feeds follow the pools: an instance that
joins (a cluster engine added it, or it came back on a new address) gets a feed, and one that
leaves loses its feed and its entries. Everything here runs on the proxy's event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator

import zmq.asyncio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lmcache_pd.auth import DeploymentKeys
from lmcache_pd.proxy.config import KVEventsAddress
from lmcache_pd.proxy.kv_feed import EventFeed
from lmcache_pd.proxy.prefix_index import InstanceCaches
from lmcache_pd.proxy.routing import Periodic, Upstream

logger = logging.getLogger(__name__)

# How often the feeds are matched to the pools' members.
SYNC_INTERVAL_S = 2.0


class KVIndex:
    """Feeds and indexes of every instance that publishes KV events."""

    def __init__(
        self,
        upstreams: Callable[[], Iterable[Upstream]],
        keys: DeploymentKeys | None,
        max_blocks: int,
    ) -> None:
        self._upstreams = upstreams
        self._keys = keys
        self._max_blocks = max_blocks
        self._context = zmq.asyncio.Context()
        self._feeds: dict[tuple[str, KVEventsAddress], EventFeed] = {}
        self.counts: dict[str, int] = {}
        self.periodic = Periodic("kv-index", self.sync, SYNC_INTERVAL_S)

    @property
    def empty(self) -> bool:
        """No instance's index holds a block (nothing to route by)."""
        return not any(len(feed.blocks) for feed in self._feeds.values())

    async def sync(self) -> None:
        """Start a feed for every instance that publishes and has none, or whose feed ended
        (an error: its index was cleared, and is rebuilt by the new feed's replay); stop those
        of instances gone."""
        wanted = {
            (member.url, member.kv_events): member
            for member in self._upstreams()
            if member.kv_events is not None
        }
        for key in [key for key in self._feeds if key not in wanted]:
            await self._feeds.pop(key).stop()
            logger.info("kv events of %s no longer followed", key[0])
        for key in [key for key, feed in self._feeds.items() if not feed.alive]:
            await self._feeds.pop(key).stop()
            self._count("feed_restarts")
            logger.warning("kv events of %s: its feed ended; following them anew", key[0])
        for key in wanted.keys() - self._feeds.keys():
            url, address = key
            assert address is not None
            feed = EventFeed(
                self._context,
                url,
                address,
                self._keys,
                InstanceCaches(self._max_blocks),
                self._count,
            )
            feed.start()
            self._feeds[key] = feed
            logger.info("following kv events of %s at %s", url, address.endpoint(address.port))

    def held_tokens(self, member: Upstream, keys: Callable[[int], list[bytes]]) -> int:
        """Leading tokens of a prompt that ``member``'s prefix cache holds (0: unknown);
        ``keys(block_size)`` gives the prompt's block keys (``kv_events.prefix_keys``)."""
        feed = self._feeds.get((member.url, member.kv_events))
        if feed is None:
            return 0
        blocks = feed.blocks.prefix
        return blocks.held_tokens(keys(blocks.block_size)) if blocks.block_size else 0

    def holds_last_block(self, member: Upstream, keys: Callable[[int], list[bytes]]) -> bool:
        """Whether ``member``'s prefix cache holds the last full block of a prompt (False:
        unknown, or the prompt has no full block). vLLM stores a prompt's blocks in order, each
        when it schedules the step that computes it, and publishes a step's events once the
        step is done: once the last is there, the prompt is computed."""
        feed = self._feeds.get((member.url, member.kv_events))
        blocks = None if feed is None else feed.blocks.prefix
        if blocks is None or not blocks.block_size:
            return False
        chain = keys(blocks.block_size)
        return bool(chain) and chain[-1] in blocks

    def landed_after(self, member: Upstream, keys: Callable[[int], list[bytes]], start: int) -> int:
        """Where the run of a prompt's chunks landed in ``member``'s consumer ends, from the
        chunk that holds token ``start`` on (``start`` if none): what a decode instance whose
        prefix cache holds ``start`` tokens would load past them, served alone."""
        feed = self._feeds.get((member.url, member.kv_events))
        if feed is None:
            return start
        chunks = feed.blocks.landed
        return chunks.held_after(keys(chunks.block_size), start) if chunks.block_size else start

    async def close(self) -> None:
        for feed in self._feeds.values():
            await feed.stop()
        self._feeds.clear()
        self._context.destroy(linger=0)

    def collector(self) -> Collector:
        return _IndexMetrics(self)

    def _count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def by_instance(self) -> Iterator[tuple[str, InstanceCaches]]:
        for (url, _), feed in self._feeds.items():
            yield url, feed.blocks


class _IndexMetrics(Collector):
    """The index's size per instance and its feeds' counters, read at scrape time."""

    def __init__(self, index: KVIndex) -> None:
        self._index = index

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        prefix = "lmcache_pd_proxy_kv_index"
        blocks = GaugeMetricFamily(
            f"{prefix}_blocks", "Prefix-cache blocks the KV index holds", labels=["instance"]
        )
        size = GaugeMetricFamily(
            f"{prefix}_bytes", "Memory the KV index takes (estimated)", labels=["instance"]
        )
        orphans = CounterMetricFamily(
            f"{prefix}_orphan_blocks",
            "Stored blocks not indexed: their parent's event was never seen",
            labels=["instance"],
        )
        landed = GaugeMetricFamily(
            f"{prefix}_landed_chunks",
            "Chunks landed in a decode instance's consumer that the KV index holds",
            labels=["instance"],
        )
        for url, instance in self._index.by_instance():
            blocks.add_metric([url], len(instance.prefix))
            landed.add_metric([url], len(instance.landed))
            size.add_metric([url], instance.approx_bytes)
            orphans.add_metric([url], instance.orphans)
        events = CounterMetricFamily(
            f"{prefix}_feed_events",
            "KV event feeds: batches applied, malformed batches or events ignored, resyncs "
            "(replays asked), replay_gaps, replay_failures and replays_abandoned (an instance's "
            "index was cleared), restarts and reconnects (an instance's publisher anew), "
            "handshakes_refused (the instance refuses the proxy's secret), feed_errors and "
            "feed_restarts (a feed ended, its index cleared, and was started again)",
            labels=["what"],
        )
        for what, count in sorted(self._index.counts.items()):
            events.add_metric([what], count)
        yield from (blocks, landed, size, orphans, events)
