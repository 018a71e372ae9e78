"""The consumer's side of the handshake: its answers on the init port, and the self-tests.

Step 1 (MetadataRequest): the producer's KV profile is compared with ours (``compat.py``: a field
both know and disagree on refuses the handshake) and the answer is our NIXL agent's metadata.
Step 2 (BufferRequest): the registered buffer, with a fresh self-test slot past the pages and a
nonce. Step 3, the self-test: the producer writes the nonce into the slot with a ProbeDone
notification (read with the others, ``on_probe_done``) and asks (ProbeCheck) until we have seen
both. The producer's side is ``handshake.py``.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field

import torch

from lmcache_pd import protocol
from lmcache_pd.compat import KVProfile, incompatibilities
from lmcache_pd.config import PDConfig
from lmcache_pd.protocol import ErrorCode, ProbeState
from lmcache_pd.transfer.channel import Channel, RegisteredBuffer
from lmcache_pd.transfer.consumer_stats import ConsumerStats
from lmcache_pd.transfer.sockets import refusal
from lmcache_pd.transport import stack_identity

logger = logging.getLogger(__name__)

InitRequest = protocol.MetadataRequest | protocol.BufferRequest | protocol.ProbeCheck


@dataclass(slots=True)
class _Probe:
    """A transport self-test handed out: its slot, when, and what was seen of it."""

    slot: int
    issued_at: float
    state: ProbeState = ProbeState.PENDING


@dataclass(slots=True)
class _Probes:
    """Self-tests handed out, by nonce."""

    by_nonce: dict[bytes, _Probe] = field(default_factory=dict)
    next_slot: int = 0


class InitPort:
    """Answers handshakes for one consumer rank; the consumer's service thread's own."""

    def __init__(
        self,
        config: PDConfig,
        *,
        profile: KVProfile,
        channel: Channel,
        registered: RegisteredBuffer,
        buffer: torch.Tensor,
        stats: ConsumerStats,
        lock: threading.Lock,
    ) -> None:
        """``buffer``: the registered receive buffer (``registered`` says where it is), whose
        self-test slots follow its pages. ``stats`` are counted under ``lock``, as the
        consumer's other threads read them."""
        self._config = config
        self._profile = profile
        self._channel = channel
        self._registered = registered
        self._buffer = buffer
        self._stats = stats
        self._lock = lock
        self._pages_bytes = config.num_pages * config.page_bytes
        self._probes = _Probes()
        self._agent_metadata = protocol.AgentMetadata(
            version=protocol.PROTOCOL_VERSION,
            agent_name=channel.agent_name,
            metadata=channel.local_metadata(),
            profile=profile,
            stack=stack_identity(),
        )

    def answer(self, message: InitRequest) -> protocol.Message:
        """The reply to one decoded init-port request."""
        if isinstance(message, protocol.ProbeCheck):
            return self._on_probe_check(message)
        self._stats.init_requests += 1
        if isinstance(message, protocol.BufferRequest):
            return self._buffer_descriptors()
        problems = incompatibilities(message.profile, self._profile)
        if problems:
            with self._lock:
                self._stats.handshakes_refused += 1
            detail = "; ".join(problems)
            logger.warning("refused a producer's handshake (stack %s): %s", message.stack, detail)
            return refusal(ErrorCode.INCOMPATIBLE, f"incompatible KV: {detail}")
        return self._agent_metadata

    def on_probe_done(self, peer: str, done: protocol.ProbeDone) -> None:
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
                self._stats.self_tests_landed += 1
        else:
            logger.warning("self-test from %s: notification arrived, data did not", peer)

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
            page_bytes=self._config.page_bytes,
            num_pages=self._config.num_pages,
            alloc_lease_s=self._config.alloc_lease_s,
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
