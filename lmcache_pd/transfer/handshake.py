"""The producer's side of the handshake on a consumer's init port, once per consumer.

Step 1 swaps KV profiles (``compat.py``: a field both sides know and disagree on refuses the
handshake) and network-stack identities, which pick the UCX transports (``transport.py``); step
2 loads the consumer's NIXL agent and registered buffer into our agent of those transports; step
3, the self-test, writes a nonce the consumer chose into its slot with a ProbeDone notification
and asks until the consumer has seen both, within ``self_test_timeout_s``. A transport that fails
it is followed by TCP; if none passes, ``TransportUnusable`` names the consumer and each try.
The whole handshake, every step and every transport tried, ends by one deadline
(``handshake_timeout_s`` from its start, not counting the making of our own NIXL agent), so that
a peer that answers slowly, or a spec naming a host that does not answer at all, holds the
sender that connects to it no longer. One step cannot be interrupted: NIXL's loading of the
consumer's metadata (``_add_peer``), a native call with no deadline of its own; a handshake it
made overrun fails when it returns.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import zmq

from lmcache_pd import protocol, transport
from lmcache_pd.auth import DeploymentKeys, Door, seal
from lmcache_pd.compat import KVProfile, incompatibilities
from lmcache_pd.config import PDConfig
from lmcache_pd.errors import (
    Incompatible,
    PDError,
    PeerTimeout,
    PeerUnreachable,
    ProtocolError,
    TransferError,
    TransportUnusable,
)
from lmcache_pd.protocol import DisaggSpec, ErrorCode
from lmcache_pd.transfer.channel import Channel, RegisteredBuffer, wait_for_transfer
from lmcache_pd.transfer.sockets import ask, dealer, error_from_reply
from lmcache_pd.transfer.staging import Staging

logger = logging.getLogger(__name__)

# (counter name, increment), as the connector's StatsRecorder.add takes them.
Count = Callable[[str, int], None]
# A self-test's ProbeCheck is repeated with this back-off until its deadline.
PROBE_POLL_S = (0.0005, 0.02)


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
    # Seal our notifications to it (None: the deployment has no secret).
    keys: DeploymentKeys | None

    def check_pages(self, req_id: str, pages: Sequence[int | None]) -> None:
        """Never write where the consumer's own buffer does not reach."""
        for page in pages:
            if page is not None and page >= self.num_pages:
                raise ProtocolError(f"req {req_id}: page {page} outside {self.num_pages}")


