"""Worker-side halves of the connector: move KV between vLLM's paged cache and the transfer core.

Producer: at the end of each step (``wait_for_save``) the chunks whose tokens are all computed
are gathered into pages of the staging buffer, so vLLM may free or reuse the blocks at once, and
the sender thread of the request's consumer pushes them (``sender.py``). The gather takes each
chunk's checksum in the same pass (``integrity.py``). A request that cannot
be pushed (no staging room, prefill aborted) is abandoned: its consumer is told at once.
Consumer: each step, pending loads whose chunks have all landed are scattered into their blocks
and reported as received; a load whose KV was abandoned, not complete by its deadline, or with a
chunk that fails its checksum, is reported as failed and vLLM recomputes the prompt.
Counters go to a ``StatsRecorder``: vLLM ships them to its own ``/metrics``.
"""

from __future__ import annotations

import logging
import time

import msgspec
import torch

from lmcache_pd.compat import KVProfile
from lmcache_pd.config import PDConfig, replace
from lmcache_pd.connector.metadata import (
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
from lmcache_pd.errors import AllocationError, ProtocolError
from lmcache_pd.kernels.cpu_blocks import CpuKVCache, validate_chunk_size
from lmcache_pd.keys import ChunkKey, ChunkKeyer
from lmcache_pd.producer import Producer
from lmcache_pd.protocol import AbandonReason
from lmcache_pd.staging import Staging
from lmcache_pd.trace import TraceFile

logger = logging.getLogger(__name__)


def paged_cache(kv_caches: dict[str, torch.Tensor], chunk_size: int) -> CpuKVCache:
    """The worker's layers as one block-addressed cache; refuses a chunk size that is not a
    whole number of vLLM blocks, at start-up rather than on the first request."""
    cache = CpuKVCache(list(kv_caches.values()))
    validate_chunk_size(chunk_size, cache.block_size)
    return cache


def chunk_blocks(
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
        self._hashed = config.integrity_checksums
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
        staged, checksums = [], []
        for chunk, page in zip(chunks, pages, strict=True):
            blocks = chunk_blocks(request.block_ids, chunk, self._cache.block_size)
            data = page[: self._cache.chunk_nbytes(chunk.end - chunk.start)]
            digest = self._cache.gather(blocks, data, hashed=self._hashed)
            if digest is not None:
                checksums.append(digest)
            staged.append((chunk.key, data))
        sums = checksums if self._hashed else None
        self._senders.submit(PushJob(request, staged, sums, pages_context, time.time()))

    def _abandon(self, request: Saving, reason: AbandonReason, detail: str) -> None:
        """No more of this request is pushed; its sender tells the consumer (off this thread)."""
        if request.abandoned.is_set():
            return
        request.abandoned.set()
        logger.warning("req %s: not pushed (%s): %s", request.spec.req_id, reason.value, detail)
        self._senders.submit(AbandonJob(request, reason, detail))
