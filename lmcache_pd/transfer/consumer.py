"""The consumer rank: serves the init and alloc ports, receives chunks, hands them out by key.

One service thread owns both ZMQ sockets and every NIXL call after start-up (NIXL is not
thread-safe): each turn it reads NIXL's notifications, answers the requests queued on the init
port (``init_port.py``) and the alloc port (``alloc_port.py``), and takes back what lapsed. The
public methods, called from any thread, share the chunk store under one lock. A chunk counts as
landed only once the producer's WriteDone notification, which NIXL delivers after the write's
data, has been read.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import zmq

from lmcache_pd import protocol
from lmcache_pd.affinity import unpin_this_thread
from lmcache_pd.auth import Door, Role, load_keys, unseal, warn_if_open
from lmcache_pd.compat import KVProfile
from lmcache_pd.config import PDConfig
from lmcache_pd.errors import (
    AllocationError,
    ConfigError,
    IntegrityError,
    ProtocolError,
    RequestDropped,
    VersionMismatch,
)
from lmcache_pd.gatekeeper import Gatekeeper, gatekeeper, sender_role
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.protocol import ErrorCode, ErrorReply
from lmcache_pd.transfer import landed_board, landed_keys
from lmcache_pd.transfer.alloc_port import AllocPort
from lmcache_pd.transfer.allocator import PageAllocator
from lmcache_pd.transfer.channel import Channel, NixlChannel
from lmcache_pd.transfer.chunk_store import Allocation, ChunkStore
from lmcache_pd.transfer.consumer_stats import ConsumerStats
from lmcache_pd.transfer.init_port import InitPort
from lmcache_pd.transfer.receive_buffer import LandedChunk, landed_bytes, receive_buffer_bytes
from lmcache_pd.transfer.sockets import bind_router, refusal
from lmcache_pd.transfer.watchdog import Watchdog

logger = logging.getLogger(__name__)

Request = TypeVar("Request")
# A port's answer to one message: (routing id, body, the sender's role where CURVE tells it).
Handler = Callable[[bytes, bytes, Role | None], protocol.Message]

# The service loop's wait when no write is pending; with one pending it polls NIXL every
# BUSY_POLL_S so that a landed chunk is seen within ~0.1 ms.
IDLE_POLL_MS = 5
BUSY_POLL_S = 0.0001
# Messages handled per socket per loop turn, so that one flooding peer cannot starve the rest.
MAX_MESSAGES_PER_TURN = 64
# How long closing waits for the service thread to end its turn and stop.
SERVICE_JOIN_TIMEOUT_S = 5.0
# After an unexpected error in a turn of the service loop: a pause, so that an error that
# repeats every turn logs a few lines a second rather than spinning a core.
ERROR_PAUSE_S = 0.1
# A service loop silent this long is stuck somewhere: the watchdog logs where.
SERVICE_STALL_S = 2.0


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
        self._board_path = board
        self._board: landed_board.BoardWriter | None = None
        self._keys_board: landed_keys.KeysWriter | None = None
        # The store's keys_version last posted on the keys board, and when: the service
        # thread's alone.
        self._keys_posted: tuple[int, float] = (-1, 0.0)
        # Chunks landed (or were found held) since the last post, and that post: the service
        # thread's alone (a post that would change nothing is not written).
        self._landed_changed = False
        self._last_post: dict[str, int] | None = None
        self._lock = threading.Lock()
        allocator = PageAllocator(
            num_pages=config.num_pages, page_bytes=config.page_bytes, lease_s=config.alloc_lease_s
        )
        self._store = ChunkStore(
            allocator,
            claim_s=config.claim_timeout_s,
            hold_s=config.hold_timeout_s,
            cache_pages=config.cache_pages,
            max_producer_share=config.max_producer_share,
        )
        self._context = zmq.Context()
        self._keys = load_keys(config.secret_file, Role.CONSUMER)
        where = f"consumer ports {config.init_port}/{config.alloc_port}"
        self._unauthenticated = warn_if_open(self._keys, where, config.receiver_host)
        self._stop = threading.Event()
        # Before the ports: a port that binds with no handler refuses every client.
        self._gate: Gatekeeper | None = gatekeeper(self._context, self._keys)
        # The ports first: a consumer that cannot have them fails at once, before it touched
        # its buffer or made a NIXL agent (both slow on a busy host, where the agent also waits
        # its turn for the host's UCX lock).
        host, gate = config.receiver_host, self._gate
        try:
            self._init_socket = bind_router(self._context, host, config.init_port, gate, Door.INIT)
            self._alloc_socket = bind_router(
                self._context, host, config.alloc_port, gate, Door.ALLOC
            )
            # Zeroed now so that every page is faulted in here, not on the first transfers.
            # The self-test slots follow the pages.
            size = receive_buffer_bytes(config)
            if buffer is not None and (buffer.dtype != torch.uint8 or buffer.numel() != size):
                raise ConfigError(f"a receive buffer must be {size} bytes of uint8")
            self._buffer = (
                torch.empty(size, dtype=torch.uint8) if buffer is None else buffer
            ).zero_()
            self._channel = channel or NixlChannel.from_config(config, role="consumer")
            self._alloc_port = AllocPort(
                agent_name=self._channel.agent_name,
                store=self._store,
                stats=self.stats,
                lock=self._lock,
                on_found_held=self._mark_landed,
            )
            self._init_port = InitPort(
                config,
                profile=self.profile,
                channel=self._channel,
                registered=self._channel.register(self._buffer),
                buffer=self._buffer,
                stats=self.stats,
                lock=self._lock,
            )
        except BaseException:
            self._close_resources()
            raise
        self._board, self._keys_board = self._make_board(), self._make_keys_board()
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
                **asdict(self._store.limit_counts),
                "used_pages": self._store.used_pages,
                "cached_pages": self._store.cached_pages,
                "pending_writes": self._store.pending_writes,
                "reserved_pages": self._store.reserved_pages,
                "held_requests": self._store.held_requests,
                "dropped_requests": self._store.dropped_requests,
                "unauthenticated": int(self._unauthenticated),
                "peers_refused": 0 if self._gate is None else self._gate.refused,
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

    def adopt(self, req_id: str, keys: Sequence[bytes]) -> str | None:
        """Decode serves ``req_id`` alone and will load the leading ``keys`` landed here: it
        holds them, claimed, until released (see ``ChunkStore.adopt``). Returns why it holds
        none (decode then computes those tokens), else None."""
        try:
            with self._lock:
                held = self._store.adopt(req_id, keys, time.monotonic())
        except (AllocationError, RequestDropped) as exc:  # too many holds here, or a reused id
            logger.info("req %s: landed chunks not held for a local load: %s", req_id, exc)
            return str(exc)
        return None if held else "not landed"

    def keep_room(self, req_id: str, chunks: Sequence[protocol.ChunkSpec]) -> Allocation:
        """Decode computed ``chunks`` itself and keeps them here, as if pushed: pages for
        those not here already, held for ``req_id`` (a name of its own) until ``kept``.
        Raises ``AllocationError`` (no room now) or ``RequestDropped`` (a reused name)."""
        with self._lock:
            return self._store.allocate(
                protocol.AllocRequest(protocol.PROTOCOL_VERSION, req_id, list(chunks)),
                time.monotonic(),
            )

    def kept(self, req_id: str, alloc_id: int, checksums: list[int] | None) -> None:
        """The chunks ``keep_room`` gave pages to are written: they land, and stay as cached
        chunks no request holds (none if the allocation lapsed meanwhile)."""
        lapsed = None
        with self._lock:
            try:
                landed, _ = self._store.confirm(
                    protocol.WriteDone(protocol.PROTOCOL_VERSION, req_id, alloc_id, checksums)
                )
            except ProtocolError as exc:
                landed, lapsed = 0, exc
            self._store.release(req_id, time.monotonic())
            self.stats.chunks_kept += landed
        if lapsed is not None:
            logger.warning("%s: computed chunks not kept: %s", req_id, lapsed)

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

    def release(self, req_id: str, uncache: bool = False) -> None:
        """The request is done with its chunks; pages nobody else holds return to the free list
        (or stay in the cache, unless ``uncache``: the chunks pushed for it then leave it too),
        and its later pushes are refused."""
        with self._lock:
            freed = self._store.release(req_id, time.monotonic(), uncache=uncache)
        logger.debug("req %s released, %d pages freed", req_id, freed)

    def close(self) -> None:
        """Stop the service thread, then close sockets and the channel; idempotent. The thread
        owns them while it runs: if it does not stop in time they are left to the process's
        exit rather than torn down under it."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(SERVICE_JOIN_TIMEOUT_S)
        self._watchdog.close()
        if self._thread.is_alive():
            logger.error(
                "consumer service thread did not stop in %.1f s; its sockets and NIXL agent are "
                "left to the process's exit",
                SERVICE_JOIN_TIMEOUT_S,
            )
            return
        self._close_resources()
        for board in (self._board, self._keys_board):
            if board is not None:
                board.close()

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
        self._post_landed_keys()
        if busy and not ready:
            time.sleep(BUSY_POLL_S)

    def _post_landed(self) -> None:
        self._landed_changed = False
        if self._board is not None:
            with self._lock:
                landed = self._store.unclaimed_landed()
            if landed != self._last_post:
                self._board.post(landed)  # memory writes only: no system call
                self._last_post = landed

    def _post_landed_keys(self) -> None:
        """Post the landed chunks' keys if they may have changed since the last post, at
        most every ``POST_INTERVAL_S`` (``landed_keys.py``)."""
        if self._keys_board is None:
            return
        version, posted_at = self._keys_posted
        now = time.monotonic()
        if self._store.keys_version == version or now - posted_at < landed_keys.POST_INTERVAL_S:
            return
        with self._lock:
            version, keys = self._store.keys_version, self._store.landed_keys()
        self._keys_board.post(keys)  # memory writes only: no system call
        self._keys_posted = (version, now)

    def _drain(self, socket: zmq.Socket, handler: Handler) -> None:
        """Answer up to MAX_MESSAGES_PER_TURN queued requests, each exactly once. A request is
        [routing id, one body frame] (a DEALER's); a message of more frames is refused unread,
        its extra frames let go one by one (zmq holds them already: it queues only whole
        messages)."""
        for _ in range(MAX_MESSAGES_PER_TURN):
            try:
                routing_id = socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            body, role = b"", None
            if socket.getsockopt(zmq.RCVMORE):
                frame = socket.recv(zmq.NOBLOCK, copy=False)
                body = frame.bytes
                role = None if self._gate is None else sender_role(frame)
            extra = 0
            while socket.getsockopt(zmq.RCVMORE):
                socket.recv(zmq.NOBLOCK, copy=False)
                extra += 1
            if extra:
                with self._lock:
                    self.stats.malformed_messages += 1
                    self.stats.refused_extra_frames += 1
                logger.warning(
                    "refused a message of %d body frames unread (a request is one frame)",
                    extra + 1,
                )
                reply = refusal(ErrorCode.MALFORMED, f"expected 1 body frame, got {extra + 1}")
            else:
                reply = self._handle(handler, routing_id, body, role)
            with contextlib.suppress(zmq.ZMQError):
                socket.send_multipart([routing_id, protocol.encode(reply)], zmq.NOBLOCK)

    def _handle(
        self, handler: Handler, peer: bytes, body: bytes, role: Role | None
    ) -> protocol.Message:
        """Run one handler; a bug of ours gets an error reply and a log, and serving goes on."""
        try:
            return handler(peer, body, role)
        except Exception:
            with self._lock:
                self.stats.internal_errors += 1
            logger.exception("internal error while answering a %d-byte message", len(body))
            return refusal(ErrorCode.INTERNAL, "internal error, see the consumer's log")

    def _decode(self, codec: protocol.Codec[Request], body: bytes) -> Request | ErrorReply:
        try:
            return codec.decode(body)
        except VersionMismatch as exc:
            self.stats.version_mismatches += 1
            logger.warning("refused a message: %s", exc)
            return refusal(ErrorCode.VERSION, str(exc))
        except ProtocolError as exc:
            self.stats.malformed_messages += 1
            logger.warning("refused a malformed message (%d bytes): %s", len(body), exc)
            return refusal(ErrorCode.MALFORMED, str(exc))

    def _on_init(self, _peer: bytes, body: bytes, _role: Role | None) -> protocol.Message:
        message = self._decode(protocol.INIT_REQUESTS, body)
        return message if isinstance(message, ErrorReply) else self._init_port.answer(message)

    def _on_alloc(self, producer: bytes, body: bytes, role: Role | None) -> protocol.Message:
        request = self._decode(protocol.ALLOC_REQUESTS, body)
        if isinstance(request, ErrorReply):
            return request
        if role is Role.PROXY and not isinstance(request, protocol.KVAbandoned):
            # The proxy's key opens this port to let a request go, and for nothing else: a
            # proxy taken over gets no pages.
            req_id, kind = getattr(request, "req_id", ""), type(request).__name__
            with self._lock:
                self.stats.refused_for_role += 1
            logger.warning("req %s: refused a %s sent under the proxy's key", req_id, kind)
            detail = f"the proxy may only let a request go, not send {kind}"
            return refusal(ErrorCode.BAD_REQUEST, detail, req_id)
        return self._alloc_port.answer(request, producer)

    def _on_notifications(self) -> None:
        for peer, message in self._channel.notifications():
            try:
                done = protocol.NOTIFICATIONS.decode(unseal(self._keys, message))
                if isinstance(done, protocol.ProbeDone):
                    self._init_port.on_probe_done(peer, done)
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
        # Requests that name no transfer parameters (LMCache's proxy, landed_wait_s) never
        # claim their pushes: a hold lapsing is then how their pages join the cache.
        lapse_level = logging.DEBUG if self.config.landed_wait_s > 0 else logging.WARNING
        for req_id in lapsed_holds:
            logger.log(
                lapse_level,
                "req %s: chunks not claimed by a decode within %.1f s (or not released within "
                "%.1f s once claimed), hold dropped",
                req_id,
                self.config.claim_timeout_s,
                self.config.hold_timeout_s,
            )

    # ---- helpers ----

    def _make_board(self) -> landed_board.BoardWriter | None:
        """The landed board, made here, at start, not on the service loop: its posts are then
        memory writes only. None if there is no board or it cannot be made (every load is
        then asynchronous)."""
        if self._board_path is None:
            return None
        try:
            return landed_board.BoardWriter(self._board_path)
        except OSError as exc:
            logger.warning(
                "cannot make the landed board %s (every load will be asynchronous): %s",
                self._board_path,
                exc,
            )
            return None

    def _make_keys_board(self) -> landed_keys.KeysWriter | None:
        """The landed chunks' keys board beside the landed board, made at start; None if
        there is none or it cannot be made (the proxy then does not learn of them)."""
        if self._board_path is None:
            return None
        path = landed_keys.keys_path(self._board_path)
        try:
            return landed_keys.KeysWriter(path, self.config.num_pages)
        except OSError as exc:
            logger.warning("cannot make the landed keys board %s: %s", path, exc)
            return None

    def _mark_landed(self) -> None:
        self._landed_changed = True

    def _count_stall(self) -> None:
        # Not under the lock: the stuck thread may be holding it. The watchdog's thread is
        # this counter's only writer.
        self.stats.service_stalls += 1

    def _close_resources(self) -> None:
        for name in ("_init_socket", "_alloc_socket"):
            socket = getattr(self, name, None)
            if socket is not None:
                socket.close(linger=0)
                setattr(self, name, None)
        if self._gate is not None:  # after the sockets it guards, before the context ends
            self._gate.close()
        if not self._context.closed:
            self._context.term()
        channel = getattr(self, "_channel", None)  # None: it failed before it had one
        if channel is not None:
            channel.close()
