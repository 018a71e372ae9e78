"""A producer rank's sender threads: one per consumer rank (``peer_sender.py``), each the only
user of its own NIXL agent, so that a consumer that is slow, dead or stuck in NIXL's connect
delays no push to any other consumer. The jobs they take are ``sender_jobs.py``'s.

At most ``MAX_PEERS`` senders run at once. A request naming one more consumer lets go of the
sender idle longest (no job queued or running; never a warm peer's, a decode rank the launcher
named): its thread ends and closes its producer, with its sockets and NIXL agent. Only when every
sender is busy is the request refused. So bogus specs, or decode ranks that restarted on fresh
ports, cannot keep a new decode out until prefill restarts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from lmcache_pd.peers import PeerAddress
from lmcache_pd.trace import TraceFile
from lmcache_pd.transfer.handshake import Count
from lmcache_pd.transfer.peer_sender import PeerSender
from lmcache_pd.transfer.producer import Producer
from lmcache_pd.transfer.sender_jobs import Job, NoticeJob, Outstanding, PushJob

logger = logging.getLogger(__name__)

# How long closing a pool waits for all its sender threads to end (one may be stuck in NIXL).
SENDERS_JOIN_TIMEOUT_S = 10.0
# A producer talks to a handful of decode ranks; a flood of distinct addresses (bad specs) must
# not become a flood of threads and NIXL agents: past this many, the idlest sender goes.
MAX_PEERS = 64


class SenderPool:
    """The sender of every consumer rank this producer pushes to; used from vLLM's model-runner
    thread only (``submit``, ``close``)."""

    def __init__(
        self,
        make_producer: Callable[[], Producer],
        count: Count,
        trace: TraceFile,
        warm_peers: list[PeerAddress],
        cpus: str | None = None,
    ) -> None:
        """``cpus``: where the sender threads may run (``affinity.unpin_this_thread``)."""
        self._make_producer = make_producer
        self._cpus = cpus
        self._count = count
        self._trace = trace
        self._outstanding = Outstanding()
        self._senders: dict[PeerAddress, PeerSender] = {}
        # Senders let go whose threads may still be ending (joined on close).
        self._stopping: list[PeerSender] = []
        for address in warm_peers:
            self._senders[address] = self._start(address, warm=True)

    def submit(self, job: Job) -> bool:
        """Queue ``job`` on its consumer rank's sender; False if there is none and none can be
        started (the job is given up: its request abandoned, its pages given back)."""
        address = PeerAddress.of(job.request.spec)
        sender = self._senders.get(address)
        if sender is None:
            if len(self._senders) >= MAX_PEERS and not self._let_idlest_go():
                if isinstance(job, NoticeJob):  # its pushes were refused alike: said so
                    job.notify(False)
                    return False
                job.request.abandoned.set()
                self._count("push_failures", 1)
                logger.error(
                    "req %s: not pushed: already %d consumers, the most one producer serves, "
                    "and every one of them is busy",
                    job.request.spec.req_id,
                    MAX_PEERS,
                )
                if isinstance(job, PushJob):
                    job.pages.__exit__(None, None, None)
                return False
            sender = self._senders[address] = self._start(address, warm=False)
        sender.submit(job)
        return True

    @property
    def outstanding(self) -> int:
        """Jobs submitted and not finished (pushed, failed or dropped) yet."""
        return self._outstanding.count

    def close(self) -> None:
        """Stop every sender and wait for it (it closes its own NIXL agent)."""
        senders = [*self._senders.values(), *self._stopping]
        for sender in senders:
            sender.stop()
        deadline = time.monotonic() + SENDERS_JOIN_TIMEOUT_S
        for sender in senders:
            if not sender.join(max(0.0, deadline - time.monotonic())):
                logger.error(
                    "sender for %s:%d did not stop within %.0f s (stuck in NIXL?); its agent is "
                    "left to the process's exit",
                    *sender.address[:2],
                    SENDERS_JOIN_TIMEOUT_S,
                )
        self._senders.clear()
        self._stopping.clear()

    def _let_idlest_go(self) -> bool:
        """Stop the sender of a consumer not named in ``warm_peers`` that is idle and was used
        least recently; its thread ends on its own, closing its producer. False if none is."""
        idle = [s for s in self._senders.values() if s.idle and not s.warm]
        if not idle:
            return False
        victim = min(idle, key=lambda sender: sender.last_used)
        del self._senders[victim.address]
        victim.stop()
        self._stopping = [s for s in self._stopping if not s.join(0)] + [victim]
        self._count("peers_evicted", 1)
        logger.warning(
            "sender for %s:%d let go: %d consumers already, the most one producer keeps; it was "
            "idle for %.1f s",
            *victim.address[:2],
            MAX_PEERS,
            time.monotonic() - victim.last_used,
        )
        return True

    def _start(self, address: PeerAddress, *, warm: bool) -> PeerSender:
        logger.info("sender for %s:%d starting (connect ahead: %s)", *address[:2], warm)
        return PeerSender(
            address,
            self._make_producer,
            self._count,
            self._trace,
            self._outstanding,
            warm=warm,
            cpus=self._cpus,
        )
