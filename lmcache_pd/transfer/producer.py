"""The producer rank: pushes a request's chunks into the consumer named by its DisaggSpec.

Per push: handshake with the consumer once (cached per peer), ask it for a page per chunk, write
the chunks it does not already hold from our registered staging buffer in one NIXL WRITE whose
notification carries the allocation id and checksums, and wait for the WRITE to finish. Every step
has its own deadline and raises a typed error; the write's deadline ends before the consumer's
lease on its pages (stated in the handshake) does.

A push of at most ``reserved_pages`` chunks skips the asking: it writes into pages the consumer
reserved for us ahead (``reservations.py``), and its notification says which chunk went where.
Each consumer rank we shook hands with is one ``PeerState`` (``peer_state.py``), which
allocates, writes and cancels. One owner thread calls ``connect``, ``push`` and ``abandon``
(NIXL is not thread-safe); ``staged`` may be called from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import zmq

from lmcache_pd import protocol
from lmcache_pd.auth import Door, Role, load_keys
from lmcache_pd.compat import KVProfile
from lmcache_pd.config import PDConfig
from lmcache_pd.errors import (
    AllocationError,
    ConfigError,
    PDError,
    PeerRestarted,
    ProtocolError,
    TransferError,
)
from lmcache_pd.kernels.integrity import checksum
from lmcache_pd.peers import PeerAddress
from lmcache_pd.protocol import AbandonReason, DisaggSpec
from lmcache_pd.transfer.channel import Channel, NixlChannel
from lmcache_pd.transfer.handshake import Count, Handshake, Peer
from lmcache_pd.transfer.peer_state import PeerState, Write
from lmcache_pd.transfer.sockets import ask, dealer
from lmcache_pd.transfer.staging import Staging

logger = logging.getLogger(__name__)

Chunk = tuple[bytes, torch.Tensor]
# Puts a push's chunks in place (or waits until they are) and returns their checksums.
Fill = Callable[[], Sequence[int] | None]


class PushResult(NamedTuple):
    """What one push moved (a named tuple: a frozen dataclass took ~4x as long to make, on
    every push's path)."""

    req_id: str
    chunks_sent: int
    chunks_skipped: int
    bytes_sent: int
    seconds: float
    reserved: bool = False  # written into pages reserved ahead, without asking first


class Producer:
    """Pushes chunks to consumers; use as a context manager or call ``close``."""

    def __init__(
        self,
        config: PDConfig,
        *,
        channel: Channel | None = None,
        staging: Staging | None = None,
        profile: KVProfile | None = None,
        count: Count | None = None,
    ) -> None:
        """``staging`` is shared with other producers of this process (a buffer of its own,
        of ``config``'s size, if None). ``channel`` (a fake, in tests) serves every peer;
        without it a NIXL agent is made per transport setting a handshake picks
        (``transport.py``). ``profile``: what the vLLM connector knows of its KV format,
        compared with each consumer's; by default the config's chunk size and page bytes.
        ``count`` is told of handshakes (``StatsRecorder.add``)."""
        if config.kv_role != "kv_producer":
            raise ConfigError(f"a Producer needs kv_role kv_producer, got {config.kv_role}")
        self.config = config
        self.profile = profile or KVProfile(
            chunk_size=config.chunk_size, page_bytes=config.page_bytes
        )
        self._staging = staging or Staging(num_pages=config.num_pages, page_bytes=config.page_bytes)
        self._given_channel = channel
        self._channels: dict[str | None, Channel] = {}
        if channel is not None:
            self._register(channel)
            self._channels[config.ucx_tls] = channel
        self._context = zmq.Context()
        self._keys = load_keys(config.secret_file, Role.PRODUCER)
        self._handshake = Handshake(
            config,
            profile=self.profile,
            staging=self._staging,
            context=self._context,
            channel_for=self._channel_for,
            count=count or (lambda name, n: None),
            keys=self._keys,
        )
        self._peers: dict[PeerAddress, PeerState] = {}
        self._closed = False

    def staged(self, count: int) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """``count`` page-sized views of the registered staging buffer, for callers that build
        chunks in place (no copy at push time); returned to the pool on exit."""
        return self._staging.pages(count)

    def push(
        self,
        spec: DisaggSpec,
        chunks: Sequence[Chunk],
        checksums: Sequence[int] | None = None,
        *,
        fill: Fill | None = None,
    ) -> PushResult:
        """Write ``chunks`` (key, contiguous tensor where the staging buffer is) to ``spec``'s
        consumer.

        Tensors inside the staging buffer (see ``staged``) go as they are; others are copied into
        staging first (room for them is taken before the consumer is asked for any).
        ``checksums``: each chunk's, where the caller took them while copying the chunk into
        staging (``CpuKVCache.gather(hashed=True)``); without them, and with integrity on, they
        are taken here, a pass of their own over the chunks. ``fill``: called once, after the
        consumer is asked for pages and before any byte of the chunks is read; it puts the
        bytes in place (or waits until they are) and returns their checksums, which replace
        ``checksums``: the allocation's round trip overlaps it. Raises ``PeerTimeout``,
        ``TransferError``, ``AllocationError`` (``BufferFull`` after ``max_alloc_retries``),
        ``PeerError`` or ``ProtocolError``.
        """
        if not chunks:
            raise ValueError(f"req {spec.req_id}: nothing to push")
        started = time.monotonic()
        sources: list[torch.Tensor] = []
        specs: list[protocol.ChunkSpec] = []
        outside: list[int] = []  # chunks not in staging, copied there (the connector's are in)
        for index, (key, tensor) in enumerate(chunks):  # one pass: a small push pays each
            data = self._as_bytes(spec.req_id, tensor)
            size = data.numel()
            sources.append(data)
            specs.append(protocol.ChunkSpec(key, size))
            if not self._staging.holds(data, size):
                outside.append(index)
        filled = _Filled(self, spec.req_id, sources, checksums, fill)
        # Chunks gathered into staging (the connector's) need no room: no page table taken.
        with self.staged(len(outside)) if outside else contextlib.nullcontext([]) as spare:
            copies = dict(zip(outside, spare, strict=True))
            try:
                to_write, reserved = self._push_once(spec, specs, sources, copies, filled)
            except PeerRestarted as exc:
                # Our handshake is with its former self: shake hands again and retry once.
                logger.warning("req %s: %s; shaking hands again", spec.req_id, exc)
                to_write, reserved = self._push_once(spec, specs, sources, copies, filled)
        result = PushResult(
            req_id=spec.req_id,
            chunks_sent=len(to_write),
            chunks_skipped=len(chunks) - len(to_write),
            bytes_sent=sum(specs[i].nbytes for i in to_write),
            seconds=time.monotonic() - started,
            reserved=reserved,
        )
        logger.debug(
            "req %s pushed to %s:%d: %s",
            spec.req_id,
            spec.receiver_host,
            spec.receiver_alloc_port,
            result,
        )
        return result

    def _push_once(
        self,
        spec: DisaggSpec,
        specs: list[protocol.ChunkSpec],
        sources: list[torch.Tensor],
        copies: dict[int, torch.Tensor],
        filled: _Filled,
    ) -> tuple[list[int], bool]:
        """Handshake if needed, allocate (or take pages reserved ahead), write; returns the
        indices of the chunks written and whether reserved pages took them. The AllocRequest
        goes out before the chunks are filled, its answer is read after."""
        state = self._state(spec)
        peer = state.peer
        sizes = [chunk.nbytes for chunk in specs]
        try:
            reserved = state.reservations.take(spec.req_id, len(specs))
            if reserved is None:
                deadline = time.monotonic() + peer.write_budget_s
                asked = state.ask_pages(spec, specs)
                try:
                    checksums = filled.checksums()
                except BaseException:
                    state.withdraw(spec, asked)  # PeerTimeout: the peer is forgotten below
                    raise
                response = state.allocate(spec, asked)
                to_write = [i for i, page in enumerate(response.pages) if page is not None]
                pages = [page for page in response.pages if page is not None]
                sums = None if checksums is None else [checksums[i] for i in to_write]
                done: protocol.Message = protocol.WriteDone(
                    version=protocol.PROTOCOL_VERSION,
                    req_id=spec.req_id,
                    alloc_id=response.alloc_id,
                    checksums=sums,
                )
                alloc_id: int | None = response.alloc_id
            else:
                # Sooner than an allocation's: the consumer takes reserved pages nobody wrote
                # back RESERVED_LEASE_S after it handed them out.
                budget_s = min(peer.write_budget_s, protocol.RESERVED_WRITE_S)
                deadline = reserved.asked_at + budget_s
                checksums = filled.checksums()
                to_write, pages = list(range(len(specs))), reserved.pages
                done = protocol.ReservedWriteDone(
                    version=protocol.PROTOCOL_VERSION,
                    req_id=spec.req_id,
                    reservation_id=reserved.reservation_id,
                    chunks=specs,
                    pages=pages,
                    checksums=None if checksums is None else list(checksums),
                )
                alloc_id = None  # nothing to cancel: unwritten, the pages lapse
            if to_write:
                addresses = [self._staged_address(sources[i], copies.get(i)) for i in to_write]
                write = Write(pages, [sizes[i] for i in to_write], addresses, done, alloc_id)
                try:
                    state.write(spec, write, deadline)
                except TransferError as exc:
                    if reserved is None:
                        raise
                    # No AllocResponse told us who answers there now: the consumer may have
                    # restarted since it reserved them (the pages would then be its former
                    # self's). Shake hands again and ask first.
                    raise PeerRestarted(f"write into pages reserved ahead failed: {exc}") from exc
        except AllocationError as exc:
            logger.warning("req %s: not pushed to %s: %s", spec.req_id, peer.name, exc)
            raise
        except PDError as exc:
            if filled.failed is exc:
                # Our own copy failed, its pages given back: the peer is as it was.
                logger.warning("req %s: not pushed to %s: %s", spec.req_id, peer.name, exc)
                raise
            # The peer may be gone or restarted: handshake afresh next time.
            logger.warning("req %s: push to %s failed: %s", spec.req_id, peer.name, exc)
            self._forget_peer(spec)
            raise
        return to_write, reserved is not None

    def abandon(
        self,
        spec: DisaggSpec,
        reason: AbandonReason,
        detail: str = "",
        *,
        write_in_flight: bool = True,
    ) -> bool:
        """Tell ``spec``'s consumer, best effort and within ``CANCEL_TIMEOUT_S``, that the
        request's KV will not come, so that its decode recomputes now rather than at its load
        deadline; ``write_in_flight=False`` lets it free the request's pending pages at once.
        Needs no NIXL handshake. Returns whether the consumer acknowledged it."""
        message = protocol.KVAbandoned.of(spec.req_id, reason, detail, write_in_flight)
        deadline = time.monotonic() + protocol.CANCEL_TIMEOUT_S
        socket = dealer(
            self._context, spec.receiver_host, spec.receiver_alloc_port, self._keys, Door.ALLOC
        )
        try:
            reply = ask(socket, message, protocol.ALLOC_REPLIES, deadline, spec.req_id)
        except PDError as exc:
            logger.warning(
                "req %s: could not tell %s:%d that its KV will not come: %s",
                spec.req_id,
                spec.receiver_host,
                spec.receiver_alloc_port,
                exc,
            )
            return False
        finally:
            socket.close(linger=0)
        return isinstance(reply, protocol.AbandonAck)

    def close(self) -> None:
        """Close peer sockets and the channel; idempotent."""
        if self._closed:
            return
        self._closed = True
        for state in self._peers.values():
            state.close()
        self._peers.clear()
        self._context.term()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- steps of a push ----

    def connected(self, spec: DisaggSpec) -> bool:
        """Whether a handshake with ``spec``'s consumer is done and still trusted."""
        return PeerAddress.of(spec) in self._peers

    def connect(self, spec: DisaggSpec) -> Peer:
        """The peer of ``spec``, after a handshake on its init port the first time; call ahead
        of a first push to take the handshake off its latency.

        See ``handshake.py``: raises ``Incompatible``, ``TransportUnusable``,
        ``PeerUnreachable``, ``ProtocolError`` or ``TransferError``. ``spec`` names one consumer
        rank (``DisaggSpec.for_rank``): each producer rank pushes its own shard.
        """
        return self._state(spec).peer

    def _state(self, spec: DisaggSpec) -> PeerState:
        """What we keep of ``spec``'s consumer, a handshake done with it first if none is."""
        if not isinstance(spec.receiver_init_port, int):
            raise ProtocolError(
                f"req {spec.req_id}: a push goes to one consumer rank; pick it with for_rank"
            )
        address = PeerAddress.of(spec)
        state = self._peers.get(address)
        if state is None:
            state = self._peers[address] = PeerState(self._handshake.run(spec), self.config)
        return state

    def _channel_for(self, ucx_tls: str | None) -> Channel:
        """The agent of ``ucx_tls``, made (and the staging buffer registered) on first use."""
        if self._given_channel is not None:
            return self._given_channel
        channel = self._channels.get(ucx_tls)
        if channel is None:
            config = self.config
            channel = NixlChannel(
                role="producer",
                backends=config.nixl_backends,
                ucx_error_handling_mode=config.ucx_error_handling_mode,
                progress_thread=config.nixl_progress_thread,
                ucx_tls=ucx_tls,
            )
            self._register(channel)
            self._channels[ucx_tls] = channel
        return channel

    def _register(self, channel: Channel) -> None:
        try:
            channel.register(self._staging.buffer)
        except BaseException:
            channel.close()
            raise

    # ---- helpers ----

    @staticmethod
    def _staged_address(data: torch.Tensor, copy: torch.Tensor | None) -> int:
        """Where a chunk to write lies in staging: where it is, or in its copy, made now."""
        if copy is None:
            return data.data_ptr()
        return copy[: data.numel()].copy_(data).data_ptr()

    def _as_bytes(self, req_id: str, tensor: torch.Tensor) -> torch.Tensor:
        device = self._staging.buffer.device  # CPU, or a GPU with buffer_device cuda
        if tensor.device != device or not tensor.is_contiguous():
            raise ValueError(f"req {req_id}: chunks must be contiguous tensors on {device}")
        # Staged pages are already flat bytes; every view costs microseconds per chunk.
        flat = tensor.dtype == torch.uint8 and tensor.dim() == 1
        data = tensor if flat else tensor.view(-1).view(torch.uint8)
        nbytes = data.numel()
        if not 0 < nbytes <= self.config.page_bytes:
            raise AllocationError(
                f"req {req_id}: a chunk of {nbytes} bytes does not fit a page of "
                f"{self.config.page_bytes} bytes"
            )
        return data

    def _forget_peer(self, spec: DisaggSpec) -> None:
        state = self._peers.pop(PeerAddress.of(spec), None)
        if state is not None:
            state.close()


class _Filled:
    """A push's chunks as ``fill`` makes them, once (a fill that failed is asked again, and
    fails again, on a retry), and their checksums: the caller's, or taken here with integrity
    on (a pass of their own); None with integrity off."""

    def __init__(
        self,
        producer: Producer,
        req_id: str,
        sources: list[torch.Tensor],
        checksums: Sequence[int] | None,
        fill: Fill | None,
    ) -> None:
        self._producer = producer
        self._req_id = req_id
        self._sources = sources
        self._fill = fill
        self._checksums = checksums
        self._done = fill is None
        self.failed: BaseException | None = None  # what the fill raised, if it did
        if self._done:
            self._check()

    def checksums(self) -> Sequence[int] | None:
        if not self._done:
            try:
                self._checksums = self._fill()
            except BaseException as exc:
                self.failed = exc
                raise
            self._done = True
            self._check()
        if not self._producer.config.integrity_checksums:
            return None
        if self._checksums is None:
            self._checksums = [checksum(data) for data in self._sources]
        return self._checksums

    def _check(self) -> None:
        if self._checksums is not None and len(self._checksums) != len(self._sources):
            raise ValueError(
                f"req {self._req_id}: {len(self._checksums)} checksums, {len(self._sources)} chunks"
            )
