"""Worker-side halves of the connector: move KV between vLLM's paged cache and the transfer core.

Producer: at the end of each step (``wait_for_save``) the chunks whose tokens are all computed
are gathered into pages of the staging buffer, so vLLM may free or reuse the blocks at once, and
the sender thread of the request's consumer pushes them (``sender.py``). A request that cannot
be pushed (no staging room, prefill aborted) is abandoned: its consumer is told at once.
Consumer: each step, pending loads whose chunks have all landed are scattered into their blocks
and reported as received; a load whose KV was abandoned, not complete by its deadline, or with a
chunk that fails its checksum, is reported as failed and vLLM recomputes the prompt.
Counters go to a ``StatsRecorder``: vLLM ships them to its own ``/metrics``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import msgspec
import torch

from lmcache_pd.compat import KVProfile
from lmcache_pd.config import PDConfig, replace
from lmcache_pd.connector.metadata import (
    LoadRequest,
    PDConnectorMetadata,
    PushProgress,
    SaveRequest,
)
from lmcache_pd.connector.sender import (
    AbandonJob,
    PushJob,
    Saving,
    SenderPool,
    parse_peer,
)
from lmcache_pd.connector.stats import StatsRecorder
from lmcache_pd.consumer import Consumer
from lmcache_pd.errors import AllocationError, IntegrityError, ProtocolError
from lmcache_pd.kernels.cpu_blocks import CpuKVCache, validate_chunk_size
from lmcache_pd.keys import ChunkKey, ChunkKeyer
from lmcache_pd.producer import Producer
from lmcache_pd.protocol import AbandonReason
from lmcache_pd.staging import Staging
from lmcache_pd.trace import TraceFile

logger = logging.getLogger(__name__)

# Counters of ``ConsumerStats`` that reach /metrics as ``lmcache_pd_consumer_<name>_total``.
CONSUMER_COUNTERS = (
    "chunks_landed",
    "bytes_landed",
    "requests_abandoned",
    "refused_dropped",
    "refused_buffer_full",
    "holds_expired",
    "leases_expired",
    "malformed_messages",
    "internal_errors",
    "service_stalls",
    "cache_hits",
    "cache_misses",
    "cache_evictions",
    "cache_bytes_not_resent",
    "cache_not_needed",
    "handshakes_refused",
)


def paged_cache(kv_caches: dict[str, torch.Tensor], chunk_size: int) -> CpuKVCache:
    """The worker's layers as one block-addressed cache; refuses a chunk size that is not a
    whole number of vLLM blocks, at start-up rather than on the first request."""
    cache = CpuKVCache(list(kv_caches.values()))
    validate_chunk_size(chunk_size, cache.block_size)
    return cache


def _chunk_blocks(
    block_ids: list[int], chunk: ChunkKey, block_size: int, start: int = 0
) -> torch.Tensor:
    """The request's blocks that hold ``chunk``'s tokens from ``start`` on (a block boundary)."""
    first = max(chunk.start, start) // block_size
    last = -(-chunk.end // block_size)
    return torch.tensor(block_ids[first:last], dtype=torch.int64)


class WorkerHalf:
    """What the facade asks of a worker-side half; each role inherits "nothing to do" for
    the hooks it does not use."""

    def start_load_kv(self, meta: PDConnectorMetadata) -> None:
        return None

    def wait_for_save(self, meta: PDConnectorMetadata) -> None:
        return None

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """(received, failed) request ids since the last step."""
        return set(), set()

    def progress(self) -> PushProgress | None:
        """What the scheduler half should know of this step (pushes still running)."""
        return None

    def close(self) -> None:
        return None


class ProducerWorker(WorkerHalf):
    """Gathers finished chunks each step and hands them to the consumer's sender thread."""

    def __init__(
        self,
        config: PDConfig,
        keyer: ChunkKeyer,
        kv_caches: dict[str, torch.Tensor],
        stats: StatsRecorder,
        profile: KVProfile | None = None,
        rank: int = 0,
    ) -> None:
        """``profile``: this rank's KV format, checked against each consumer's at handshake.
        ``rank``: this worker's tensor-parallel rank; it pushes to the consumer rank of the
        same index in each request's DisaggSpec."""
        self._keyer = keyer
        self._rank = rank
        # Requests whose spec names no consumer rank for this one: never pushed by this rank.
        self._unserved: set[str] = set()
        self._cache = paged_cache(kv_caches, config.chunk_size)
        config = replace(config, page_bytes=self._cache.chunk_nbytes(config.chunk_size))
        if profile is not None:
            profile = msgspec.structs.replace(profile, page_bytes=config.page_bytes)
        self._stats = stats
        self._staging = Staging(num_pages=config.num_pages, page_bytes=config.page_bytes)
        self._saving: dict[str, Saving] = {}
        self._senders = SenderPool(
            lambda: Producer(config, staging=self._staging, profile=profile, count=stats.add),
            stats.add,
            TraceFile(config.trace_path),
            [parse_peer(peer) for peer in config.warm_peers],
            config.thread_cpus,
        )

    def wait_for_save(self, meta: PDConnectorMetadata) -> None:
        """Runs on vLLM's model-runner thread: never raises, a request that cannot be pushed is
        abandoned (its decode recomputes)."""
        for save in meta.saves:
            try:
                self._save(save)
            except Exception:
                self._stats.add("thread_errors")
                logger.exception("req %s: copying its KV out failed", save.spec.req_id)
                request = self._saving.get(save.req_id)
                if request is not None:
                    self._abandon(request, AbandonReason.PRODUCER_ERROR, "copy-out failed")
        for req_id in meta.aborted:
            request = self._saving.get(req_id)
            if request is not None:
                self._abandon(request, AbandonReason.REQUEST_ABORTED, "prefill ended early")
        for req_id in meta.finished:
            self._saving.pop(req_id, None)
            self._unserved.discard(req_id)

    def progress(self) -> PushProgress:
        return PushProgress(self._senders.outstanding)

    def close(self) -> None:
        """Stop the senders (each closes its own NIXL agent) before anything is freed."""
        self._senders.close()

    def _save(self, save: SaveRequest) -> None:
        request = self._saving.get(save.req_id)
        if request is None:
            if save.req_id in self._unserved:
                return
            if save.prompt is None:  # its first save was never seen: nothing to go on
                logger.error("req %s: a save without its prompt; not pushed", save.spec.req_id)
                return
            try:
                spec = save.spec.for_rank(self._rank)
            except ProtocolError as exc:
                # No address to tell either: the consumer ranks that exist are refused by
                # their own producer rank's handshake (TP sizes differ) and recompute.
                self._unserved.add(save.req_id)
                self._stats.add("pushes_without_rank")
                logger.error("req %s: not pushed by rank %d: %s", save.spec.req_id, self._rank, exc)
                return
            request = Saving(spec, self._keyer.chunk_keys(save.prompt), len(save.prompt))
            self._saving[save.req_id] = request
        if save.replace_blocks:
            request.block_ids = list(save.block_ids)
        else:
            request.block_ids.extend(save.block_ids)
        if request.abandoned.is_set():
            return
        final = save.computed_end >= request.prompt_tokens
        ready = save.computed_end - (0 if final else save.computed_end % self._keyer.chunk_size)
        chunks = [c for c in request.keys if request.pushed_upto <= c.start and c.end <= ready]
        if not chunks:
            return
        pages_context = self._staging.pages(len(chunks))
        try:
            pages = pages_context.__enter__()
        except AllocationError as exc:
            self._stats.add("staging_full")
            self._abandon(request, AbandonReason.STAGING_FULL, str(exc))
            return
        request.pushed_upto = ready
        staged = []
        for chunk, page in zip(chunks, pages, strict=True):
            blocks = _chunk_blocks(request.block_ids, chunk, self._cache.block_size)
            data = page[: self._cache.chunk_nbytes(chunk.end - chunk.start)]
            self._cache.gather(blocks, data)
            staged.append((chunk.key, data))
        self._senders.submit(PushJob(request, staged, pages_context, time.time()))

    def _abandon(self, request: Saving, reason: AbandonReason, detail: str) -> None:
        """No more of this request is pushed; its sender tells the consumer (off this thread)."""
        if request.abandoned.is_set():
            return
        request.abandoned.set()
        logger.warning("req %s: not pushed (%s): %s", request.spec.req_id, reason.value, detail)
        self._senders.submit(AbandonJob(request, reason, detail))


