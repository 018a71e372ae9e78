"""Worker-side halves of the connector: move KV between vLLM's paged cache and the transfer core.

Producer: at the end of each step (``wait_for_save``) the chunks whose tokens are all computed
are gathered into pages of the registered staging buffer, so vLLM may free or reuse the blocks at
once, and a sender thread, the only thread of this process that calls NIXL, pushes them.
Consumer: each step, pending loads whose chunks have all landed are scattered into their blocks
and reported as received; a load not complete by its deadline, or with a chunk that fails its
checksum, is reported as failed and vLLM recomputes the prompt.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from lmcache_pd.config import PDConfig, replace
from lmcache_pd.connector.metadata import LoadRequest, PDConnectorMetadata, SaveRequest
from lmcache_pd.consumer import Consumer
from lmcache_pd.errors import IntegrityError, PDError
from lmcache_pd.kernels.cpu_blocks import CpuKVCache, validate_chunk_size
from lmcache_pd.keys import ChunkKey, ChunkKeyer
from lmcache_pd.producer import Producer
from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.trace import TraceFile

logger = logging.getLogger(__name__)

SENDER_POLL_S = 0.1
STOP_TIMEOUT_S = 10.0


@dataclass(slots=True)
class WorkerStats:
    """Counters of one worker's connector, also written to ``stats_path`` when set."""

    pushes: int = 0
    chunks_pushed: int = 0
    chunks_skipped: int = 0
    bytes_pushed: int = 0
    push_failures: int = 0
    staging_full: int = 0
    loads_completed: int = 0
    tokens_loaded: int = 0
    loads_failed: int = 0
    loads_aborted: int = 0
    load_timeouts: int = 0
    integrity_failures: int = 0
    consumer_used_pages: int = 0


@dataclass
class _StatsFile:
    """Counters guarded by a lock and mirrored to a JSON file for tests and operators."""

    path: Path | None
    stats: WorkerStats = field(default_factory=WorkerStats)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @contextlib.contextmanager
    def update(self) -> Iterator[WorkerStats]:
        with self.lock:
            yield self.stats
            if self.path is not None:
                temporary = self.path.with_suffix(".tmp")
                temporary.write_text(json.dumps(asdict(self.stats)))
                temporary.replace(self.path)


def paged_cache(kv_caches: dict[str, torch.Tensor], chunk_size: int) -> CpuKVCache:
    """The worker's layers as one block-addressed cache; refuses a chunk size that is not a
    whole number of vLLM blocks, at start-up rather than on the first request."""
    cache = CpuKVCache(list(kv_caches.values()))
    validate_chunk_size(chunk_size, cache.block_size)
    return cache


def _chunk_blocks(block_ids: list[int], chunk: ChunkKey, block_size: int) -> torch.Tensor:
    first = chunk.start // block_size
    last = -(-chunk.end // block_size)
    return torch.tensor(block_ids[first:last], dtype=torch.int64)


@dataclass(slots=True)
class _PushJob:
    spec: DisaggSpec
    chunks: list[tuple[bytes, torch.Tensor]]
    pages: contextlib.AbstractContextManager
    staged_at: float  # wall clock, for the trace


class ProducerWorker:
    """Gathers finished chunks each step and pushes them from a sender thread."""

    def __init__(self, config: PDConfig, keyer: ChunkKeyer, kv_caches: dict[str, torch.Tensor]):
        self._keyer = keyer
        self._cache = paged_cache(kv_caches, config.chunk_size)
        page_bytes = self._cache.chunk_nbytes(config.chunk_size)
        self._producer = Producer(replace(config, page_bytes=page_bytes))
        self._stats = _StatsFile(Path(config.stats_path) if config.stats_path else None)
        self._trace = TraceFile(config.trace_path)
        self._progress: dict[str, int] = {}
        self._jobs: queue.Queue[_PushJob] = queue.Queue()
        self._stop = threading.Event()
        self._sender = threading.Thread(target=self._send, name="lmcache-pd-sender", daemon=True)
        self._sender.start()

    def wait_for_save(self, meta: PDConnectorMetadata) -> None:
        for save in meta.saves:
            self._save(save)
        for req_id in meta.finished:
            self._progress.pop(req_id, None)

    def close(self) -> None:
        self._stop.set()
        self._sender.join(STOP_TIMEOUT_S)
        self._producer.close()

    def _save(self, save: SaveRequest) -> None:
        done = self._progress.get(save.req_id, 0)
        final = save.computed_end >= len(save.prompt)
        ready = (
            save.computed_end
            if final
            else save.computed_end - save.computed_end % (self._keyer.chunk_size)
        )
        chunks = [
            c for c in self._keyer.chunk_keys(save.prompt) if done <= c.start and c.end <= ready
        ]
        if not chunks:
            return
        self._progress[save.req_id] = ready
        pages_context = self._producer.staged(len(chunks))
        try:
            pages = pages_context.__enter__()
        except PDError as exc:
            with self._stats.update() as stats:
                stats.staging_full += 1
            logger.warning("req %s: not pushed: %s", save.spec.req_id, exc)
            return
        staged = []
        for chunk, page in zip(chunks, pages, strict=True):
            blocks = _chunk_blocks(save.block_ids, chunk, self._cache.block_size)
            data = page[: self._cache.chunk_nbytes(chunk.end - chunk.start)]
            self._cache.gather(blocks, data)
            staged.append((chunk.key, data))
        self._jobs.put(_PushJob(save.spec, staged, pages_context, time.time()))

    def _send(self) -> None:
        """The sender thread: the only caller of NIXL after start-up."""
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=SENDER_POLL_S)
            except queue.Empty:
                continue
            started = time.time()
            record = {"event": "push", "req_id": job.spec.req_id, "staged_at": job.staged_at}
            try:
                result = self._producer.push(job.spec, job.chunks)
            except PDError as exc:
                with self._stats.update() as stats:
                    stats.push_failures += 1
                logger.warning(
                    "req %s: push failed, the consumer will recompute: %s", job.spec.req_id, exc
                )
                record["error"] = str(exc)
            else:
                with self._stats.update() as stats:
                    stats.pushes += 1
                    stats.chunks_pushed += result.chunks_sent
                    stats.chunks_skipped += result.chunks_skipped
                    stats.bytes_pushed += result.bytes_sent
                record |= {
                    "chunks": result.chunks_sent,
                    "skipped": result.chunks_skipped,
                    "bytes": result.bytes_sent,
                }
            finally:
                job.pages.__exit__(None, None, None)
            self._trace.write(record | {"start": started, "end": time.time()})


