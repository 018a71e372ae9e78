"""The consumer rank: serves the init and alloc ports, receives chunks, hands them out by key.

One service thread owns both ZMQ sockets and every NIXL call after start-up (NIXL is not
thread-safe); the public methods, called from any thread, share the chunk store under one lock.
A chunk counts as landed only once the producer's WriteDone notification, which NIXL delivers
after the write's data, has been read.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import zmq

from lmcache_pd import protocol
from lmcache_pd.affinity import unpin_this_thread
from lmcache_pd.compat import KVProfile, incompatibilities
from lmcache_pd.config import PDConfig
from lmcache_pd.errors import (
    AllocationError,
    BufferFull,
    ConfigError,
    IntegrityError,
    ProtocolError,
    RequestDropped,
    VersionMismatch,
)
from lmcache_pd.kernels.integrity import checksum
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.protocol import ErrorCode, ErrorReply, ProbeState
from lmcache_pd.transfer import landed_board
from lmcache_pd.transfer.allocator import PageAllocator
from lmcache_pd.transfer.channel import Channel, NixlChannel
from lmcache_pd.transfer.chunk_store import ChunkStore, LandedChunk
from lmcache_pd.transfer.watchdog import Watchdog
from lmcache_pd.transport import stack_identity

logger = logging.getLogger(__name__)

# The service loop's wait when no write is pending; with one pending it polls NIXL every
# BUSY_POLL_S so that a landed chunk is seen within ~0.1 ms.
IDLE_POLL_MS = 5
BUSY_POLL_S = 0.0001
# Messages handled per socket per loop turn, so that one flooding peer cannot starve the rest.
MAX_MESSAGES_PER_TURN = 64
STOP_TIMEOUT_S = 5.0
# After an unexpected error in a turn of the service loop: a pause, so that an error that
# repeats every turn logs a few lines a second rather than spinning a core.
ERROR_PAUSE_S = 0.1
# A service loop silent this long is stuck somewhere: the watchdog logs where.
SERVICE_STALL_S = 2.0


@dataclass(slots=True)
class ConsumerStats:
    """Counters of one consumer rank since it started."""

    init_requests: int = 0
    alloc_requests: int = 0
    malformed_messages: int = 0
    version_mismatches: int = 0
    refused_buffer_full: int = 0
    refused_too_large: int = 0
    refused_dropped: int = 0
    requests_abandoned: int = 0
    chunks_allocated: int = 0
    chunks_already_held: int = 0
    chunks_landed: int = 0
    bytes_landed: int = 0
    pages_reserved: int = 0  # handed out ahead of any push (ReserveRequest)
    chunks_landed_reserved: int = 0  # of chunks_landed, written into pages reserved ahead
    unknown_notifications: int = 0
    allocations_cancelled: int = 0
    internal_errors: int = 0
    service_stalls: int = 0
    leases_expired: int = 0
    holds_expired: int = 0
    integrity_failures: int = 0
    handshakes_refused: int = 0
    self_tests_landed: int = 0


@dataclass(slots=True)
class _Probe:
    """A transport self-test handed out: its slot, when, and what was seen of it."""

    slot: int
    issued_at: float
    state: ProbeState = ProbeState.PENDING


@dataclass(slots=True)
class _Probes:
    """Self-tests handed out, by nonce; the service thread's own."""

    by_nonce: dict[bytes, _Probe] = field(default_factory=dict)
    next_slot: int = 0


def receive_buffer_bytes(config: PDConfig) -> int:
    """Size of a consumer's registered buffer: its pages, then the self-test slots."""
    return config.num_pages * config.page_bytes + protocol.PROBE_AREA_BYTES


def landed_view(buffer: torch.Tensor, page_bytes: int, landed: LandedChunk) -> torch.Tensor:
    """The view of ``buffer`` a landed chunk occupies, unchecked: for a caller that checks it
    in the pass that copies it out (``check_landed``)."""
    start = landed.page * page_bytes
    return buffer[start : start + landed.nbytes]


def check_landed(landed: LandedChunk, digest: int | None) -> None:
    """Raise ``IntegrityError`` (logged) unless ``digest``, the hash of the chunk's bytes as
    read, is the producer's checksum (or the producer sent none)."""
    if landed.checksum is not None and digest != landed.checksum:
        logger.error("chunk in page %d fails its checksum", landed.page)
        raise IntegrityError(f"chunk in page {landed.page} fails its checksum")


