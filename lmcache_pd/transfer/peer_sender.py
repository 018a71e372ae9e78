"""The sender thread of one consumer rank: pushes its jobs in order, the only user of its own NIXL
agent, and tells the consumer of every push that failed.

A NIXL call has no deadline of its own and cannot be interrupted, and NIXL calls on one agent
must not run on two threads (the default sync mode has no lock: two threads on one agent
crashed in a test). An agent per peer, owned by that peer's thread, is what keeps one stuck
peer (a handshake that waits its deadline, a NIXL call that stalls) to itself. Known peers (the
launcher names every decode rank) are connected ahead of their first request.

Every failure of a push is told to its consumer (``KVAbandoned``), so that its decode recomputes
at once instead of waiting its load deadline; later pushes of that request are dropped.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from lmcache_pd.affinity import unpin_this_thread
from lmcache_pd.errors import (
    AllocationError,
    Incompatible,
    PDError,
    PeerUnreachable,
    RequestDropped,
    TransportUnusable,
    WriteTimeout,
)
from lmcache_pd.peers import PeerAddress
from lmcache_pd.protocol import DEVICE_COPY_TIMEOUT_S, AbandonReason, DisaggSpec
from lmcache_pd.trace import TraceFile
from lmcache_pd.transfer.handshake import Count
from lmcache_pd.transfer.producer import Producer
from lmcache_pd.transfer.sender_jobs import (
    AbandonJob,
    Job,
    NoticeJob,
    Outstanding,
    PushJob,
    Saving,
)

logger = logging.getLogger(__name__)

# How often an idle sender looks at its stop flag, and retries connecting to a known peer.
SENDER_POLL_S = 0.1
WARM_RETRY_S = (0.25, 2.0)  # first and longest pause between two connect attempts
# After a consumer failed its handshake, its pushes fail at once for this long (the consumer is
# told, within its short deadline) instead of each waiting a handshake deadline of its own: a
# backlog of them must not delay the first push to a restarted consumer by tens of seconds.
DOWN_BACKOFF_S = 2.0
# A consumer whose handshake was refused (incompatible KV) or whose transports all failed the
# self-test answers, but would fail every handshake the same way: its pushes fail at once for
# this long (the consumer is told at once), instead of each redoing a handshake that costs up to
# a self-test deadline per transport.
REFUSED_BACKOFF_S = 10.0
# A notice the consumer did not acknowledge (stopped, restarting, cut off) is sent again after
# these pauses, so that a decode back within its load deadline still hears it; at most
# MAX_UNTOLD notices wait at once (the oldest is given up).
RETELL_AFTER_S = (1.0, 2.0, 4.0, 8.0, 16.0)
MAX_UNTOLD = 64


@dataclass(slots=True)
class _Untold:
    """A KVAbandoned notice not acknowledged yet, and when to send it again."""

    due: float
    attempt: int
    job: AbandonJob


def _reason(exc: Exception) -> AbandonReason:
    if isinstance(exc, Incompatible):
        return AbandonReason.INCOMPATIBLE
    if isinstance(exc, AllocationError):
        return AbandonReason.CONSUMER_REFUSED
    if isinstance(exc, PDError):
        return AbandonReason.TRANSFER_FAILED
    return AbandonReason.PRODUCER_ERROR


class PeerSender:
    """Pushes to one consumer rank, in order, on a thread that owns its own ``Producer``."""

    def __init__(
        self,
        address: PeerAddress,
        make_producer: Callable[[], Producer],
        count: Count,
        trace: TraceFile,
        outstanding: Outstanding,
        *,
        warm: bool,
        cpus: str | None = None,
    ) -> None:
        self.address = address
        self._cpus = cpus
        self._outstanding = outstanding
        self._down_until = 0.0  # monotonic; the sender thread's own
        # Why the handshake failed last, while _refused_until lasts (the sender thread's own).
        self._refused_until = 0.0
        self._refusal: tuple[AbandonReason, str] = (AbandonReason.TRANSFER_FAILED, "")
        self._untold: list[_Untold] = []  # the sender thread's own
        self._make_producer = make_producer
        self._count = count
        self._trace = trace
        self._warm = warm
        # This peer's jobs not finished yet, and when the last was submitted (the pool's thread
        # reads both to pick an idle peer to let go).
        self._unfinished = Outstanding()
        self.last_used = time.monotonic()
        # Bounded in effect by the staging buffer: every push job holds staging pages.
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._stop = threading.Event()
        host, port, _ = address
        self._thread = threading.Thread(
            target=self._run, name=f"lmcache-pd-sender-{host}:{port}", daemon=True
        )
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._outstanding.add(1)
        self._unfinished.add(1)
        self.last_used = time.monotonic()
        self._jobs.put(job)

    @property
    def warm(self) -> bool:
        """Whether this peer is connected ahead of its requests (a known decode rank)."""
        return self._warm

    @property
    def idle(self) -> bool:
        """No job of this peer is queued or running: no write in flight, no allocation due."""
        return self._unfinished.count == 0

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        """Wait for the thread to end (its producer closed); False if it is still running."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # ---- the sender thread ----

    def _run(self) -> None:
        # Before the NIXL agent exists: UCX's own threads inherit where this one may run.
        unpin_this_thread(self._cpus, f"sender for {self.address[0]}:{self.address[1]}")
        try:
            producer = self._make_producer()
        except Exception:
            self._count("thread_errors", 1)
            logger.exception("sender for %s:%d: cannot make its NIXL agent", *self.address[:2])
            self._drain_without_producer()
            return
        try:
            self._serve(producer)
        finally:
            for job in self._pending_jobs():
                self._give_back(job)
            if self._untold:
                logger.warning(
                    "sender for %s:%d stopped with %d notices not acknowledged; given up",
                    *self.address[:2],
                    len(self._untold),
                )
            producer.close()

    def _serve(self, producer: Producer) -> None:
        warm_spec = DisaggSpec("warm-up", *self.address)
        pause_s, next_try = WARM_RETRY_S[0], time.monotonic()
        while not self._stop.is_set():
            # A known peer is connected ahead, and again after a failure made us forget it.
            if self._warm and not producer.connected(warm_spec) and time.monotonic() >= next_try:
                if self._connect_ahead(producer, warm_spec):
                    pause_s = WARM_RETRY_S[0]
                next_try = max(time.monotonic() + pause_s, self._refused_until)
                pause_s = min(WARM_RETRY_S[1], pause_s * 2)
            self._retell(producer)
            try:
                job = self._jobs.get(timeout=SENDER_POLL_S)
            except queue.Empty:
                continue
            try:
                self._handle(producer, job)
            except Exception:  # a bug of ours: this request is recomputed, serving goes on
                self._count("thread_errors", 1)
                logger.exception(
                    "req %s: sender for %s:%d failed unexpectedly; serving on",
                    job.request.spec.req_id,
                    *self.address[:2],
                )

    def _connect_ahead(self, producer: Producer, spec: DisaggSpec) -> bool:
        try:
            producer.connect(spec)
        except (Incompatible, TransportUnusable) as exc:
            # It answers, and would fail the same way again soon: pushes fail at once meanwhile.
            self._refuse_for_a_while(exc)
            logger.error("cannot connect to %s:%d: %s", *self.address[:2], exc)
            return False
        except PDError as exc:
            logger.info("not yet connected to %s:%d ahead of requests: %s", *self.address[:2], exc)
            return False
        self._down_until = 0.0
        self._refused_until = 0.0
        return True

    def _refuse_for_a_while(self, exc: Incompatible | TransportUnusable) -> None:
        self._refused_until = time.monotonic() + REFUSED_BACKOFF_S
        self._refusal = (_reason(exc), str(exc))

    def _handle(self, producer: Producer, job: Job) -> None:
        request = job.request
        if isinstance(job, NoticeJob):
            try:
                job.notify(not request.abandoned.is_set())
            finally:
                self._give_back(job)
            return
        if isinstance(job, AbandonJob):
            try:
                self._tell(producer, request, job.reason, job.detail, job.write_in_flight)
            finally:
                self._give_back(job)
            return
        try:
            if request.abandoned.is_set():
                self._count("jobs_dropped", 1)
                logger.debug("req %s: push dropped, the request was abandoned", request.spec.req_id)
                return
            self._push(producer, job)
        finally:
            self._give_back(job)

    def _push(self, producer: Producer, job: PushJob) -> None:
        spec = job.request.spec
        started = time.time()
        record = {"event": "push", "req_id": spec.req_id, "staged_at": job.staged_at}
        if time.monotonic() < self._down_until:
            self._count("push_failures", 1)
            logger.warning(
                "req %s: not pushed, %s:%d failed its handshake moments ago",
                spec.req_id,
                *self.address[:2],
            )
            record["error"] = "consumer down"
            # Not now: it would wait its deadline for nobody. Sent once the peer may be back.
            reason = AbandonReason.TRANSFER_FAILED
            self._tell(producer, job.request, reason, "consumer down", False, now=False)
            self._trace.write(record | {"start": started, "end": time.time()})
            return
        if time.monotonic() < self._refused_until:
            reason, detail = self._refusal
            self._count("push_failures", 1)
            logger.warning(
                "req %s: not pushed, its consumer's handshake failed: %s", spec.req_id, detail
            )
            record["error"] = detail
            self._tell(producer, job.request, reason, detail, False)
            self._trace.write(record | {"start": started, "end": time.time()})
            return
        try:
            # The chunks may still be on their way into staging: the consumer is asked for
            # pages meanwhile, and they go out once there.
            copied_by = time.monotonic() + DEVICE_COPY_TIMEOUT_S
            result = producer.push(spec, job.chunks, fill=lambda: job.filling.wait(copied_by))
        except RequestDropped as exc:
            job.request.abandoned.set()
            job.request.consumer_told = True  # it let the request go itself
            self._count("push_failures", 1)
            logger.info(
                "req %s: consumer let the request go; its pushes stop: %s", spec.req_id, exc
            )
            record["error"] = str(exc)
        except Exception as exc:
            job.request.abandoned.set()
            self._count("push_failures", 1)
            if not isinstance(exc, PDError):
                self._count("thread_errors", 1)
                logger.exception("req %s: push failed unexpectedly", spec.req_id)
            else:
                logger.warning(
                    "req %s: push failed, telling the consumer to recompute: %s", spec.req_id, exc
                )
            record["error"] = str(exc)
            if isinstance(exc, PeerUnreachable):
                self._down_until = time.monotonic() + DOWN_BACKOFF_S
            if isinstance(exc, Incompatible | TransportUnusable):
                self._refuse_for_a_while(exc)
            in_flight = isinstance(exc, WriteTimeout)  # only a timed-out write may still land
            self._tell(producer, job.request, _reason(exc), str(exc), in_flight)
        else:
            self._down_until = 0.0
            self._count("pushes", 1)
            self._count("chunks_pushed", result.chunks_sent)
            self._count("chunks_skipped", result.chunks_skipped)
            self._count("bytes_pushed", result.bytes_sent)
            self._count("pushes_reserved", int(result.reserved))
            record |= {
                "chunks": result.chunks_sent,
                "skipped": result.chunks_skipped,
                "bytes": result.bytes_sent,
                "reserved": result.reserved,
            }
        self._trace.write(record | {"start": started, "end": time.time()})

    def _tell(
        self,
        producer: Producer,
        request: Saving,
        reason: AbandonReason,
        detail: str,
        write_in_flight: bool = False,
        now: bool = True,
    ) -> None:
        """Tell the consumer once that this request's KV will not come (``now``, or when the
        notices waiting for this peer are next sent). Pushes of one request go in order on this
        thread, each done or failed before the next: only the failing push's own write can
        still be in flight."""
        request.abandoned.set()
        if request.consumer_told:
            return
        request.consumer_told = True
        self._count("pushes_abandoned", 1)
        job = AbandonJob(request, reason, detail, write_in_flight)
        if not (now and self._send(producer, job)):
            self._remember_untold(job, 0)

    @staticmethod
    def _send(producer: Producer, job: AbandonJob) -> bool:
        return producer.abandon(
            job.request.spec, job.reason, job.detail, write_in_flight=job.write_in_flight
        )

    def _remember_untold(self, job: AbandonJob, attempt: int) -> None:
        if attempt >= len(RETELL_AFTER_S):
            logger.warning(
                "req %s: gave up telling %s:%d that its KV will not come",
                job.request.spec.req_id,
                *self.address[:2],
            )
            return
        if len(self._untold) >= MAX_UNTOLD:
            dropped = self._untold.pop(0)
            logger.warning(
                "req %s: too many notices waiting, one given up", dropped.job.request.spec.req_id
            )
        due = time.monotonic() + RETELL_AFTER_S[attempt]
        self._untold.append(_Untold(due, attempt + 1, job))

    def _retell(self, producer: Producer) -> None:
        """Send again the notices that are due; each unacknowledged one waits longer."""
        now = time.monotonic()
        if now < self._down_until:  # the peer did not answer moments ago: later
            return
        due = [untold for untold in self._untold if untold.due <= now]
        if not due:
            return
        self._untold = [untold for untold in self._untold if untold.due > now]
        for untold in due:
            if self._send(producer, untold.job):
                logger.info(
                    "req %s: consumer told at last (try %d)",
                    untold.job.request.spec.req_id,
                    untold.attempt + 1,
                )
            else:
                self._remember_untold(untold.job, untold.attempt)

    def _give_back(self, job: Job) -> None:
        """The job is over: its staging pages go back, and it no longer counts as running."""
        if isinstance(job, PushJob):
            job.pages.__exit__(None, None, None)
        self._outstanding.add(-1)
        self._unfinished.add(-1)

    def _pending_jobs(self) -> list[Job]:
        jobs = []
        while True:
            try:
                jobs.append(self._jobs.get_nowait())
            except queue.Empty:
                return jobs

    def _drain_without_producer(self) -> None:
        """No agent could be made: every job until stop fails (its decode recomputes at its
        deadline), and its staging pages go back."""
        while not self._stop.is_set():
            try:
                job = self._jobs.get(timeout=SENDER_POLL_S)
            except queue.Empty:
                continue
            job.request.abandoned.set()
            self._count("push_failures", isinstance(job, PushJob))
            if isinstance(job, NoticeJob):
                job.notify(False)
            self._give_back(job)
