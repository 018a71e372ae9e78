"""Worker-side halves of the connector: move KV between vLLM's paged cache and the transfer core.

Producer: at the end of each step (``wait_for_save``) the chunks whose tokens are all computed
are gathered into pages of the staging buffer, so vLLM may free or reuse the blocks at once, and
the sender thread of the request's consumer pushes them (``sender.py``); the gather takes each
chunk's checksum in the same pass where the cache allows (``integrity.py``); from a GPU cache the
copies are queued on the connector's own CUDA stream and the sender waits for them
(``cuda_kv.py``). The chunk format follows the cache (``paged_kv.py``). A request that cannot
be pushed (no staging room, prefill aborted) is abandoned: its consumer is told at once. With
LMCache's proxy configured, once a request's prompt is computed, a notice job follows its pushes
to each consumer rank: when they are done, LMCache's proxy is sent a ``ProxyNotif``
(``lmcache_proxy.py``).
Consumer: each step, pending loads whose chunks have all landed are scattered into their blocks
and reported as received; a load whose KV was abandoned, not complete by its deadline, or with a
chunk that fails its checksum, is reported as failed and vLLM recomputes the prompt.
Counters go to a ``StatsRecorder``: vLLM ships them to its own ``/metrics``.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import torch

from lmcache_pd.auth import Role, load_keys
from lmcache_pd.compat import KVProfile
from lmcache_pd.config import PDConfig, replace
from lmcache_pd.connector.counters import StatsRecorder
from lmcache_pd.connector.metadata import (
    PDConnectorMetadata,
    PushProgress,
    SaveRequest,
)
from lmcache_pd.errors import AllocationError, ProtocolError
from lmcache_pd.kernels.paged_kv import COPIED, Copy, PagedKV, head_slice, recognise
from lmcache_pd.keys import ChunkKey, ChunkKeyer, from_held
from lmcache_pd.lmcache_proxy import ProxyNotifier
from lmcache_pd.peers import parse_peer
from lmcache_pd.protocol import AbandonReason
from lmcache_pd.tp_parts import TPLayout, part_keyer, rank_heads, route
from lmcache_pd.trace import TraceFile
from lmcache_pd.transfer.producer import Producer
from lmcache_pd.transfer.sender import SenderPool
from lmcache_pd.transfer.sender_jobs import AbandonJob, Filling, NoticeJob, PushJob, Saving
from lmcache_pd.transfer.staging import Staging

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CacheFacts:
    """What vLLM says of its cache beyond the tensors (``paged_kv.recognise``); None: not
    known, decided by the tensors."""

    block_size: int | None = None
    physical_order: str | None = None
    packed_blocks: bool | None = None


UNKNOWN = CacheFacts()


def paged_kv(kv_caches: dict[str, torch.Tensor], config: PDConfig, facts: CacheFacts) -> PagedKV:
    """The worker's layers as the chunk format they move; refuses at start-up, not on the first
    request, a chunk size of CPU blocks that is not whole blocks."""
    return recognise(
        kv_caches,
        config.chunk_size,
        block_size=facts.block_size,
        physical_order=facts.physical_order,
        packed_blocks=facts.packed_blocks,
    )


def rank_profile(profile: KVProfile | None, cache: PagedKV, config: PDConfig) -> KVProfile:
    """``profile`` (or, without one, the config's chunk size) completed by what the cache knows:
    its chunk format, always compared, and its page size. A token chunk does not depend on the
    block size, which is then not compared."""
    if profile is None:
        profile = KVProfile(chunk_size=config.chunk_size, page_bytes=config.page_bytes)
    block_size = profile.block_size if cache.whole_blocks else None
    return msgspec.structs.replace(
        profile,
        page_bytes=config.page_bytes,
        chunk_format=cache.chunk_format,
        block_size=block_size,
    )


def staging_for(config: PDConfig, cache: PagedKV) -> Staging:
    """The producer's staging pages: in the cache's GPU memory with ``buffer_device: cuda``,
    CPU memory the cache page-locks for any other GPU cache (copied into from the GPU without
    blocking; ``PagedKV.adopt``, unlocked when the cache closes), plain CPU memory for a CPU
    one."""
    device = cache.device if config.buffer_device == "cuda" else torch.device("cpu")
    staging = Staging(num_pages=config.num_pages, page_bytes=config.page_bytes, device=device)
    cache.adopt(staging.buffer, loads=False)
    return staging


def held_tail(
    keys: list[ChunkKey], decode_holds: int, cache: PagedKV, chunk_size: int
) -> list[ChunkKey]:
    """A request's chunk keys as both sides of its push name them when decode's prefix cache
    holds its first ``decode_holds`` tokens (the DisaggSpec's): the chunk that hold ends inside
    is cut to its tail (``keys.from_held``), which alone is pushed and loaded, where the cache
    moves whole blocks and the hold ends on one (vLLM's CPU blocks; both sides' formats are
    the same, checked at handshake). Else the keys as they are, and that chunk goes whole."""
    if not cache.whole_blocks or decode_holds % chunk_size == 0 or decode_holds % cache.block_size:
        return keys
    return from_held(keys, decode_holds)


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

    def load_errors(self) -> set[int]:
        """Blocks whose synchronous load failed this step; vLLM recomputes them."""
        return set()

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
        facts: CacheFacts = UNKNOWN,
        layout: TPLayout | None = None,
    ) -> None:
        """``profile``: this rank's KV format, checked against each consumer's at handshake.
        ``rank``: this worker's tensor-parallel rank; it pushes to the consumer rank of the
        same index in each request's DisaggSpec, or, where the spec lists another number of
        decode ranks and ``layout`` is known, to each decode rank the heads it needs
        (``tp_parts.py``). ``facts``: what vLLM says of its cache."""
        self._keyer = keyer
        self._rank = rank
        self._layout = layout
        # Requests whose spec names no consumer rank for this one: never pushed by this rank.
        self._unserved: set[str] = set()
        self._cache = paged_kv(kv_caches, config, facts)
        config = replace(config, page_bytes=self._cache.chunk_nbytes(config.chunk_size))
        profile = rank_profile(profile, self._cache, config)
        self._stats = stats
        self._hashed = config.integrity_checksums
        self._staging = staging_for(config, self._cache)
        # Each request's pushes: one per consumer rank it sends to, with the heads it sends.
        self._saving: dict[str, list[tuple[Saving, PagedKV]]] = {}
        device = self._cache.device

        def sender_producer() -> Producer:
            """Run first in each sender thread: its CUDA calls (event queries, NIXL's VRAM
            work) go to this rank's GPU, not to GPU 0, where they would make a context."""
            if device.type == "cuda":
                torch.cuda.set_device(device)
            return Producer(config, staging=self._staging, profile=profile, count=stats.add)

        self._senders = SenderPool(
            sender_producer,
            stats.add,
            TraceFile(config.trace_path),
            [parse_peer(peer) for peer in config.warm_peers],
            config.thread_cpus,
        )
        self._notices: ProxyNotifier | None = None
        if config.lmcache_proxy_host is not None and config.lmcache_proxy_port is not None:
            self._notices = ProxyNotifier(
                config.lmcache_proxy_host,
                config.lmcache_proxy_port,
                config.lmcache_proxy_tag,
                count=stats.add,
                secret=load_keys(config.secret_file, Role.PRODUCER) is not None,
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
                for request, _ in self._saving.get(save.req_id, ()):
                    self._abandon(request, AbandonReason.PRODUCER_ERROR, "copy-out failed")
                    if save.computed_end >= request.prompt_tokens:
                        self._notice_after_pushes(request)
        for req_id in meta.aborted:
            for request, _ in self._saving.get(req_id, ()):
                self._abandon(request, AbandonReason.REQUEST_ABORTED, "prefill ended early")
        for req_id in meta.finished:
            self._saving.pop(req_id, None)
            self._unserved.discard(req_id)

    def progress(self) -> PushProgress:
        return PushProgress(self._senders.outstanding)

    def close(self) -> None:
        """Stop the senders (each closes its own NIXL agent) before anything is freed, and
        then the notices they send."""
        self._senders.close()
        if self._notices is not None:
            self._notices.close()
        self._cache.close()

    def _save(self, save: SaveRequest) -> None:
        targets = self._saving.get(save.req_id)
        if targets is None:
            if save.req_id in self._unserved:
                return
            if save.prompt is None:  # its first save was never seen: nothing to go on
                logger.error("req %s: a save without its prompt; not pushed", save.spec.req_id)
                return
            targets = self._targets(save, save.prompt)
            if not targets:
                self._unserved.add(save.req_id)
                return
            self._saving[save.req_id] = targets
        for request, cache in targets:
            if save.replace_blocks:
                request.block_ids = list(save.block_ids)
            else:
                request.block_ids.extend(save.block_ids)
            if not request.abandoned.is_set():
                self._push_ready(request, cache, save.computed_end)
            if save.computed_end >= request.prompt_tokens:
                self._notice_after_pushes(request)

    def _targets(self, save: SaveRequest, prompt: Sequence[int]) -> list[tuple[Saving, PagedKV]]:
        """Where this rank pushes the request's KV, and which of its heads: to the consumer
        rank of its own index with its keys (decode at this TP size), or a part to each decode
        rank whose heads it holds (``tp_parts.py``); none if it sends nothing."""
        spec, layout = save.spec, self._layout
        if layout is None or spec.ranks == layout.tp_size:
            try:
                rank_spec = spec.for_rank(self._rank)
            except ProtocolError as exc:
                # No address to tell either: the consumer ranks that exist are refused by
                # their own producer rank's handshake (TP sizes differ) and recompute.
                self._stats.add("pushes_without_rank")
                logger.error("req %s: not pushed by rank %d: %s", spec.req_id, self._rank, exc)
                return []
            keys = self._keyer.chunk_keys(
                prompt, salt=save.cache_salt, lora=save.lora, tags=save.tags, mm=save.mm
            )
            return self._skipping([(Saving(rank_spec, keys, len(prompt)), self._cache)])
        try:
            parts = route(layout.kv_heads, layout.tp_size, spec.ranks)
        except ValueError as exc:
            self._stats.add("pushes_without_rank")
            logger.error("req %s: not pushed by rank %d: %s", spec.req_id, self._rank, exc)
            return []
        own = rank_heads(layout.kv_heads, layout.tp_size, self._rank)[0]
        mine = [part for part in parts if part.source == self._rank]
        requests = [
            Saving(
                spec.for_rank(part.dest),
                part_keyer(self._keyer, layout.kv_heads, part).chunk_keys(
                    prompt, salt=save.cache_salt, lora=save.lora, tags=save.tags, mm=save.mm
                ),
                len(prompt),
            )
            for part in mine
        ]
        try:
            caches = [head_slice(self._cache, part.lo - own, part.hi - own) for part in mine]
        except ValueError as exc:
            # This cache cannot be cut by heads (token chunks): every decode rank it would feed
            # is told at once, so that it recomputes now rather than at its load deadline.
            self._stats.add("pushes_without_rank")
            for request in requests:
                self._abandon(request, AbandonReason.INCOMPATIBLE, str(exc))
            return []
        return self._skipping(list(zip(requests, caches, strict=True)))

    def _skipping(self, targets: list[tuple[Saving, PagedKV]]) -> list[tuple[Saving, PagedKV]]:
        """``targets`` with the chunks decode's prefix cache holds (its spec says how many
        tokens) counted as pushed: they are never sent; and of the chunk it holds the head of,
        the tail alone is sent (``held_tail``)."""
        for request, cache in targets:
            request.pushed_upto = request.spec.skipped_tokens(self._keyer.chunk_size)
            request.keys = held_tail(
                request.keys, request.spec.decode_holds, cache, self._keyer.chunk_size
            )
        return targets

    def _push_ready(self, request: Saving, cache: PagedKV, computed_end: int) -> None:
        """Hand the chunks of ``request`` computed by ``computed_end`` and not pushed yet to the
        consumer rank's sender, then gather them into their staging pages: the sender asks the
        consumer for pages while they are copied."""
        final = computed_end >= request.prompt_tokens
        ready = computed_end - (0 if final else computed_end % self._keyer.chunk_size)
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
        staged = [
            (chunk.key, page[: cache.chunk_nbytes(chunk.end - chunk.start)])
            for chunk, page in zip(chunks, pages, strict=True)
        ]
        filling = Filling()
        # From here the sender owns the pages (it gives them back, whatever happens).
        if not self._senders.submit(PushJob(request, staged, pages_context, time.time(), filling)):
            return
        digests: list[int | None] = []
        copy: Copy = COPIED
        try:
            for chunk, (_, data) in zip(chunks, staged, strict=True):
                copy = cache.gather(
                    request.block_ids, chunk.start, chunk.end, data, hashed=self._hashed
                )
                digests.append(copy.digest)
        except BaseException as exc:
            filling.failed(repr(exc))
            raise
        # Checksums taken in the copy's pass; a cache that cannot has the producer take them.
        hashed = self._hashed and None not in digests
        filling.done([d for d in digests if d is not None] if hashed else None, copy)

    def _notice_after_pushes(self, request: Saving) -> None:
        """The prompt is computed and its last push queued (or the request given up): LMCache's
        proxy, if there is one, hears of this consumer rank once those pushes are done."""
        if self._notices is None or request.noticed:
            return
        request.noticed = True
        self._senders.submit(NoticeJob(request, functools.partial(self._notify, request)))

    def _notify(self, request: Saving, landed: bool) -> None:
        """On the request's sender thread, its pushes to that rank done: a ``ProxyNotif``. Sent
        also when they failed, so that LMCache's proxy, which waits for it with no deadline,
        asks decode, which then computes what did not land."""
        assert self._notices is not None
        if not landed:
            self._stats.add("proxy_notices_unlanded")
            logger.warning(
                "req %s: its KV did not all reach %s:%d; LMCache's proxy is told anyway, and "
                "decode computes what is missing",
                request.spec.req_id,
                request.spec.receiver_host,
                request.spec.receiver_init_port,
            )
        self._notices.send(request.spec.req_id)

    def _abandon(self, request: Saving, reason: AbandonReason, detail: str) -> None:
        """No more of this request is pushed; its sender tells the consumer (off this thread)."""
        if request.abandoned.is_set():
            return
        request.abandoned.set()
        logger.warning("req %s: not pushed (%s): %s", request.spec.req_id, reason.value, detail)
        self._senders.submit(AbandonJob(request, reason, detail))