def landed_bytes(buffer: torch.Tensor, page_bytes: int, landed: LandedChunk) -> torch.Tensor:
    """The view of ``buffer`` a landed chunk occupies, once its bytes match the producer's
    checksum (a pass of its own over them); raises ``IntegrityError`` if they do not."""
    view = landed_view(buffer, page_bytes, landed)
    check_landed(landed, None if landed.checksum is None else checksum(view))
    return view


class Consumer:
    """Receives chunks into its registered buffer; use as a context manager or call ``close``."""

    def __init__(
        self,
        config: PDConfig,
        keyer: ChunkKeyer,
        *,
        channel: Channel | None = None,
        profile: KVProfile | None = None,
        buffer: torch.Tensor | None = None,
        board: Path | None = None,
    ) -> None:
        """``profile``: what the vLLM connector knows of its KV format (compared with every
        producer's at handshake); by default only the config's chunk size and page bytes.
        A Consumer is one rank: ports listed per rank are rank 0's unless the caller gives
        ``config.for_rank(rank)`` (the connector does). ``buffer``: where chunks land, of
        ``receive_buffer_bytes(config)`` bytes (memory shared with another process); by default
        a buffer of its own. ``board``: where to post chunks landed per unclaimed request
        for decode's scheduler (``landed_board.py``); None: nowhere."""
        if config.kv_role != "kv_consumer":
            raise ConfigError(f"a Consumer needs kv_role kv_consumer, got {config.kv_role}")
        config = config.for_rank(0)
        self.config = config
        self.keyer = keyer
        self.stats = ConsumerStats()
        self.profile = profile or KVProfile(
            chunk_size=config.chunk_size, page_bytes=config.page_bytes
        )
        self._stack = stack_identity()
        self._board = board
        # Chunks landed (or were found held) since the last post: the service thread's alone.
        self._landed_changed = False
        self._probes = _Probes()
        self._lock = threading.Lock()
        allocator = PageAllocator(
            num_pages=config.num_pages, page_bytes=config.page_bytes, lease_s=config.alloc_lease_s
        )
        self._store = ChunkStore(
            allocator,
            claim_s=config.claim_timeout_s,
            hold_s=config.hold_timeout_s,
            cache_pages=config.cache_pages,
        )
        # Zeroed now so that every page is faulted in here, not on the first transfers. The
        # self-test slots follow the pages.
        self._pages_bytes = config.num_pages * config.page_bytes
        size = receive_buffer_bytes(config)
        if buffer is not None and (buffer.dtype != torch.uint8 or buffer.numel() != size):
            raise ConfigError(f"a receive buffer must be {size} bytes of uint8")
        self._buffer = (torch.empty(size, dtype=torch.uint8) if buffer is None else buffer).zero_()
        self._channel = channel or NixlChannel.from_config(config, role="consumer")
        self._context = zmq.Context()
        self._stop = threading.Event()
        try:
            self._registered = self._channel.register(self._buffer)
            self._agent_metadata = protocol.AgentMetadata(
                version=protocol.PROTOCOL_VERSION,
                agent_name=self._channel.agent_name,
                metadata=self._channel.local_metadata(),
                profile=self.profile,
                stack=self._stack,
            )
            self._init_socket = self._bind(config.init_port)
            self._alloc_socket = self._bind(config.alloc_port)
        except BaseException:
            self._close_resources()
            raise
        self._watchdog = Watchdog(
            "consumer service loop", SERVICE_STALL_S, self._count_stall, config.thread_cpus
        )
        self._thread = threading.Thread(target=self._serve, name="lmcache-pd-consumer", daemon=True)
        self._thread.start()
        logger.info(
            "consumer %s serving init %s:%d alloc %s:%d, %d pages of %d bytes",
            self._channel.agent_name,
            config.receiver_host,
            config.init_port,
            config.receiver_host,
            config.alloc_port,
            config.num_pages,
            config.page_bytes,
        )

    # ---- public API (any thread) ----

    @property
    def used_pages(self) -> int:
        with self._lock:
            return self._store.used_pages

    def stats_snapshot(self) -> dict[str, int]:
        """Counters plus the buffer's current use."""
        with self._lock:
            return {
                **asdict(self.stats),
                **{f"cache_{name}": n for name, n in asdict(self._store.cache_counts).items()},
                "used_pages": self._store.used_pages,
                "cached_pages": self._store.cached_pages,
                "pending_writes": self._store.pending_writes,
                "reserved_pages": self._store.reserved_pages,
                "held_requests": self._store.held_requests,
            }

    @property
    def held_requests(self) -> int:
        with self._lock:
            return self._store.held_requests

    def lookup(self, tokens: Sequence[int] | np.ndarray) -> int:
        """How many leading tokens of ``tokens`` have landed here, whole chunks at a time."""
        keys = self.keyer.chunk_keys(tokens)
        landed = 0
        with self._lock:
            while landed < len(keys) and self._store.landed(keys[landed].key) is not None:
                landed += 1
        return keys[landed - 1].end if landed else 0

    def load_progress(
        self, holder: str, keys: Sequence[bytes]
    ) -> tuple[str | None, list[LandedChunk]]:
        """Why ``holder`` was let go (its KV will not come), else None and where the leading
        ``keys`` that have landed in pages it holds are, in order, up to the first that has not.
        Those pages keep their bytes until ``holder`` is released."""
        landed: list[LandedChunk] = []
        with self._lock:
            reason = self._store.dropped_reason(holder)
            if reason is None:
                for key in keys:
                    chunk = self._store.landed(key, holder)
                    if chunk is None:
                        break
                    landed.append(chunk)
        return reason, landed

    def claim(self, req_id: str, not_needed: frozenset[bytes] = frozenset()) -> str | None:
        """A decode is about to wait for ``req_id``'s KV: keep its pages until released, except
        chunks in ``not_needed`` (its own prefix cache has them: let go, and not written if
        still to come). Returns why the request was let go (its KV will not come: recompute
        now), else None."""
        with self._lock:
            return self._store.claim(req_id, time.monotonic(), not_needed)

    def dropped_reason(self, req_id: str) -> str | None:
        """Why ``req_id`` was let go (abandoned by its producer, lapsed...), else None."""
        with self._lock:
            return self._store.dropped_reason(req_id)

    def get_chunk(self, key: bytes) -> torch.Tensor:
        """The landed chunk's bytes, a view valid until every request holding it is released.

        Raises ``KeyError`` if it has not landed and ``IntegrityError`` if its bytes do not match
        the producer's checksum.
        """
        with self._lock:
            landed = self._store.landed(key)
        if landed is None:
            raise KeyError(f"chunk {key.hex()} has not landed")
        try:
            return landed_bytes(self._buffer, self.config.page_bytes, landed)
        except IntegrityError:
            with self._lock:
                self.stats.integrity_failures += 1
            raise

    def count_internal_error(self) -> None:
        """A caller's bug while serving this consumer (counted as the service loop's are)."""
        with self._lock:
            self.stats.internal_errors += 1

    def release(self, req_id: str) -> None:
        """The request is done with its chunks; pages nobody else holds return to the free list,
        and its later pushes are refused."""
        with self._lock:
            freed = self._store.release(req_id, time.monotonic())
        logger.debug("req %s released, %d pages freed", req_id, freed)

    def close(self) -> None:
        """Stop the service thread, then close sockets and the channel; idempotent. The thread
        owns them while it runs: if it does not stop in time they are left to the process's
        exit rather than torn down under it."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(STOP_TIMEOUT_S)
        self._watchdog.close()
        if self._thread.is_alive():
            logger.error(
                "consumer service thread did not stop in %.1f s; its sockets and NIXL agent are "
                "left to the process's exit",
                STOP_TIMEOUT_S,
            )
            return
        self._close_resources()
        if self._board is not None:
            landed_board.remove(self._board)

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- service thread ----

    def _serve(self) -> None:
        unpin_this_thread(self.config.thread_cpus, "consumer service thread")
        poller = zmq.Poller()
        poller.register(self._init_socket, zmq.POLLIN)
        poller.register(self._alloc_socket, zmq.POLLIN)
        while not self._stop.is_set():
            self._watchdog.beat()
            try:
                self._turn(poller)
            except Exception:  # the service thread must outlive any one bad turn
                with self._lock:
                    self.stats.internal_errors += 1
                logger.exception("consumer service loop: unexpected error, serving on")
                self._stop.wait(ERROR_PAUSE_S)

    def _turn(self, poller: zmq.Poller) -> None:
        """One round: read landed writes, answer queued requests, take back what lapsed.
        Landed writes first: a ReserveRequest sent after its push's write then finds that
        write's reserved pages handed over already."""
        with self._lock:
            busy = self._store.expecting_writes(time.monotonic())
        ready = dict(poller.poll(0 if busy else IDLE_POLL_MS))
        self._on_notifications()
        if self._init_socket in ready:
            self._drain(self._init_socket, self._on_init)
        if self._alloc_socket in ready:
            self._drain(self._alloc_socket, self._on_alloc)
        self._expire()
        if self._landed_changed:
            self._post_landed()
        if busy and not ready:
            time.sleep(BUSY_POLL_S)

    def _post_landed(self) -> None:
        self._landed_changed = False
        if self._board is not None:
            with self._lock:
                landed = self._store.unclaimed_landed()
            landed_board.post(self._board, landed)

    def _drain(self, socket: zmq.Socket, handler: Callable[[bytes], protocol.Message]) -> None:
        """Answer up to MAX_MESSAGES_PER_TURN queued requests, each exactly once."""
        for _ in range(MAX_MESSAGES_PER_TURN):
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            # A DEALER sends [identity, body]; a REQ adds an empty delimiter we echo back.
            envelope, body = frames[:1], frames[1:]
            if len(body) > 1 and body[0] == b"":
                envelope, body = frames[:2], frames[2:]
            if len(body) != 1:
                self.stats.malformed_messages += 1
                logger.warning("refused a malformed message: %d body frames, not 1", len(body))
                reply = self._refuse(ErrorCode.MALFORMED, f"expected 1 body frame, got {len(body)}")
            else:
                reply = self._handle(handler, body[0])
            with contextlib.suppress(zmq.ZMQError):
                socket.send_multipart([*envelope, protocol.encode(reply)], zmq.NOBLOCK)

    def _handle(
        self, handler: Callable[[bytes], protocol.Message], body: bytes
    ) -> protocol.Message:
        """Run one handler; a bug of ours gets an error reply and a log, and serving goes on."""
        try:
            return handler(body)
        except Exception:
            self.stats.internal_errors += 1
            logger.exception("internal error while answering a %d-byte message", len(body))
            return self._refuse(ErrorCode.INTERNAL, "internal error, see the consumer's log")

    def _decode(self, codec: protocol.Codec, body: bytes) -> object | ErrorReply:
        try:
            return codec.decode(body)
        except VersionMismatch as exc:
            self.stats.version_mismatches += 1
            logger.warning("refused a message: %s", exc)
            return self._refuse(ErrorCode.VERSION, str(exc))
        except ProtocolError as exc:
            self.stats.malformed_messages += 1
            logger.warning("refused a malformed message (%d bytes): %s", len(body), exc)
            return self._refuse(ErrorCode.MALFORMED, str(exc))

    def _on_init(self, body: bytes) -> protocol.Message:
        message = self._decode(protocol.INIT_REQUESTS, body)
        if isinstance(message, ErrorReply):
            return message
        if isinstance(message, protocol.ProbeCheck):
            return self._on_probe_check(message)
        self.stats.init_requests += 1
        if isinstance(message, protocol.BufferRequest):
            return self._buffer_descriptors()
        problems = incompatibilities(message.profile, self.profile)
        if problems:
            with self._lock:
                self.stats.handshakes_refused += 1
            detail = "; ".join(problems)
            logger.warning("refused a producer's handshake (stack %s): %s", message.stack, detail)
            return self._refuse(ErrorCode.INCOMPATIBLE, f"incompatible KV: {detail}")
        return self._agent_metadata

    def _buffer_descriptors(self) -> protocol.BufferDescriptors:
        """The registered buffer, and a fresh self-test slot for the producer to write."""
        probes = self._probes
        now = time.monotonic()
        for nonce in [
            n for n, p in probes.by_nonce.items() if now - p.issued_at > protocol.PROBE_TICKET_TTL_S
        ]:
            del probes.by_nonce[nonce]
        slot = probes.next_slot
        probes.next_slot = (slot + 1) % protocol.PROBE_SLOTS
        # A slot is handed out again only PROBE_SLOTS self-tests later: forget its last one.
        for nonce in [n for n, p in probes.by_nonce.items() if p.slot == slot]:
            del probes.by_nonce[nonce]
        nonce = secrets.token_bytes(protocol.PROBE_NONCE_BYTES)
        probes.by_nonce[nonce] = _Probe(slot, now)
        registered = self._registered
        return protocol.BufferDescriptors(
            version=protocol.PROTOCOL_VERSION,
            agent_name=self._channel.agent_name,
            mem_type=registered.mem_type,
            device_id=registered.device_id,
            base_addr=registered.base_addr,
            page_bytes=self.config.page_bytes,
            num_pages=self.config.num_pages,
            alloc_lease_s=self.config.alloc_lease_s,
            probe_addr=registered.base_addr + self._slot_offset(slot),
            probe_nonce=nonce,
        )

    def _slot_offset(self, slot: int) -> int:
        return self._pages_bytes + slot * protocol.PROBE_NONCE_BYTES

    def _on_probe_check(self, check: protocol.ProbeCheck) -> protocol.ProbeResult:
        probe = self._probes.by_nonce.get(check.nonce)
        state = ProbeState.UNKNOWN if probe is None else probe.state
        return protocol.ProbeResult(
            version=protocol.PROTOCOL_VERSION, nonce=check.nonce, state=state
        )

    def _on_probe_done(self, peer: str, done: protocol.ProbeDone) -> None:
        """A self-test's notification: NIXL delivers it after its data, so the slot must hold
        the nonce by now."""
        probe = self._probes.by_nonce.get(done.nonce)
        if probe is None:
            logger.info("self-test notification from %s for a slot no longer known", peer)
            return
        start = self._slot_offset(probe.slot)
        # .cpu(): a GPU receive buffer (buffer_device cuda) is read by a 16-byte copy.
        nonce_bytes = self._buffer[start : start + protocol.PROBE_NONCE_BYTES].cpu()
        landed = bytes(nonce_bytes.numpy())
        probe.state = ProbeState.LANDED if landed == done.nonce else ProbeState.CORRUPT
        if probe.state is ProbeState.LANDED:
            with self._lock:
                self.stats.self_tests_landed += 1
        else:
            logger.warning("self-test from %s: notification arrived, data did not", peer)

    def _on_alloc(self, body: bytes) -> protocol.Message:
        request = self._decode(protocol.ALLOC_REQUESTS, body)
        if isinstance(request, ErrorReply):
            return request
        if isinstance(request, protocol.AllocCancel):
            return self._on_cancel(request)
        if isinstance(request, protocol.KVAbandoned):
            return self._on_abandoned(request)
        if isinstance(request, protocol.ReserveRequest):
            return self._on_reserve(request)
        req_id = request.req_id
        with self._lock:
            self.stats.alloc_requests += 1
            try:
                allocation = self._store.allocate(request, time.monotonic())
            except RequestDropped as exc:
                self.stats.refused_dropped += 1
                logger.info("req %s: push refused, the request was let go (%s)", req_id, exc.reason)
                return self._refuse(ErrorCode.DROPPED, str(exc), req_id)
            except BufferFull as exc:
                self.stats.refused_buffer_full += 1
                logger.warning("req %s: buffer full: %s", req_id, exc)
                return self._refuse(ErrorCode.BUFFER_FULL, str(exc), req_id, exc.retry_after_s)
            except AllocationError as exc:
                self.stats.refused_too_large += 1
                logger.warning("req %s: refused: %s", req_id, exc)
                return self._refuse(ErrorCode.TOO_LARGE, str(exc), req_id)
            except ProtocolError as exc:
                self.stats.malformed_messages += 1
                logger.warning("req %s: bad request: %s", req_id, exc)
                return self._refuse(ErrorCode.BAD_REQUEST, str(exc), req_id)
            self.stats.chunks_allocated += allocation.new_pages
            self.stats.chunks_already_held += len(allocation.pages) - allocation.new_pages
        self._landed_changed |= allocation.new_pages < len(allocation.pages)
        logger.debug(
            "req %s: alloc %d, %d chunks to write, %d already held",
            req_id,
            allocation.alloc_id,
            allocation.new_pages,
            len(allocation.pages) - allocation.new_pages,
        )
        return protocol.AllocResponse(
            version=protocol.PROTOCOL_VERSION,
            req_id=req_id,
            agent_name=self._channel.agent_name,
            alloc_id=allocation.alloc_id,
            pages=allocation.pages,
        )

    def _on_reserve(self, request: protocol.ReserveRequest) -> protocol.Message:
        with self._lock:
            try:
                reservation_id, pages = self._store.reserve(request.pages, time.monotonic())
            except BufferFull as exc:
                # Not an error of anyone's: the producer asks for pages per push meanwhile.
                logger.debug("no pages to reserve ahead: %s", exc)
                return self._refuse(ErrorCode.BUFFER_FULL, str(exc), "", exc.retry_after_s)
            self.stats.pages_reserved += len(pages)
        return protocol.Reservation(
            version=protocol.PROTOCOL_VERSION,
            agent_name=self._channel.agent_name,
            reservation_id=reservation_id,
            pages=pages,
        )

    def _on_cancel(self, cancel: protocol.AllocCancel) -> protocol.CancelAck:
        with self._lock:
            known = self._store.cancel(cancel)
            self.stats.allocations_cancelled += known
        logger.info(
            "req %s: producer cancelled alloc %d (%s)",
            cancel.req_id,
            cancel.alloc_id,
            "pages released" if known else "nothing pending",
        )
        return protocol.CancelAck(
            version=protocol.PROTOCOL_VERSION,
            req_id=cancel.req_id,
            alloc_id=cancel.alloc_id,
            known=known,
        )

    def _on_abandoned(self, abandoned: protocol.KVAbandoned) -> protocol.AbandonAck:
        """The request's KV will not come, or is not wanted: free what it holds, fail its load
        at the next step, refuse its later pushes."""
        req_id = abandoned.req_id
        with self._lock:
            known = self._store.knows(req_id)
            if not abandoned.write_in_flight:
                self._store.cancel_writes_of(req_id)
            self._store.release(req_id, time.monotonic(), abandoned.reason.value)
            self.stats.requests_abandoned += 1
        logger.warning(
            "req %s: KV abandoned (%s%s)%s",
            req_id,
            abandoned.reason.value,
            f": {abandoned.detail}" if abandoned.detail else "",
            "; its pages are freed" if known else "",
        )
        return protocol.AbandonAck(version=protocol.PROTOCOL_VERSION, req_id=req_id, known=known)

    def _on_notifications(self) -> None:
        for peer, message in self._channel.notifications():
            try:
                done = protocol.NOTIFICATIONS.decode(message)
                if isinstance(done, protocol.ProbeDone):
                    self._on_probe_done(peer, done)
                    continue
                with self._lock:
                    if isinstance(done, protocol.ReservedWriteDone):
                        landed, nbytes = self._store.land_reserved(done, time.monotonic())
                        self.stats.chunks_landed_reserved += landed
                    else:
                        landed, nbytes = self._store.confirm(done)
                    self.stats.chunks_landed += landed
                    self.stats.bytes_landed += nbytes
                self._landed_changed |= landed > 0
            except ProtocolError as exc:
                with self._lock:
                    self.stats.unknown_notifications += 1
                logger.warning("notification from %s ignored: %s", peer, exc)
                continue
            logger.debug("req %s: write landed, %d chunks kept", done.req_id, landed)

    def _expire(self) -> None:
        with self._lock:
            lapsed_writes, lapsed_holds = self._store.expire(time.monotonic())
            self.stats.leases_expired += len(lapsed_writes)
            self.stats.holds_expired += len(lapsed_holds)
        for req_id in lapsed_writes:
            logger.warning(
                "req %s: write not confirmed within %.1f s, its pages are taken back",
                req_id,
                self.config.alloc_lease_s,
            )
        for req_id in lapsed_holds:
            logger.warning(
                "req %s: chunks not claimed by a decode within %.1f s (or not released within "
                "%.1f s once claimed), hold dropped",
                req_id,
                self.config.claim_timeout_s,
                self.config.hold_timeout_s,
            )

    # ---- helpers ----

    def _count_stall(self) -> None:
        # Not under the lock: the stuck thread may be holding it. The watchdog's thread is
        # this counter's only writer.
        self.stats.service_stalls += 1

    @staticmethod
    def _refuse(
        code: ErrorCode, detail: str, req_id: str = "", retry_after_s: float = 0.0
    ) -> ErrorReply:
        return ErrorReply(
            version=protocol.PROTOCOL_VERSION,
            code=code,
            detail=detail[: protocol.MAX_ERROR_DETAIL_CHARS],
            req_id=req_id[: protocol.MAX_REQ_ID_CHARS],
            retry_after_s=retry_after_s,
        )

    def _bind(self, port: int) -> zmq.Socket:
        socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        # zmq drops a peer that sends a larger frame before we would allocate for it.
        socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
        try:
            socket.bind(f"tcp://{self.config.receiver_host}:{port}")
        except zmq.ZMQError as exc:
            socket.close()
            raise ConfigError(f"cannot bind {self.config.receiver_host}:{port}: {exc}") from exc
        return socket

    def _close_resources(self) -> None:
        for name in ("_init_socket", "_alloc_socket"):
            socket = getattr(self, name, None)
            if socket is not None:
                socket.close(linger=0)
                setattr(self, name, None)
        if not self._context.closed:
            self._context.term()
        self._channel.close()
