"""The producer rank: pushes a request's chunks into the consumer named by its DisaggSpec.

Per push: handshake with the consumer once (cached per peer), ask it for a page per chunk, write
the chunks it does not already hold from our registered staging buffer in one NIXL WRITE whose
notification carries the allocation id and checksums, and wait for the WRITE to finish. Every step
has its own deadline and raises a typed error; the write's deadline ends before the consumer's
lease on its pages (stated in the handshake) does. One owner thread calls ``connect``, ``push``
and ``abandon`` (NIXL is not thread-safe); ``staged`` may be called from any thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import zmq

from lmcache_pd import protocol, transport
from lmcache_pd.channel import Channel, NixlChannel, RegisteredBuffer, wait_for_transfer
from lmcache_pd.compat import KVProfile, incompatibilities
from lmcache_pd.config import PDConfig
from lmcache_pd.errors import (
    AllocationError,
    BufferFull,
    ConfigError,
    Incompatible,
    PDError,
    PeerError,
    PeerRestarted,
    PeerTimeout,
    PeerUnreachable,
    ProtocolError,
    RequestDropped,
    TransferError,
    TransportUnusable,
    VersionMismatch,
)
from lmcache_pd.integrity import checksum
from lmcache_pd.protocol import AbandonReason, DisaggSpec, ErrorCode
from lmcache_pd.staging import Staging

logger = logging.getLogger(__name__)

Chunk = tuple[bytes, torch.Tensor]
# (counter name, increment), as the connector's StatsRecorder.add takes them.
Count = Callable[[str, int], None]
# A self-test's ProbeCheck is repeated with this back-off until its deadline.
PROBE_POLL_S = (0.0005, 0.02)


@dataclass(frozen=True, slots=True)
class PushResult:
    """What one push moved."""

    req_id: str
    chunks_sent: int
    chunks_skipped: int
    bytes_sent: int
    seconds: float


@dataclass(slots=True)
class Peer:
    """A consumer rank we have shaken hands with."""

    name: str
    # The agent that shook hands with it (one per transport setting), and that setting.
    channel: Channel
    ucx_tls: str | None
    buffer: RegisteredBuffer
    page_bytes: int
    num_pages: int
    alloc_socket: zmq.Socket
    # How long after its AllocRequest a write may still go into the pages (the consumer's lease
    # less a margin, capped by our own transfer_timeout_s).
    write_budget_s: float


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
        self._count = count or (lambda name, n: None)
        self._stack = transport.stack_identity()
        self._staging = staging or Staging(num_pages=config.num_pages, page_bytes=config.page_bytes)
        self._given_channel = channel
        self._channels: dict[str | None, Channel] = {}
        if channel is not None:
            self._register(channel)
            self._channels[config.ucx_tls] = channel
        self._context = zmq.Context()
        self._peers: dict[tuple[str, int, int], Peer] = {}
        self._closed = False

    def staged(self, count: int) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """``count`` page-sized views of the registered staging buffer, for callers that build
        chunks in place (no copy at push time); returned to the pool on exit."""
        return self._staging.pages(count)

    def push(self, spec: DisaggSpec, chunks: Sequence[Chunk]) -> PushResult:
        """Write ``chunks`` (key, contiguous CPU tensor) to ``spec``'s consumer.

        Tensors inside the staging buffer (see ``staged``) go as they are; others are copied into
        staging first (room for them is taken before the consumer is asked for any). Raises
        ``PeerTimeout``, ``TransferError``, ``AllocationError`` (``BufferFull`` after
        ``max_alloc_retries``), ``PeerError`` or ``ProtocolError``.
        """
        if not chunks:
            raise ValueError(f"req {spec.req_id}: nothing to push")
        started = time.monotonic()
        sources = [self._as_bytes(spec.req_id, tensor) for _, tensor in chunks]
        sizes = [data.numel() for data in sources]
        specs = [
            protocol.ChunkSpec(key, size) for (key, _), size in zip(chunks, sizes, strict=True)
        ]
        outside = [i for i, data in enumerate(sources) if not self._staging.holds(data, sizes[i])]
        with self.staged(len(outside)) as spare:
            copies = dict(zip(outside, spare, strict=True))
            try:
                to_write = self._push_once(spec, specs, sources, sizes, copies)
            except PeerRestarted as exc:
                # Our handshake is with its former self: shake hands again and retry once.
                logger.warning("req %s: %s; shaking hands again", spec.req_id, exc)
                to_write = self._push_once(spec, specs, sources, sizes, copies)
        result = PushResult(
            req_id=spec.req_id,
            chunks_sent=len(to_write),
            chunks_skipped=len(chunks) - len(to_write),
            bytes_sent=sum(sizes[i] for i in to_write),
            seconds=time.monotonic() - started,
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
    ) -> list[int]:
        """Handshake if needed, allocate, write; returns the indices of the chunks written."""
        peer = self.connect(spec)
        try:
            asked_at = time.monotonic()
            response = self._allocate(spec, peer, specs)
            to_write = [i for i, page in enumerate(response.pages) if page is not None]
            if to_write:
                addresses = [self._staged_address(sources[i], copies.get(i)) for i in to_write]
                deadline = asked_at + peer.write_budget_s
                self._write(spec, peer, response, to_write, sources, sizes, addresses, deadline)
        except AllocationError as exc:
            logger.warning("req %s: not pushed to %s: %s", spec.req_id, peer.name, exc)
            raise
        except PDError as exc:
            # The peer may be gone or restarted: handshake afresh next time.
            logger.warning("req %s: push to %s failed: %s", spec.req_id, peer.name, exc)
            self._forget_peer(spec)
            raise
        return to_write

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
        socket = self._dealer(spec.receiver_host, spec.receiver_alloc_port)
        try:
            reply = self._ask(socket, message, protocol.ALLOC_REPLIES, deadline, spec.req_id)
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
        return (
            spec.receiver_host,
            spec.receiver_init_port,
            spec.receiver_alloc_port,
        ) in self._peers

    def connect(self, spec: DisaggSpec) -> Peer:
        """The peer of ``spec``, after a handshake on its init port the first time; call ahead
        of a first push to take the handshake off its latency.

        Step 1 swaps KV profiles (a mismatch raises ``Incompatible``) and network-stack
        identities, which pick the transports (``transport.choose``); step 2 loads the
        consumer's agent and buffer into the agent of those transports; step 3, the self-test,
        writes a nonce with a notification that must arrive in time. A transport that fails it
        is followed by TCP; if none passes, ``TransportUnusable`` names the peer and each try.
        """
        key = (spec.receiver_host, spec.receiver_init_port, spec.receiver_alloc_port)
        peer = self._peers.get(key)
        if peer is not None:
            return peer
        where = f"consumer {spec.receiver_host}:{spec.receiver_init_port}"
        socket = self._dealer(spec.receiver_host, spec.receiver_init_port)
        try:
            metadata = self._consumer_metadata(spec, socket)
            choice = transport.choose(
                self._stack,
                metadata.stack,
                local_tls=self.config.ucx_tls,
                remote_tls=self.config.ucx_tls_remote,
                fallback=self.config.transport_fallback,
            )
            tried: list[str] = []
            for ucx_tls in choice.attempts:
                peer = self._attempt(spec, socket, metadata, ucx_tls, tried)
                if peer is not None:
                    break
            else:
                raise TransportUnusable(
                    f"req {spec.req_id}: {where} ({metadata.agent_name}, "
                    f"{'same' if choice.same_stack else 'another'} network stack): no transport "
                    f"passed the self-test; tried {'; '.join(tried)}"
                )
        finally:
            socket.close(linger=0)
        self._peers[key] = peer
        counter = (
            "peers_fallback_transport"
            if tried
            else ("peers_local_transport" if choice.same_stack else "peers_remote_transport")
        )
        self._count(counter, 1)
        logger.info(
            "req %s: handshake with %s at %s:%d done over %s (%s network stack%s; %d pages of "
            "%d bytes, writes end within %.1f s of their allocation)",
            spec.req_id,
            peer.name,
            spec.receiver_host,
            spec.receiver_init_port,
            transport.describe(peer.ucx_tls),
            "same" if choice.same_stack else "another",
            f", after {'; '.join(tried)}" if tried else "",
            peer.num_pages,
            peer.page_bytes,
            peer.write_budget_s,
        )
        return peer

    def _consumer_metadata(self, spec: DisaggSpec, socket: zmq.Socket) -> protocol.AgentMetadata:
        """Step 1: profiles and identities swapped, and checked on both sides."""
        deadline = time.monotonic() + self.config.handshake_timeout_s
        request = protocol.MetadataRequest(
            version=protocol.PROTOCOL_VERSION, profile=self.profile, stack=self._stack
        )
        reply = self._reachable(
            spec,
            lambda m: self._ask(socket, m, protocol.INIT_REPLIES, deadline, spec.req_id),
            request,
        )
        where = f"consumer {spec.receiver_host}:{spec.receiver_init_port}"
        if isinstance(reply, protocol.ErrorReply):
            if reply.code is ErrorCode.INCOMPATIBLE:
                self._count("handshakes_refused", 1)
                raise Incompatible(f"req {spec.req_id}: {where} refused: {reply.detail}")
            raise _error_from_reply(spec.req_id, reply)
        if not isinstance(reply, protocol.AgentMetadata):
            raise ProtocolError(f"req {spec.req_id}: expected AgentMetadata, got {reply}")
        problems = incompatibilities(self.profile, reply.profile)
        if problems:
            self._count("handshakes_refused", 1)
            raise Incompatible(
                f"req {spec.req_id}: {where} has incompatible KV: {'; '.join(problems)}"
            )
        return reply

    def _attempt(
        self,
        spec: DisaggSpec,
        socket: zmq.Socket,
        metadata: protocol.AgentMetadata,
        ucx_tls: str | None,
        tried: list[str],
    ) -> Peer | None:
        """Steps 2 and 3 over ``ucx_tls``: the peer, or None (and why, in ``tried``) if the
        self-test failed."""
        deadline = time.monotonic() + self.config.handshake_timeout_s
        channel = self._channel_for(ucx_tls)
        name = self._add_peer(spec, channel, metadata.metadata, deadline)
        try:
            buffer = self._reachable(
                spec,
                lambda m: self._ask(socket, m, protocol.INIT_REPLIES, deadline, spec.req_id),
                protocol.BufferRequest(version=protocol.PROTOCOL_VERSION),
            )
            if not isinstance(buffer, protocol.BufferDescriptors) or buffer.agent_name != name:
                raise ProtocolError(
                    f"req {spec.req_id}: bad BufferDescriptors from {name}: {buffer}"
                )
            failure = self._self_test(spec, socket, channel, name, buffer)
        except BaseException:
            # Half a handshake: the next attempt starts from a clean NIXL peer table.
            with contextlib.suppress(PDError):
                channel.remove_peer(name)
            raise
        if failure is not None:
            self._count("transport_self_test_failures", 1)
            tried.append(f"{transport.describe(ucx_tls)}: {failure}")
            logger.warning(
                "req %s: transport self-test with %s over %s failed: %s",
                spec.req_id,
                name,
                transport.describe(ucx_tls),
                failure,
            )
            with contextlib.suppress(PDError):
                channel.remove_peer(name)
            return None
        return Peer(
            name=name,
            channel=channel,
            ucx_tls=ucx_tls,
            buffer=RegisteredBuffer(
                buffer.mem_type,
                buffer.device_id,
                buffer.base_addr,
                buffer.page_bytes * buffer.num_pages,
            ),
            page_bytes=buffer.page_bytes,
            num_pages=buffer.num_pages,
            alloc_socket=self._dealer(spec.receiver_host, spec.receiver_alloc_port),
            write_budget_s=min(
                self.config.transfer_timeout_s, protocol.write_budget_s(buffer.alloc_lease_s)
            ),
        )

    def _self_test(
        self,
        spec: DisaggSpec,
        socket: zmq.Socket,
        channel: Channel,
        name: str,
        buffer: protocol.BufferDescriptors,
    ) -> str | None:
        """Step 3: write the consumer's nonce into its slot with a ProbeDone notification and
        ask until the consumer has seen both. None if it did, else what went wrong."""
        if not self.config.transport_self_test:
            return None
        timeout_s = self.config.self_test_timeout_s
        deadline = time.monotonic() + timeout_s
        nonce = buffer.probe_nonce
        size = protocol.PROBE_NONCE_BYTES
        remote = RegisteredBuffer(buffer.mem_type, buffer.device_id, buffer.probe_addr, size)
        notif = protocol.encode(protocol.ProbeDone(version=protocol.PROTOCOL_VERSION, nonce=nonce))
        with self._staging.probe_slot() as source:
            source.copy_(torch.frombuffer(bytearray(nonce), dtype=torch.uint8))
            segments = np.array([[source.data_ptr(), buffer.probe_addr, size]], dtype=np.uint64)
            handle = channel.post_write(name, segments, remote, notif)
            try:
                wait_for_transfer(channel, handle, deadline, f"self-test write to {name}")
            except (TransferError, PeerTimeout) as exc:
                return f"write not done: {exc}"
            finally:
                channel.release(handle)
        check = protocol.ProbeCheck(version=protocol.PROTOCOL_VERSION, nonce=nonce)
        pause_s = PROBE_POLL_S[0]
        while True:
            try:
                reply = self._ask(socket, check, protocol.INIT_REPLIES, deadline, spec.req_id)
            except PeerTimeout:
                return f"no answer to the self-test check within {timeout_s:.1f} s"
            if not isinstance(reply, protocol.ProbeResult) or reply.nonce != nonce:
                raise ProtocolError(f"req {spec.req_id}: bad ProbeResult from {name}: {reply}")
            if reply.state is protocol.ProbeState.LANDED:
                return None
            if reply.state is not protocol.ProbeState.PENDING:
                return f"consumer reports the self-test {reply.state.value}"
            if time.monotonic() + pause_s >= deadline:
                return f"written, but its notification did not arrive within {timeout_s:.1f} s"
            time.sleep(pause_s)
            pause_s = min(PROBE_POLL_S[1], pause_s * 2)

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

    @staticmethod
    def _reachable(
        spec: DisaggSpec, ask: Callable[[protocol.Message], object], message: protocol.Message
    ) -> object:
        """One handshake step; no answer means the consumer is unreachable."""
        try:
            return ask(message)
        except PeerTimeout as exc:
            raise PeerUnreachable(
                f"consumer {spec.receiver_host}:{spec.receiver_init_port} unreachable: {exc}"
            ) from exc

    def _add_peer(
        self, spec: DisaggSpec, channel: Channel, metadata: bytes, deadline: float
    ) -> str:
        """Load the consumer's NIXL metadata. NIXL 1.5.1 makes the UCX endpoint here without
        waiting for the consumer (1-30 ms measured), but the call has no deadline of its own and
        cannot be interrupted: say when it overran ours."""
        started = time.monotonic()
        name = channel.add_peer(metadata)
        finished = time.monotonic()
        if finished > deadline:
            logger.warning(
                "req %s: NIXL took %.1f s to connect to %s at %s:%d, past the %.1f s handshake "
                "deadline",
                spec.req_id,
                finished - started,
                name,
                spec.receiver_host,
                spec.receiver_init_port,
                self.config.handshake_timeout_s,
            )
        return name

    def _allocate(
        self, spec: DisaggSpec, peer: Peer, specs: list[protocol.ChunkSpec]
    ) -> protocol.AllocResponse:
        """Pages for ``specs``, retrying a full buffer up to ``max_alloc_retries`` times."""
        request = protocol.AllocRequest(
            version=protocol.PROTOCOL_VERSION, req_id=spec.req_id, chunks=specs
        )
        deadline = time.monotonic() + self.config.alloc_timeout_s
        for attempt in range(self.config.max_alloc_retries + 1):
            reply = self._ask(
                peer.alloc_socket, request, protocol.ALLOC_REPLIES, deadline, spec.req_id
            )
            if isinstance(reply, protocol.AllocResponse):
                self._check_allocation(spec, peer, reply, len(specs))
                return reply
            error = _error_from_reply(spec.req_id, reply)
            wait_s = reply.retry_after_s
            if (
                not isinstance(error, BufferFull)
                or attempt == self.config.max_alloc_retries
                or time.monotonic() + wait_s >= deadline
            ):
                raise error
            logger.info("req %s: consumer buffer full, retry in %.3f s", spec.req_id, wait_s)
            time.sleep(wait_s)
        raise AssertionError("unreachable: the last attempt raises")

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
        for page in reply.pages:
            if page is not None and page >= peer.num_pages:
                raise ProtocolError(f"req {spec.req_id}: page {page} outside {peer.num_pages}")

    def _write(
        self,
        spec: DisaggSpec,
        peer: Peer,
        response: protocol.AllocResponse,
        to_write: list[int],
        sources: list[torch.Tensor],
        sizes: list[int],
        addresses: list[int],
        deadline: float,
    ) -> None:
        """One WRITE of the chunks ``to_write`` and its WriteDone notification, done by
        ``deadline`` (a ``time.monotonic()`` value)."""
        checksums = (
            [checksum(sources[i]) for i in to_write] if self.config.integrity_checksums else None
        )
        notif = protocol.encode(
            protocol.WriteDone(
                version=protocol.PROTOCOL_VERSION,
                req_id=spec.req_id,
                alloc_id=response.alloc_id,
                checksums=checksums,
            )
        )
        pages = np.array([response.pages[i] for i in to_write], dtype=np.uint64)
        segments = np.empty((len(to_write), 3), dtype=np.uint64)
        segments[:, 0] = addresses
        segments[:, 1] = peer.buffer.base_addr + pages * peer.page_bytes
        segments[:, 2] = [sizes[i] for i in to_write]
        try:
            handle = peer.channel.post_write(peer.name, segments, peer.buffer, notif)
        except TransferError as exc:
            self._cancel(spec, peer, response.alloc_id)
            raise TransferError(f"req {spec.req_id}: {exc}") from exc
        try:
            wait_for_transfer(peer.channel, handle, deadline, f"req {spec.req_id} to {peer.name}")
        except TransferError as exc:
            # A failed write that NIXL let us release writes no more: its pages can go back
            # now. A timed-out one might still land, so its pages wait for their lease.
            if peer.channel.release(handle):
                self._cancel(spec, peer, response.alloc_id)
            raise TransferError(f"req {spec.req_id}: {exc}") from exc
        except BaseException:
            peer.channel.release(handle)
            raise
        peer.channel.release(handle)

    def _cancel(self, spec: DisaggSpec, peer: Peer, alloc_id: int) -> None:
        """Best effort: tell the consumer that ``alloc_id`` will not be written."""
        cancel = protocol.AllocCancel(
            version=protocol.PROTOCOL_VERSION, req_id=spec.req_id, alloc_id=alloc_id
        )
        deadline = time.monotonic() + protocol.CANCEL_TIMEOUT_S
        try:
            self._ask(peer.alloc_socket, cancel, protocol.ALLOC_REPLIES, deadline, spec.req_id)
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
        if not tensor.is_cpu or not tensor.is_contiguous():
            raise ValueError(f"req {req_id}: chunks must be contiguous CPU tensors")
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

    def _dealer(self, host: str, port: int) -> zmq.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
        socket.connect(f"tcp://{host}:{port}")
        return socket

    @staticmethod
    def _ask(
        socket: zmq.Socket,
        message: protocol.Message,
        codec: protocol.Codec,
        deadline: float,
        req_id: str,
    ) -> object:
        """Send one request and wait for its reply until ``deadline``."""
        try:
            socket.send(protocol.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise PeerTimeout(f"req {req_id}: cannot send {type(message).__name__}: {exc}") from exc
        remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
        if not socket.poll(remaining_ms, zmq.POLLIN):
            raise PeerTimeout(f"req {req_id}: no reply to {type(message).__name__} in time")
        return codec.decode(socket.recv())

    def _forget_peer(self, spec: DisaggSpec) -> None:
        self._forget_peer_key(
            (spec.receiver_host, spec.receiver_init_port, spec.receiver_alloc_port)
        )

    def _forget_peer_key(self, key: tuple[str, int, int]) -> None:
        peer = self._peers.pop(key, None)
        if peer is not None:
            peer.alloc_socket.close(linger=0)
            with contextlib.suppress(PDError):
                peer.channel.remove_peer(peer.name)


def _error_from_reply(req_id: str, reply: protocol.ErrorReply) -> PDError:
    """The exception a consumer's ErrorReply stands for."""
    detail = f"req {req_id}: consumer refused: {reply.detail}"
    if reply.code is ErrorCode.BUFFER_FULL:
        return BufferFull(detail, reply.retry_after_s)
    if reply.code is ErrorCode.TOO_LARGE:
        return AllocationError(detail)
    if reply.code is ErrorCode.VERSION:
        return VersionMismatch(detail)
    if reply.code is ErrorCode.DROPPED:
        return RequestDropped(detail, "dropped")
    return PeerError(reply.code.value, detail)