@dataclass(slots=True)
class _PendingLoad:
    load: LoadRequest
    deadline: float
    queued_at: float  # wall clock, for the trace


class ConsumerWorker:
    """Serves the consumer rank and completes loads as their chunks land."""

    def __init__(self, config: PDConfig, keyer: ChunkKeyer, kv_caches: dict[str, torch.Tensor]):
        self._config = config
        self._keyer = keyer
        self._cache = paged_cache(kv_caches, config.chunk_size)
        page_bytes = self._cache.chunk_nbytes(config.chunk_size)
        self._consumer = Consumer(replace(config, page_bytes=page_bytes), keyer)
        self._stats = _StatsFile(Path(config.stats_path) if config.stats_path else None)
        self._trace = TraceFile(config.trace_path)
        self._pending: list[_PendingLoad] = []
        self._aborted: set[str] = set()

    def start_load_kv(self, meta: PDConnectorMetadata) -> None:
        deadline = time.monotonic() + self._config.load_timeout_s
        now = time.time()
        self._pending.extend(_PendingLoad(load, deadline, now) for load in meta.loads)
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
            with self._stats.update() as stats:
                stats.loads_aborted += 1
                stats.consumer_used_pages = self._consumer.used_pages
            logger.info(
                "req %s (%s): ended while its KV was awaited; pages released",
                pending.load.req_id,
                pending.load.disagg_req_id,
            )

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """(received, failed) request ids; a failed one is in both, as vLLM asks."""
        received: set[str] = self._aborted
        self._aborted = set()
        failed: set[str] = set()
        still: list[_PendingLoad] = []
        for pending in self._pending:
            outcome = self._try_load(pending)
            if outcome is None:
                still.append(pending)
                continue
            received.add(pending.load.req_id)
            if not outcome:
                failed.add(pending.load.req_id)
        self._pending = still
        return received, failed

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
            }
        )

    def _try_load(self, pending: _PendingLoad) -> bool | None:
        """True once loaded, False if it failed, None while its chunks are still on the way."""
        load = pending.load
        if self._consumer.lookup(load.prompt) < len(load.prompt):
            if time.monotonic() < pending.deadline:
                return None
            self._consumer.release(load.disagg_req_id)
            self._traced(pending, "timeout")
            with self._stats.update() as stats:
                stats.load_timeouts += 1
                stats.loads_failed += 1
                stats.consumer_used_pages = self._consumer.used_pages
            logger.warning(
                "req %s (%s): KV not landed within %.1f s, recomputing the prompt",
                load.req_id,
                load.disagg_req_id,
                self._config.load_timeout_s,
            )
            return False
        try:
            for chunk in self._keyer.chunk_keys(load.prompt):
                if chunk.end <= load.start:
                    continue
                data = self._consumer.get_chunk(chunk.key)
                blocks = _chunk_blocks(load.block_ids, chunk, self._cache.block_size)
                self._cache.scatter(data, blocks)
        except (IntegrityError, KeyError) as exc:
            self._traced(pending, "unusable")
            with self._stats.update() as stats:
                stats.integrity_failures += isinstance(exc, IntegrityError)
                stats.loads_failed += 1
            logger.warning(
                "req %s (%s): received KV unusable, recomputing the prompt: %s",
                load.req_id,
                load.disagg_req_id,
                exc,
            )
            return False
        finally:
            self._consumer.release(load.disagg_req_id)
        self._traced(pending, "loaded", len(load.prompt) - load.start)
        with self._stats.update() as stats:
            stats.loads_completed += 1
            stats.tokens_loaded += len(load.prompt) - load.start
            stats.consumer_used_pages = self._consumer.used_pages
        logger.info("req %s: loaded %d prompt tokens", load.req_id, len(load.prompt) - load.start)
        return True