@dataclass(slots=True)
class _PendingLoad:
    load: LoadRequest
    keys: list[ChunkKey]  # the prompt's, hashed once
    landed: int  # how many of them were seen landed
    deadline: float
    queued_at: float  # wall clock, for the trace


class ConsumerWorker(WorkerHalf):
    """Serves the consumer rank and completes loads as their chunks land."""

    def __init__(
        self,
        config: PDConfig,
        keyer: ChunkKeyer,
        kv_caches: dict[str, torch.Tensor],
        stats: StatsRecorder,
        profile: KVProfile | None = None,
        rank: int = 0,
    ) -> None:
        """``profile``: this rank's KV format, checked against each producer's at handshake.
        ``config``: this rank's own (``PDConfig.for_rank``), whose ports it binds."""
        self._config = config
        self._rank = rank
        self._keyer = keyer
        self._cache = paged_cache(kv_caches, config.chunk_size)
        page_bytes = self._cache.chunk_nbytes(config.chunk_size)
        if profile is not None:
            profile = msgspec.structs.replace(profile, page_bytes=page_bytes)
        self._consumer = Consumer(replace(config, page_bytes=page_bytes), keyer, profile=profile)
        self._stats = stats
        self._trace = TraceFile(config.trace_path)
        self._pending: list[_PendingLoad] = []
        self._aborted: set[str] = set()
        self._consumer_counts: dict[str, int] = {}

    def start_load_kv(self, meta: PDConnectorMetadata) -> None:
        deadline = time.monotonic() + self._config.load_timeout_s
        now = time.time()
        for load in meta.loads:
            # Chunks wholly inside decode's own prefix-cache hit are neither awaited, read, nor
            # (if still to come) written.
            every = self._keyer.chunk_keys(load.prompt)
            keys = [k for k in every if k.end > load.start]
            not_needed = frozenset(k.key for k in every if k.end <= load.start)
            # Claimed at once: its pages stay past the claim timeout while it waits.
            self._consumer.claim(load.disagg_req_id, not_needed)
            self._pending.append(_PendingLoad(load, keys, 0, deadline, now))
        for disagg_req_id in meta.unneeded:
            self._consumer.release(disagg_req_id)
            self._stats.add("loads_unneeded")
            logger.info(
                "req %s: decode's own prefix cache had its prompt; pushed chunks released",
                disagg_req_id,
            )
        if meta.finished:
            self._drop_aborted(meta.finished)

    def _drop_aborted(self, finished: set[str]) -> None:
        """Requests that ended (client gone) while their KV was awaited: their pages go back now,
        and they are reported received, since vLLM holds their blocks until then."""
        for pending in [p for p in self._pending if p.load.req_id in finished]:
            self._pending.remove(pending)
            self._consumer.release(pending.load.disagg_req_id)
            self._aborted.add(pending.load.req_id)
            self._traced(pending, "aborted")
            self._stats.add("loads_aborted")
            logger.info(
                "req %s (%s): ended while its KV was awaited; pages released",
                pending.load.req_id,
                pending.load.disagg_req_id,
            )

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """(received, failed) request ids; a failed one is in both, as vLLM asks. Never raises:
        it runs on vLLM's model-runner thread, and a load that cannot be done is recomputed."""
        received: set[str] = self._aborted
        self._aborted = set()
        failed: set[str] = set()
        still: list[_PendingLoad] = []
        for pending in self._pending:
            try:
                outcome = self._try_load(pending)
            except Exception:
                self._stats.add("thread_errors")
                self._stats.add("loads_failed")
                logger.exception(
                    "req %s (%s): loading failed unexpectedly; recomputing the prompt",
                    pending.load.req_id,
                    pending.load.disagg_req_id,
                )
                self._consumer.release(pending.load.disagg_req_id)
                outcome = False
            if outcome is None:
                still.append(pending)
                continue
            received.add(pending.load.req_id)
            if not outcome:
                failed.add(pending.load.req_id)
        self._pending = still
        self._report_consumer()
        return received, failed

    def _report_consumer(self) -> None:
        """The consumer rank's counters (kept by its service thread) as this step's deltas,
        and its buffer's use as gauges."""
        snapshot = self._consumer.stats_snapshot()
        for name in CONSUMER_COUNTERS:
            delta = snapshot[name] - self._consumer_counts.get(name, 0)
            if delta:
                self._stats.add(f"consumer_{name}", delta)
                self._consumer_counts[name] = snapshot[name]
        self._stats.set_gauge("consumer_used_pages", snapshot["used_pages"])
        self._stats.set_gauge("consumer_cached_pages", snapshot["cached_pages"])
        self._stats.set_gauge("consumer_held_requests", snapshot["held_requests"])

    def close(self) -> None:
        self._consumer.close()

    def _traced(self, pending: _PendingLoad, outcome: str, tokens: int = 0) -> None:
        self._trace.write(
            {
                "event": "load",
                "req_id": pending.load.disagg_req_id,
                "queued_at": pending.queued_at,
                "done_at": time.time(),
                "outcome": outcome,
                "tokens": tokens,
                "rank": self._rank,
            }
        )

    def _try_load(self, pending: _PendingLoad) -> bool | None:
        """True once loaded, False if it failed, None while its chunks are still on the way."""
        load = pending.load
        abandoned = self._consumer.dropped_reason(load.disagg_req_id)
        if abandoned is not None:
            return self._failed(
                pending, "abandoned", "loads_abandoned", f"KV abandoned: {abandoned}"
            )
        # Only pages this request holds: they cannot be rewritten while they are scattered.
        pending.landed = self._consumer.landed_prefix(
            pending.keys, pending.landed, load.disagg_req_id
        )
        if pending.landed < len(pending.keys):
            if time.monotonic() < pending.deadline:
                return None
            return self._failed(
                pending,
                "timeout",
                "load_timeouts",
                f"KV not landed within {self._config.load_timeout_s:.1f} s",
            )
        try:
            for chunk in pending.keys:
                data = self._consumer.get_chunk(chunk.key, load.disagg_req_id)
                blocks = _chunk_blocks(load.block_ids, chunk, self._cache.block_size, load.start)
                self._cache.scatter(self._cache.tail_blocks(data, len(blocks)), blocks)
        except (IntegrityError, KeyError) as exc:
            counter = "integrity_failures" if isinstance(exc, IntegrityError) else None
            return self._failed(pending, "unusable", counter, f"received KV unusable: {exc}")
        self._consumer.release(load.disagg_req_id)
        tokens = len(load.prompt) - load.start
        self._traced(pending, "loaded", tokens)
        self._stats.add("loads_completed")
        self._stats.add("tokens_loaded", tokens)
        logger.info("req %s: rank %d loaded %d prompt tokens", load.req_id, self._rank, tokens)
        return True

    def _failed(self, pending: _PendingLoad, outcome: str, counter: str | None, why: str) -> bool:
        """Give the load's pages back and have vLLM recompute its prompt."""
        load = pending.load
        self._consumer.release(load.disagg_req_id)
        self._traced(pending, outcome)
        if counter is not None:
            self._stats.add(counter)
        self._stats.add("loads_failed")
        logger.warning(
            "req %s (%s): %s; recomputing the prompt", load.req_id, load.disagg_req_id, why
        )
        return False
