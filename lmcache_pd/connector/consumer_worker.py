"""The consumer's worker-side half: completes loads as their chunks land.

The consumer rank itself runs in a process of its own (``consumer_service.py``), so that vLLM's
model thread, which runs this half, can never starve it. Each step this half asks that process how
far every pending load got (one round trip, answered by the next step at the latest); a load whose
chunks have all landed in the buffer both processes map is scattered into its blocks and reported
as received; one whose KV was abandoned, not complete by its deadline, or with a chunk that fails
its checksum, is reported as failed and vLLM recomputes the prompt.

A load vLLM scheduled synchronously (its chunks had all landed on every rank, as each rank's
consumer process posted on its ``landed_board``) is done in ``start_load_kv``, before the step's
forward pass computes the request's last token, saving the step an asynchronous load costs. Its
one round trip has a deadline (``SYNC_LOAD_WAIT_S``); if it fails all the same, its blocks are
reported invalid (``load_errors``) and vLLM recomputes them (``kv_load_failure_policy:
recompute``), discarding what the step computed from them.

A chunk's checksum is checked in the pass that scatters it (``CpuKVCache.scatter(hashed=True)``),
so its bytes are read once; a chunk that fails it has already been written into the request's
blocks by then. That is safe because the load is reported failed: vLLM's scheduler then counts
none of the request's tokens as computed and frees its blocks without caching them
(``kv_load_failure_policy: recompute``), so the prompt is recomputed over those bytes and no
other request can hit them in the prefix cache.

A cache that cannot hash while it copies (token layouts, GPU caches) has each chunk hashed on
threads of its own (``chunk_checks.py``) before it is scattered, so vLLM's model thread never
spends a pass over the bytes.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmcache_pd.compat import KVProfile
from lmcache_pd.config import PDConfig
from lmcache_pd.connector.chunk_checks import ChunkChecks
from lmcache_pd.connector.counters import CONSUMER_PREFIX, StatsRecorder
from lmcache_pd.connector.metadata import KeepRequest, LoadRequest, PDConnectorMetadata
from lmcache_pd.connector.receive_pages import receive_config
from lmcache_pd.connector.worker import (
    UNKNOWN,
    CacheFacts,
    WorkerHalf,
    held_tail,
    paged_kv,
    rank_profile,
)
from lmcache_pd.errors import IntegrityError, PeerTimeout, TransferError
from lmcache_pd.kernels.chunk_bytes import ChunkBytes
from lmcache_pd.kernels.paged_kv import COPIED, Copy, PagedKV, head_slice
from lmcache_pd.keys import ChunkKey, ChunkKeyer
from lmcache_pd.protocol import DEVICE_COPY_TIMEOUT_S, ChunkSpec
from lmcache_pd.tp_parts import TPLayout, part_keyer, rank_heads, route
from lmcache_pd.trace import TraceFile
from lmcache_pd.transfer.consumer_service import (
    ConsumerService,
    ConsumerServiceBusy,
    ConsumerServiceDown,
    LoadQuery,
    LoadState,
)
from lmcache_pd.transfer.consumer_stats import EXPORTED_COUNTERS, EXPORTED_GAUGES
from lmcache_pd.transfer.receive_buffer import LandedChunk, check_landed

logger = logging.getLogger(__name__)

# How long a synchronous load waits for its consumer's process to say where its chunks are (they
# have landed by then; the answer takes well under a millisecond): the step waits meanwhile. Past
# it the prompt is recomputed, which costs the step far more than the wait (hundreds of ms for a
# few thousand tokens here), so the bound is for a process that is stuck, not one that is merely
# descheduled: on a loaded host (the suite's two cores under three vLLM instances) an answer can
# come tens of milliseconds late.
SYNC_LOAD_WAIT_S = 0.25
# How long keeping computed chunks waits for pages (the step waits meanwhile): past it they are not
# kept, which costs only a later request's recompute, so the bound stays short.
KEEP_ROOM_WAIT_S = 0.05
# How long a synchronous load waits for its chunks' checksums, taken on other threads (1 GiB of
# XXH3 takes ~0.1 s); past it the load fails and vLLM recomputes the prompt.
SYNC_CHECK_WAIT_S = 2.0
# Releases kept to send again while the consumer's process reads nothing; past this many, the
# pages lapse at its claim timeout instead.
MAX_UNRELEASED = 4096


@dataclass(slots=True)
class _PendingLoad:
    load: LoadRequest
    keys: list[ChunkKey]  # the prompt's, hashed once
    caches: list[PagedKV]  # where each key's chunk goes: the cache, or the heads it holds
    deadline: float
    queued_at: float  # wall clock, for the trace
    landed: list[LandedChunk] = field(default_factory=list)  # where its first keys landed
    # An asynchronous load's scatter on a GPU's copy stream: reported received once done.
    copying: Copy | None = None
    # Each chunk's digest, hashed off the model thread (None: checked in the scatter's pass, or
    # no checksum came); the list is made once every chunk has landed.
    digests: list[Future[int] | None] | None = None

    def query(self) -> LoadQuery:
        """The progress question for the keys not yet seen landed."""
        located = len(self.landed)
        return LoadQuery(self.load.disagg_req_id, located, [k.key for k in self.keys[located:]])


def _by_cache(caches: list[PagedKV]) -> list[tuple[PagedKV, list[int]]]:
    """The distinct caches a load's chunks go to (one, or each head slice of a fan-in), each
    with the indices of its chunks, in order."""
    groups: dict[int, tuple[PagedKV, list[int]]] = {}
    for index, cache in enumerate(caches):
        groups.setdefault(id(cache), (cache, []))[1].append(index)
    return list(groups.values())


def chunk_sources(
    keyer: ChunkKeyer,
    cache: PagedKV,
    rank: int,
    layout: TPLayout | None,
    prefill_tp_size: int | None,
) -> list[tuple[ChunkKeyer, PagedKV]]:
    """What each chunk of a prompt arrives as, in order: the whole chunk under this rank's own
    keys (prefill at decode's TP size), or one part from each prefill rank holding some of this
    rank's heads, under that part's keys, scattered into those heads (``tp_parts.py``)."""
    if layout is None or prefill_tp_size is None or prefill_tp_size == layout.tp_size:
        return [(keyer, cache)]
    own = rank_heads(layout.kv_heads, layout.tp_size, rank)[0]
    return [
        (
            part_keyer(keyer, layout.kv_heads, part),
            head_slice(cache, part.lo - own, part.hi - own),
        )
        for part in route(layout.kv_heads, prefill_tp_size, layout.tp_size)
        if part.dest == rank
    ]


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
        facts: CacheFacts = UNKNOWN,
        board: Path | None = None,
        layout: TPLayout | None = None,
    ) -> None:
        """``profile``: this rank's KV format, checked against each producer's at handshake.
        ``config``: this rank's own (``PDConfig.for_rank``), whose ports it binds.
        ``facts``: what vLLM says of its cache. ``board``: where this rank's consumer process
        posts landed chunks for the scheduler (None: nowhere, every load asynchronous).
        ``layout``: with ``config.prefill_tp_size`` another size, each chunk comes in parts,
        one from each prefill rank holding some of this rank's heads (``tp_parts.py``)."""
        self._config = config
        self._rank = rank
        self._cache = paged_kv(kv_caches, config, facts)
        self._sources = chunk_sources(keyer, self._cache, rank, layout, config.prefill_tp_size)
        # A page a part: a fan-in rank holds as many chunks as its buffer's size says.
        rank_config = receive_config(
            config, [cache.chunk_nbytes(config.chunk_size) for _, cache in self._sources], rank
        )
        profile = rank_profile(profile, self._cache, rank_config)
        # With buffer_device cuda the receive buffer is in the cache's GPU memory.
        device = self._cache.device if config.buffer_device == "cuda" else None
        self._service = ConsumerService(
            rank_config, keyer, profile=profile, device=device, board=board
        )
        self._cache.adopt(self._service.buffer)
        self._checks = ChunkChecks()
        # Loads scattered on a GPU's copy stream whose pages go back once the copy is done.
        self._releasing: list[tuple[Copy, str]] = []
        self._stats = stats
        self._trace = TraceFile(config.trace_path)
        self._pending: list[_PendingLoad] = []
        self._aborted: set[str] = set()
        self._consumer_counts: dict[str, int] = {}
        self._service_down = False
        # Loads whose claim could not be sent, failed at the next report; releases not sent,
        # sent again then (the process read nothing: ``ConsumerServiceBusy``).
        self._unclaimed: set[str] = set()
        self._unreleased: set[str] = set()
        # Loads and unneeded requests (by disagg_req_id) whose chunks leave the consumer's cache
        # when released (``PDConnectorMetadata.uncached``), until their release is sent.
        self._uncached: set[str] = set()
        self._load_errors: set[int] = set()
        # Chunks decode computes are kept from a CPU cache of this rank's own keys only (a GPU
        # cache's copy out is asynchronous; parts of another TP size are not whole chunks).
        self._keeps = len(self._sources) == 1 and self._cache.device.type == "cpu"
        self._keep_ids = (f"kept-{secrets.token_hex(4)}-{n}" for n in itertools.count())

    def start_load_kv(self, meta: PDConnectorMetadata) -> None:
        deadline = time.monotonic() + self._config.load_timeout_s
        now = time.time()
        self._uncached |= meta.uncached
        for load in meta.loads:
            # Chunks wholly inside decode's own prefix-cache hit are neither awaited, read, nor
            # (if still to come) written. The salt keeps another tenant's chunks out of reach.
            # The chunk decode's spec says it holds the head of comes as its tail alone.
            every = [
                (key, cache)
                for chunk in zip(
                    *(
                        held_tail(
                            keyer.chunk_keys(
                                load.prompt,
                                salt=load.cache_salt,
                                lora=load.lora,
                                tags=load.tags,
                                mm=load.mm,
                            ),
                            load.held,
                            cache,
                            keyer.chunk_size,
                        )
                        for keyer, cache in self._sources
                    ),
                    strict=True,
                )
                for key, (_, cache) in zip(chunk, self._sources, strict=True)
            ]
            wanted = [(k, cache) for k, cache in every if k.end > load.start]
            not_needed = frozenset(k.key for k, _ in every if k.end <= load.start)
            pending = _PendingLoad(
                load, [k for k, _ in wanted], [cache for _, cache in wanted], deadline, now
            )
            if load.sync:
                self._load_now(pending, not_needed)
                continue
            # Claimed at once: its pages stay past the claim timeout while it waits.
            if not self._send(self._service.claim, load.disagg_req_id, not_needed):
                # Never waited for: it fails at this step's report, and is recomputed.
                self._unclaimed.add(load.disagg_req_id)
            self._pending.append(pending)
        for disagg_req_id in meta.unneeded:
            self._release(disagg_req_id)
            self._stats.add("loads_unneeded")
            logger.info(
                "req %s: decode computes its prompt itself (its own prefix cache had it, or "
                "lost what prefill skipped); pushed chunks released",
                disagg_req_id,
            )
        if meta.finished:
            self._drop_aborted(meta.finished)

    def _load_now(self, pending: _PendingLoad, not_needed: frozenset[bytes]) -> None:
        """Claim and load a request whose chunks had all landed, before the forward pass; if
        that fails, its blocks are reported invalid and vLLM recomputes them."""
        load = pending.load
        self._stats.add("loads_sync")
        try:
            state = self._service.load_now(
                load.disagg_req_id,
                not_needed,
                [k.key for k in pending.keys],
                SYNC_LOAD_WAIT_S,
                adopt=load.local,
            )
            if state.dropped is None and len(state.landed) < len(pending.keys):
                # Never expected: the scheduler saw them all landed and held for this request.
                loaded = self._failed(pending, "missing", None, "its KV is no longer all there")
            else:
                loaded = self._try_load(pending, state)
        except (PeerTimeout, ConsumerServiceDown) as exc:
            loaded = self._failed(pending, "unanswered", None, f"consumer process: {exc}")
        except Exception:
            self._stats.add("thread_errors")
            loaded = self._failed(pending, "error", None, "loading failed unexpectedly")
            logger.exception("req %s: synchronous load failed", load.req_id)
        if not loaded:
            self._stats.add("sync_load_failures")
            block_size = self._cache.block_size
            first, end = load.start // block_size, -(-len(load.prompt) // block_size)
            self._load_errors.update(load.block_ids[first:end])

    def wait_for_save(self, meta: PDConnectorMetadata) -> None:
        """Copy the chunks decode computed for requests it served alone into the consumer's
        cache (``computed_prompts.py``), after the forward pass that computed them. Never
        raises: it runs on vLLM's model thread, and a chunk not kept is only computed again."""
        if not self._keeps:
            return
        for keep in meta.keeps:
            try:
                self._keep(keep)
            except (PeerTimeout, ConsumerServiceDown) as exc:
                self._stats.add("keeps_failed")
                logger.info("req %s: computed chunks not kept: %s", keep.req_id, exc)
            except Exception:
                self._stats.add("thread_errors")
                logger.exception("req %s: keeping computed chunks failed", keep.req_id)

    def _keep(self, keep: KeepRequest) -> None:
        """Pages for the chunks not in the consumer's buffer yet, each filled from the request's
        blocks and hashed in the same pass, then landed there as pushed chunks are."""
        keyer, cache = self._sources[0]
        chunks = [
            chunk
            for chunk in keyer.chunk_keys(
                keep.prompt, salt=keep.cache_salt, lora=keep.lora, tags=keep.tags, mm=keep.mm
            )
            if chunk.start >= keep.start
        ]
        specs = [ChunkSpec(c.key, cache.chunk_nbytes(c.end - c.start)) for c in chunks]
        name = next(self._keep_ids)
        reply = self._service.keep_room(name, specs, KEEP_ROOM_WAIT_S)
        if reply.refused is not None:
            self._stats.add("keeps_failed")
            logger.info("req %s: computed chunks not kept: %s", keep.req_id, reply.refused)
            return
        page_bytes = self._service.page_bytes
        digests: list[int | None] = []
        try:
            for chunk, spec, page in zip(chunks, specs, reply.pages, strict=True):
                if page is None:  # here already
                    continue
                out = self._service.buffer[page * page_bytes : page * page_bytes + spec.nbytes]
                copy = cache.gather(keep.block_ids, chunk.start, chunk.end, out, hashed=True)
                digests.append(copy.digest)
        except BaseException:
            self._release(name)
            raise
        if not digests:  # every chunk was here already: let go of the hold it took
            self._release(name)
            return
        checksums = None if None in digests else [d for d in digests if d is not None]
        self._send(self._service.kept, name, reply.alloc_id, checksums)

    def load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _drop_aborted(self, finished: set[str]) -> None:
        """Requests that ended (client gone) while their KV was awaited: their pages go back now,
        and they are reported received, since vLLM holds their blocks until then."""
        for pending in [p for p in self._pending if p.load.req_id in finished]:
            self._pending.remove(pending)
            if pending.copying is not None and not pending.copying.done():
                # Its copy still writes the blocks vLLM frees now, and reads the pages: the
                # model's next work waits for it, the pages go back once it is done.
                pending.copying.order_model()
                self._releasing.append((pending.copying, pending.load.disagg_req_id))
            else:
                self._release(pending.load.disagg_req_id)
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
        self._release_copied()
        failed: set[str] = set()
        self._release_again()
        states = self._progress()
        still: list[_PendingLoad] = []
        for pending in self._pending:
            try:
                outcome = self._try_load(pending, states.get(pending.load.disagg_req_id))
            except Exception:
                self._stats.add("thread_errors")
                self._stats.add("loads_failed")
                logger.exception(
                    "req %s (%s): loading failed unexpectedly; recomputing the prompt",
                    pending.load.req_id,
                    pending.load.disagg_req_id,
                )
                self._release(pending.load.disagg_req_id)
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

    def _progress(self) -> dict[str, LoadState]:
        """What the consumer's process said of the pending loads since the last step; a
        process that is down fails them all (they are recomputed)."""
        unclaimed, self._unclaimed = self._unclaimed, set()
        refused = LoadState("", 0, "its consumer process read nothing (claim not sent)", [])
        states = dict.fromkeys(unclaimed, refused)
        try:
            reply = self._service.progress([pending.query() for pending in self._pending])
        except ConsumerServiceDown as exc:
            if not self._service_down:
                self._service_down = True
                self._stats.add("consumer_process_down")
            down = LoadState("", 0, str(exc), [])
            return {pending.load.disagg_req_id: down for pending in self._pending}
        if reply is not None:
            states = {state.req_id: state for state in reply.loads} | states
        return states

    def _send(self, action: Callable[..., None], *args: object) -> bool:
        """A one-way message to the consumer's process; False where it could not be queued
        (the process reads nothing now: counted). If it is down, the loads concerned fail at
        the next step (``_progress``): nothing more to do here."""
        try:
            action(*args)
        except ConsumerServiceBusy as exc:
            self._stats.add("consumer_messages_refused")
            logger.warning("%s", exc)
            return False
        except ConsumerServiceDown:
            pass
        return True

    def _release(self, disagg_req_id: str) -> None:
        """Hand the request's pages back (out of the cache too where it asked to keep nothing:
        ``uncached``); while the process reads nothing, again next step (a bounded set: past
        it, the pages lapse at the consumer's claim timeout)."""
        uncache = disagg_req_id in self._uncached
        sent = self._send(self._service.release, disagg_req_id, uncache)
        if not sent and len(self._unreleased) < MAX_UNRELEASED:
            self._unreleased.add(disagg_req_id)
        else:
            self._uncached.discard(disagg_req_id)

    def _release_again(self) -> None:
        unreleased, self._unreleased = self._unreleased, set()
        for disagg_req_id in unreleased:
            self._release(disagg_req_id)

    def _report_consumer(self) -> None:
        """The consumer rank's counters (kept by its process) as this step's deltas,
        and its buffer's use as gauges."""
        snapshot = self._service.stats
        if not snapshot:
            return  # no answer from the consumer's process yet
        for name in EXPORTED_COUNTERS:
            delta = snapshot[name] - self._consumer_counts.get(name, 0)
            if delta:
                self._stats.add(CONSUMER_PREFIX + name, delta)
                self._consumer_counts[name] = snapshot[name]
        for name in EXPORTED_GAUGES:
            self._stats.set_gauge(CONSUMER_PREFIX + name, snapshot[name])

    def _release_copied(self) -> None:
        """Give back the pages of loads whose copy out of them is done."""
        still = []
        for copy, disagg_req_id in self._releasing:
            if copy.done():
                self._release(disagg_req_id)
            else:
                still.append((copy, disagg_req_id))
        self._releasing = still

    def close(self) -> None:
        """Let the copies still reading the receive buffer finish, then stop its process."""
        deadline = time.monotonic() + DEVICE_COPY_TIMEOUT_S
        for copy, _ in self._releasing:
            with contextlib.suppress(TransferError):
                copy.wait(deadline)
        self._releasing = []
        self._checks.close()
        self._service.close()
        self._cache.close()

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
                "sync": pending.load.sync,
            }
        )

    def _try_load(self, pending: _PendingLoad, state: LoadState | None) -> bool | None:
        """True once loaded, False if it failed, None while its chunks are still on the way.
        ``state``: what the consumer's process said of it this step, if anything."""
        load = pending.load
        if pending.copying is not None:
            # Scattered already: vLLM reads the blocks only once it is told, after the copy.
            return self._loaded(pending) if pending.copying.done() else None
        if state is not None and state.dropped is not None:
            return self._failed(
                pending, "abandoned", "loads_abandoned", f"KV abandoned: {state.dropped}"
            )
        if state is not None and state.start == len(pending.landed):
            pending.landed.extend(state.landed)
        if len(pending.landed) < len(pending.keys):
            if time.monotonic() < pending.deadline:
                return None
            return self._failed(
                pending,
                "timeout",
                "load_timeouts",
                f"KV not landed within {self._config.load_timeout_s:.1f} s",
            )
        # Only pages this request holds: they keep their bytes until it is released.
        if pending.digests is None:
            pending.digests = [
                self._checks.digest(self._service.chunk(landed))
                if landed.checksum is not None and not cache.hashes_in_pass
                else None
                for cache, landed in zip(pending.caches, pending.landed, strict=True)
            ]
        if not load.sync and not all(d is None or d.done() for d in pending.digests):
            return None  # still hashing; a synchronous load waits for them below
        copy: Copy = COPIED
        try:
            for landed, digest in zip(pending.landed, pending.digests, strict=True):
                if digest is not None:
                    check_landed(landed, digest.result(timeout=SYNC_CHECK_WAIT_S))
            # Each cache's chunks in one call (on a GPU, one launch for the whole load).
            for cache, indices in _by_cache(pending.caches):
                landed = [pending.landed[i] for i in indices]
                chunks = [
                    ChunkBytes(
                        self._service.chunk(chunk), pending.keys[i].start, pending.keys[i].end
                    )
                    for i, chunk in zip(indices, landed, strict=True)
                ]
                hashed = cache.hashes_in_pass and any(c.checksum is not None for c in landed)
                copy, digests = cache.scatter_chunks(
                    chunks, load.block_ids, load.start, hashed=hashed, model_waits=load.sync
                )
                if hashed:
                    # Taken in the copy's pass: the bytes were written already; a mismatch
                    # fails the load, so vLLM recomputes them.
                    for chunk, chunk_digest in zip(landed, digests, strict=True):
                        check_landed(chunk, chunk_digest)
        except IntegrityError as exc:
            copy.order_model()  # vLLM recomputes into these blocks: after the copy
            return self._failed(
                pending, "unusable", "integrity_failures", f"received KV unusable: {exc}"
            )
        except TimeoutError:
            copy.order_model()
            return self._failed(
                pending, "unchecked", None, f"checksums not taken in {SYNC_CHECK_WAIT_S:.0f} s"
            )
        except Exception:
            copy.order_model()
            raise
        if load.sync and not copy.done():
            # The coming forward pass reads the blocks after the copy (its stream waits for
            # it); the pages may be written again only once the copy has read them.
            self._releasing.append((copy, load.disagg_req_id))
            return self._loaded(pending, release=False)
        if not copy.done():
            pending.copying = copy
            return None
        return self._loaded(pending)

    def _loaded(self, pending: _PendingLoad, release: bool = True) -> bool:
        """Count and log a load whose chunks are in its blocks (or queued before the model's
        next work); its pages go back with ``release`` (its copy has read them)."""
        load = pending.load
        if release:
            self._release(load.disagg_req_id)
        tokens = len(load.prompt) - load.start
        self._traced(pending, "loaded", tokens)
        self._stats.add("loads_completed")
        self._stats.add("tokens_loaded", tokens)
        logger.info(
            "req %s: rank %d loaded %d prompt tokens%s%s",
            load.req_id,
            self._rank,
            tokens,
            " from its consumer's cache" if load.local else "",
            " before its first step" if load.sync else "",
        )
        return True

    def _failed(self, pending: _PendingLoad, outcome: str, counter: str | None, why: str) -> bool:
        """Give the load's pages back and have vLLM recompute its prompt."""
        load = pending.load
        self._release(load.disagg_req_id)
        self._traced(pending, outcome)
        if counter is not None:
            self._stats.add(counter)
        self._stats.add("loads_failed")
        logger.warning(
            "req %s (%s): %s; recomputing the prompt", load.req_id, load.disagg_req_id, why
        )
        return False