class Handshake:
    """Shakes hands with consumers for one producer; used by its owner thread only."""

    def __init__(
        self,
        config: PDConfig,
        *,
        profile: KVProfile,
        staging: Staging,
        context: zmq.Context,
        channel_for: Callable[[str | None], Channel],
        count: Count,
        keys: DeploymentKeys | None,
    ) -> None:
        """``channel_for`` gives the agent of a UCX_TLS setting (made on first use); ``keys``
        authenticate the consumer's sockets and seal our notifications (``auth.py``)."""
        self.config = config
        self.profile = profile
        self._stack = transport.stack_identity()
        self._staging = staging
        self._context = context
        self._channel_for = channel_for
        self._count = count
        self._keys = keys

    def run(self, spec: DisaggSpec) -> Peer:
        """A handshake with ``spec``'s consumer, all three steps; raises ``Incompatible``,
        ``TransportUnusable``, ``PeerUnreachable``, ``ProtocolError`` or ``TransferError``."""
        where = f"consumer {spec.receiver_host}:{spec.receiver_init_port}"
        deadline = time.monotonic() + self.config.handshake_timeout_s
        socket = dealer(
            self._context, spec.receiver_host, spec.receiver_init_port, self._keys, Door.INIT
        )
        try:
            metadata = self._consumer_metadata(spec, socket, deadline)
            choice = transport.choose(
                self._stack,
                metadata.stack,
                local_tls=self.config.ucx_tls,
                remote_tls=self.config.ucx_tls_remote,
                fallback=self.config.transport_fallback,
                device_memory=self.config.buffer_device == "cuda",
            )
            tried: list[str] = []
            for ucx_tls in choice.attempts:
                # Our own agent of that transport, made on first use, is local work, not the
                # peer's: its time does not count.
                made = time.monotonic()
                channel = self._channel_for(ucx_tls)
                deadline += time.monotonic() - made
                peer = self._attempt(spec, socket, metadata, channel, ucx_tls, tried, deadline)
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

    def _consumer_metadata(
        self, spec: DisaggSpec, socket: zmq.Socket, deadline: float
    ) -> protocol.AgentMetadata:
        """Step 1, by ``deadline``: profiles and identities swapped, and checked on both
        sides."""
        request = protocol.MetadataRequest(
            version=protocol.PROTOCOL_VERSION, profile=self.profile, stack=self._stack
        )
        reply = _reachable(
            spec,
            lambda m: ask(socket, m, protocol.INIT_REPLIES, deadline, spec.req_id),
            request,
        )
        where = f"consumer {spec.receiver_host}:{spec.receiver_init_port}"
        if isinstance(reply, protocol.ErrorReply):
            if reply.code is ErrorCode.INCOMPATIBLE:
                self._count("handshakes_refused", 1)
                raise Incompatible(f"req {spec.req_id}: {where} refused: {reply.detail}")
            raise error_from_reply(spec.req_id, reply)
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
        channel: Channel,
        ucx_tls: str | None,
        tried: list[str],
        deadline: float,
    ) -> Peer | None:
        """Steps 2 and 3 over ``channel`` (our agent of ``ucx_tls``), by the handshake's
        ``deadline``: the peer, or None (and why, in ``tried``) if the self-test failed."""
        if time.monotonic() >= deadline:
            raise PeerTimeout(
                f"req {spec.req_id}: handshake with consumer {spec.receiver_host}:"
                f"{spec.receiver_init_port} not done within {self.config.handshake_timeout_s} s;"
                f" tried {'; '.join(tried)}"
            )
        name = self._add_peer(spec, channel, metadata.metadata, deadline)
        try:
            buffer = _reachable(
                spec,
                lambda m: ask(socket, m, protocol.INIT_REPLIES, deadline, spec.req_id),
                protocol.BufferRequest(version=protocol.PROTOCOL_VERSION),
            )
            if not isinstance(buffer, protocol.BufferDescriptors) or buffer.agent_name != name:
                raise ProtocolError(
                    f"req {spec.req_id}: bad BufferDescriptors from {name}: {buffer}"
                )
            failure = self._self_test(spec, socket, channel, name, buffer, deadline)
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
            alloc_socket=dealer(
                self._context, spec.receiver_host, spec.receiver_alloc_port, self._keys, Door.ALLOC
            ),
            keys=self._keys,
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
        handshake_deadline: float,
    ) -> str | None:
        """Step 3: write the consumer's nonce into its slot with a ProbeDone notification and
        ask until the consumer has seen both, within ``self_test_timeout_s`` and by the
        handshake's deadline. None if it did, else what went wrong."""
        if not self.config.transport_self_test:
            return None
        timeout_s = self.config.self_test_timeout_s
        deadline = min(time.monotonic() + timeout_s, handshake_deadline)
        nonce = buffer.probe_nonce
        size = protocol.PROBE_NONCE_BYTES
        remote = RegisteredBuffer(buffer.mem_type, buffer.device_id, buffer.probe_addr, size)
        probe = protocol.ProbeDone(version=protocol.PROTOCOL_VERSION, nonce=nonce)
        notif = seal(self._keys, protocol.encode(probe))
        with self._staging.probe_slot() as source:
            source.copy_(torch.frombuffer(bytearray(nonce), dtype=torch.uint8))
            handle = channel.post_write(
                name, [(source.data_ptr(), buffer.probe_addr, size)], remote, notif
            )
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
                reply = ask(socket, check, protocol.INIT_REPLIES, deadline, spec.req_id)
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

    def _add_peer(
        self, spec: DisaggSpec, channel: Channel, metadata: bytes, deadline: float
    ) -> str:
        """Load the consumer's NIXL metadata. NIXL 1.5.1 makes the UCX endpoint here without
        waiting for the consumer (1-30 ms measured), but the call has no deadline of its own and
        cannot be interrupted: if it overran ours, the peer is dropped again and the handshake
        fails (``PeerTimeout``)."""
        started = time.monotonic()
        name = channel.add_peer(metadata)
        finished = time.monotonic()
        if finished > deadline:
            with contextlib.suppress(PDError):
                channel.remove_peer(name)
            raise PeerTimeout(
                f"req {spec.req_id}: NIXL took {finished - started:.1f} s to connect to {name} "
                f"at {spec.receiver_host}:{spec.receiver_init_port}, past the "
                f"{self.config.handshake_timeout_s} s handshake deadline"
            )
        return name


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
