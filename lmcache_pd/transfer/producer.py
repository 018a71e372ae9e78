"""The producer rank: pushes a request's chunks into the consumer named by its DisaggSpec.

Per push: handshake with the consumer once (cached per peer), ask it for a page per chunk, write
the chunks it does not already hold from our registered staging buffer in one NIXL WRITE whose
notification carries the allocation id and checksums, and wait for the WRITE to finish. Every step
has its own deadline and raises a typed error; the write's deadline ends before the consumer's
lease on its pages (stated in the handshake) does.

A push of at most ``reserved_pages`` chunks skips the asking: it writes into pages the consumer
reserved for us ahead, and its notification says which chunk went where. The next reservation is
asked for while a write is in flight and read at the next push, so under steady traffic small
pushes pay no round trip at all. One owner thread calls ``connect``, ``push``
and ``abandon`` (NIXL is not thread-safe); ``staged`` may be called from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from lmcache_pd import protocol
from lmcache_pd.compat import KVProfile
from lmcache_pd.config import PDConfig
from lmcache_pd.errors import (
    AllocationError,
    BufferFull,
    ConfigError,
    PDError,
    PeerRestarted,
    ProtocolError,
    TransferError,
)
from lmcache_pd.kernels.integrity import checksum
from lmcache_pd.protocol import AbandonReason, DisaggSpec
from lmcache_pd.transfer.channel import Channel, NixlChannel, wait_for_transfer
from lmcache_pd.transfer.handshake import (
    Count,
    Handshake,
    Peer,
    ask,
    dealer,
    error_from_reply,
    receive,
    send,
)
from lmcache_pd.transfer.staging import Staging

logger = logging.getLogger(__name__)

Chunk = tuple[bytes, torch.Tensor]
PeerKey = tuple[str, int, int]
# Pages asked for at once, in pushes of ``reserved_pages`` chunks: one round trip (off the push's
# path, but still a send and a receive on its thread) per this many small pushes.
RESERVE_BATCH = 4


@dataclass(frozen=True, slots=True)
class PushResult:
    """What one push moved."""

    req_id: str
    chunks_sent: int
    chunks_skipped: int
    bytes_sent: int
    seconds: float
    reserved: bool = False  # written into pages reserved ahead, without asking first


@dataclass(slots=True)
class _Reserved:
    """Pages a consumer reserved for us ahead, not written yet, and when we asked for them: a
    write into them must end within ``RESERVED_WRITE_S`` of that."""

    reservation_id: int
    pages: list[int]
    asked_at: float


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
        self._handshake = Handshake(
            config,
            profile=self.profile,
            staging=self._staging,
            context=self._context,
            channel_for=self._channel_for,
            count=count or (lambda name, n: None),
        )
        self._peers: dict[PeerKey, Peer] = {}
        self._reserved: dict[PeerKey, _Reserved] = {}
        # Peers asked for pages ahead whose answer we have not read yet, and when we asked.
        self._reserving: dict[PeerKey, float] = {}
        # Reservations no longer used (stale or replaced), and when asked: given back if a push
        # finds the buffer full before the consumer took them back itself.
        self._set_aside_ids: dict[PeerKey, list[tuple[int, float]]] = {}
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
    ) -> PushResult:
        """Write ``chunks`` (key, contiguous tensor where the staging buffer is) to ``spec``'s
        consumer.

        Tensors inside the staging buffer (see ``staged``) go as they are; others are copied into
        staging first (room for them is taken before the consumer is asked for any).
        ``checksums``: each chunk's, where the caller took them while copying the chunk into
        staging (``CpuKVCache.gather(hashed=True)``); without them, and with integrity on, they
        are taken here, a pass of their own over the chunks. Raises
        ``PeerTimeout``, ``TransferError``, ``AllocationError`` (``BufferFull`` after
        ``max_alloc_retries``), ``PeerError`` or ``ProtocolError``.
        """
        if not chunks:
            raise ValueError(f"req {spec.req_id}: nothing to push")
        started = time.monotonic()
        sources = [self._as_bytes(spec.req_id, tensor) for _, tensor in chunks]
        if checksums is not None and len(checksums) != len(chunks):
            raise ValueError(f"req {spec.req_id}: {len(checksums)} checksums, {len(chunks)} chunks")
        if not self.config.integrity_checksums:
            checksums = None
        elif checksums is None:
            checksums = [checksum(data) for data in sources]
        sizes = [data.numel() for data in sources]
        specs = [
            protocol.ChunkSpec(key, size) for (key, _), size in zip(chunks, sizes, strict=True)
        ]
        outside = [i for i, data in enumerate(sources) if not self._staging.holds(data, sizes[i])]
        with self.staged(len(outside)) as spare:
            copies = dict(zip(outside, spare, strict=True))
            try:
                to_write, reserved = self._push_once(spec, specs, sources, sizes, copies, checksums)
            except PeerRestarted as exc:
                # Our handshake is with its former self: shake hands again and retry once.
                logger.warning("req %s: %s; shaking hands again", spec.req_id, exc)
                to_write, reserved = self._push_once(spec, specs, sources, sizes, copies, checksums)
        result = PushResult(
            req_id=spec.req_id,
            chunks_sent=len(to_write),
            chunks_skipped=len(chunks) - len(to_write),
            bytes_sent=sum(sizes[i] for i in to_write),
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
        sizes: list[int],
        copies: dict[int, torch.Tensor],
        checksums: Sequence[int] | None,
    ) -> tuple[list[int], bool]:
        """Handshake if needed, allocate (or take pages reserved ahead), write; returns the
        indices of the chunks written and whether reserved pages took them."""
        peer = self.connect(spec)
        key = _peer_key(spec)
        try:
            reserved = self._reserved_for(spec, key, peer, len(specs))
            if reserved is None:
                deadline = time.monotonic() + peer.write_budget_s
                response = self._allocate(spec, peer, specs)
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
                write = _Write(pages, [sizes[i] for i in to_write], addresses, done, alloc_id)
                try:
                    self._write(spec, key, peer, write, deadline)
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
        socket = dealer(self._context, spec.receiver_host, spec.receiver_alloc_port)
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
        for key in list(self._peers):
            self._forget_peer_key(key)
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
        return _peer_key(spec) in self._peers

    def connect(self, spec: DisaggSpec) -> Peer:
        """The peer of ``spec``, after a handshake on its init port the first time; call ahead
        of a first push to take the handshake off its latency.

        See ``handshake.py``: raises ``Incompatible``, ``TransportUnusable``,
        ``PeerUnreachable``, ``ProtocolError`` or ``TransferError``. ``spec`` names one consumer
        rank (``DisaggSpec.for_rank``): each producer rank pushes its own shard.
        """
        if not isinstance(spec.receiver_init_port, int):
            raise ProtocolError(
                f"req {spec.req_id}: a push goes to one consumer rank; pick it with for_rank"
            )
        key = _peer_key(spec)
        peer = self._peers.get(key)
        if peer is None:
            peer = self._peers[key] = self._handshake.run(spec)
        return peer

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

    def _allocate(
        self, spec: DisaggSpec, peer: Peer, specs: list[protocol.ChunkSpec]
    ) -> protocol.AllocResponse:
        """Pages for ``specs``, retrying a full buffer up to ``max_alloc_retries`` times."""
        request = protocol.AllocRequest(
            version=protocol.PROTOCOL_VERSION, req_id=spec.req_id, chunks=specs
        )
        deadline = time.monotonic() + self.config.alloc_timeout_s
        for attempt in range(self.config.max_alloc_retries + 1):
            reply = ask(peer.alloc_socket, request, protocol.ALLOC_REPLIES, deadline, spec.req_id)
            if isinstance(reply, protocol.AllocResponse):
                self._check_allocation(spec, peer, reply, len(specs))
                return reply
            error = error_from_reply(spec.req_id, reply)
            wait_s = reply.retry_after_s
            if isinstance(error, BufferFull) and self._give_back_reserved(spec, peer):
                wait_s = 0.0  # our own reserved pages made room: ask again at once
            if (
                not isinstance(error, BufferFull)
                or attempt == self.config.max_alloc_retries
                or time.monotonic() + wait_s >= deadline
            ):
                raise error
            logger.info("req %s: consumer buffer full, retry in %.3f s", spec.req_id, wait_s)
            time.sleep(wait_s)
        raise AssertionError("unreachable: the last attempt raises")

    def _set_aside(self, key: PeerKey) -> None:
        """Stop using ``key``'s current reservation (stale, or replaced by a newer one); its
        unwritten pages stay the consumer's until their lease or ``_give_back_reserved``."""
        now = time.monotonic()
        kept = [
            (reservation_id, asked_at)
            for reservation_id, asked_at in self._set_aside_ids.get(key, [])
            if now - asked_at < protocol.RESERVED_LEASE_S  # else taken back already
        ]
        reserved = self._reserved.pop(key, None)
        if reserved is not None:
            kept.append((reserved.reservation_id, reserved.asked_at))
        self._set_aside_ids[key] = kept

    def _give_back_reserved(self, spec: DisaggSpec, peer: Peer) -> bool:
        """Give back every reservation of ``spec``'s consumer we hold or set aside and it has
        not taken back yet (an AllocCancel each: we write nothing into them, having one
        thread), for a push that found its buffer full; True if there were any."""
        key = _peer_key(spec)
        self._set_aside(key)
        ids = [reservation_id for reservation_id, _ in self._set_aside_ids.pop(key, [])]
        if ids:
            logger.info("req %s: buffer full, giving back %d reservations", spec.req_id, len(ids))
        for reservation_id in ids:
            self._cancel(spec, peer, reservation_id)
        return bool(ids)

    def _check_allocation(
        self, spec: DisaggSpec, peer: Peer, reply: protocol.AllocResponse, count: int
    ) -> None:
        """Never write where the consumer's own buffer does not reach."""
        if reply.req_id != spec.req_id or len(reply.pages) != count:
            raise ProtocolError(f"req {spec.req_id}: AllocResponse does not match the request")
        if reply.agent_name != peer.name:
            # Those pages are the new consumer's: give them back, we will ask again.
            self._cancel(spec, peer, reply.alloc_id)
            raise PeerRestarted(
                f"req {spec.req_id}: the consumer at {spec.receiver_host}:"
                f"{spec.receiver_alloc_port} is now {reply.agent_name}, not {peer.name}"
            )
        self._check_pages(spec, peer, reply.pages)

    @staticmethod
    def _check_pages(spec: DisaggSpec, peer: Peer, pages: Sequence[int | None]) -> None:
        for page in pages:
            if page is not None and page >= peer.num_pages:
                raise ProtocolError(f"req {spec.req_id}: page {page} outside {peer.num_pages}")

    def _write(
        self, spec: DisaggSpec, key: PeerKey, peer: Peer, write: _Write, deadline: float
    ) -> None:
        """One WRITE of ``write``'s chunks with its notification, done by ``deadline`` (a
        ``time.monotonic()`` value); pages for the next small push are asked for meanwhile."""
        pages = np.array(write.pages, dtype=np.uint64)
        segments = np.empty((len(write.pages), 3), dtype=np.uint64)
        segments[:, 0] = write.addresses
        segments[:, 1] = peer.buffer.base_addr + pages * peer.page_bytes
        segments[:, 2] = write.sizes
        notif = protocol.encode(write.done)
        try:
            handle = peer.channel.post_write(peer.name, segments, peer.buffer, notif)
        except TransferError as exc:
            self._cancel(spec, peer, write.alloc_id)
            raise TransferError(f"req {spec.req_id}: {exc}") from exc
        self._ask_reserve(spec, key)
        try:
            wait_for_transfer(peer.channel, handle, deadline, f"req {spec.req_id} to {peer.name}")
        except TransferError as exc:
            # A failed write that NIXL let us release writes no more: its pages can go back
            # now. A timed-out one might still land, so its pages wait for their lease.
            if peer.channel.release(handle):
                self._cancel(spec, peer, write.alloc_id)
            raise TransferError(f"req {spec.req_id}: {exc}") from exc
        except BaseException:
            peer.channel.release(handle)
            raise
        peer.channel.release(handle)

    def _reserved_for(
        self, spec: DisaggSpec, key: PeerKey, peer: Peer, count: int
    ) -> _Reserved | None:
        """``count`` pages reserved ahead for this push, or None: it asks first. Either way no
        answer to our ReserveRequest is left on its way (it would be read as the answer to the
        AllocRequest); asked for during the last write, it is here already, or nearly."""
        self._collect_reserved(spec, key, peer, wait=False)
        reserved = self._take_reserved(key, peer, count)
        if reserved is None:
            self._collect_reserved(spec, key, peer, wait=True)
            reserved = self._take_reserved(key, peer, count)
        return reserved

    def _take_reserved(self, key: PeerKey, peer: Peer, count: int) -> _Reserved | None:
        """``count`` pages reserved ahead by ``key``'s consumer, if we have that many and asked
        for them within ``RESERVED_FRESH_S`` (and half the write budget). Under steady traffic
        each push asks for the next ones, so they are always that fresh."""
        reserved = self._reserved.get(key)
        if reserved is None or count > min(len(reserved.pages), self.config.reserved_pages):
            return None  # a larger push asks first, and is told which chunks not to write
        if time.monotonic() - reserved.asked_at > min(
            protocol.RESERVED_FRESH_S, peer.write_budget_s / 2
        ):
            self._set_aside(key)  # unwritten, the consumer takes them back at their lease
            return None
        taken = _Reserved(reserved.reservation_id, reserved.pages[:count], reserved.asked_at)
        reserved.pages = reserved.pages[count:]
        if not reserved.pages:
            del self._reserved[key]
        return taken

    def _ask_reserve(self, spec: DisaggSpec, key: PeerKey) -> None:
        """Ask ``key``'s consumer for pages ahead, unless we hold enough or asked already; the
        answer is read by ``_collect_reserved`` before the next push, not waited for now."""
        want = self.config.reserved_pages
        held = self._reserved.get(key)
        if want == 0 or key in self._reserving or (held is not None and len(held.pages) >= want):
            return
        pages = min(want * RESERVE_BATCH, protocol.MAX_RESERVED_PAGES)
        request = protocol.ReserveRequest(version=protocol.PROTOCOL_VERSION, pages=pages)
        send(self._peers[key].alloc_socket, request, spec.req_id)
        self._reserving[key] = time.monotonic()

    def _collect_reserved(self, spec: DisaggSpec, key: PeerKey, peer: Peer, *, wait: bool) -> None:
        """Read the answer to our ReserveRequest if one is due: if it is here already, or, with
        ``wait``, by ``alloc_timeout_s`` (``PeerTimeout`` after that; the peer is forgotten, so
        that a late answer is never read as another's). No pages (the consumer's buffer is
        full) only means that pushes ask first meanwhile."""
        asked_at = self._reserving.get(key)
        if asked_at is None:
            return
        if wait:
            deadline = time.monotonic() + self.config.alloc_timeout_s
            reply = receive(
                peer.alloc_socket, "ReserveRequest", protocol.ALLOC_REPLIES, deadline, spec.req_id
            )
        else:
            try:  # one call, no poll: this is on every small push's path
                reply = protocol.ALLOC_REPLIES.decode(peer.alloc_socket.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
        del self._reserving[key]
        if isinstance(reply, protocol.Reservation) and reply.agent_name == peer.name:
            self._check_pages(spec, peer, reply.pages)
            self._set_aside(key)
            self._reserved[key] = _Reserved(reply.reservation_id, list(reply.pages), asked_at)
        elif not isinstance(reply, protocol.ErrorReply | protocol.Reservation):
            raise ProtocolError(f"req {spec.req_id}: {type(reply).__name__} to a ReserveRequest")

    def _cancel(self, spec: DisaggSpec, peer: Peer, alloc_id: int | None) -> None:
        """Best effort: tell the consumer that ``alloc_id`` will not be written (None: reserved
        pages, which lapse with their lease)."""
        if alloc_id is None:
            return
        with contextlib.suppress(PDError):  # the socket must hold no answer due to another ask
            self._collect_reserved(spec, _peer_key(spec), peer, wait=True)
        cancel = protocol.AllocCancel(
            version=protocol.PROTOCOL_VERSION, req_id=spec.req_id, alloc_id=alloc_id
        )
        deadline = time.monotonic() + protocol.CANCEL_TIMEOUT_S
        try:
            ask(peer.alloc_socket, cancel, protocol.ALLOC_REPLIES, deadline, spec.req_id)
        except PDError as exc:
            logger.warning("req %s: could not cancel alloc %d: %s", spec.req_id, alloc_id, exc)

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
        self._forget_peer_key(_peer_key(spec))

    def _forget_peer_key(self, key: PeerKey) -> None:
        self._reserved.pop(key, None)
        self._reserving.pop(key, None)
        self._set_aside_ids.pop(key, None)
        peer = self._peers.pop(key, None)
        if peer is not None:
            peer.alloc_socket.close(linger=0)
            with contextlib.suppress(PDError):
                peer.channel.remove_peer(peer.name)


@dataclass(frozen=True, slots=True)
class _Write:
    """One WRITE: the consumer's pages, the chunks' sizes and staged addresses (one each), the
    notification that says they landed, and the allocation to cancel if it fails (None for
    reserved pages)."""

    pages: list[int]
    sizes: list[int]
    addresses: list[int]
    done: protocol.Message
    alloc_id: int | None


def _peer_key(spec: DisaggSpec) -> PeerKey:
    """The consumer rank ``spec`` names (single ports: ``DisaggSpec.for_rank``)."""
    assert isinstance(spec.receiver_init_port, int)
    assert isinstance(spec.receiver_alloc_port, int)
    return spec.receiver_host, spec.receiver_init_port, spec.receiver_alloc_port
