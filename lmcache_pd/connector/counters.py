"""The connector's counters and gauges as its threads bump them: names, and the recorder.

Free of vLLM (``stats.py`` hands what a recorder takes to vLLM's stats classes), so that the
worker halves import and run where vLLM is not installed: a GPU machine that measures them
alone. ``stats.py`` says where each part runs and why counters travel as deltas and gauges per
worker.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

from lmcache_pd.transfer.consumer_stats import EXPORTED_COUNTERS, EXPORTED_GAUGES

# Names of the consumer rank's own counters and gauges (``consumer_stats.py``) among ours.
CONSUMER_PREFIX = "consumer_"

COUNTERS: Mapping[str, str] = MappingProxyType(
    {
        "pushes": "Requests whose KV the producer pushed to a consumer.",
        "chunks_pushed": "KV chunks the producer wrote to consumers.",
        "chunks_skipped": "KV chunks not sent because the consumer already held them.",
        "pushes_reserved": "Pushes written into pages the consumer reserved ahead, with no "
        "allocation round trip.",
        "bytes_pushed": "Bytes of KV the producer wrote to consumers.",
        "push_failures": "Pushes that failed; the consumer recomputes those prompts.",
        "pushes_abandoned": "Requests whose consumer was told their KV will not come.",
        "jobs_dropped": "Queued pushes dropped because their request was abandoned.",
        "staging_full": "Times a finished chunk found no free staging page.",
        "pushes_without_rank": "Requests this producer rank could not push: its DisaggSpec "
        "named no consumer rank for it, TP sizes that cannot shard the model's KV heads, or a "
        "decode at another TP size than a cache that cannot be cut by heads (token chunks).",
        "loads_completed": "Requests whose KV the consumer loaded into vLLM's blocks.",
        "loads_sync": "Loads done before the step that computes the request's last token "
        "(its KV had landed on every rank when vLLM scheduled it).",
        "sync_load_failures": "Of those, loads that failed (also in loads_failed): vLLM "
        "recomputes their blocks.",
        "tokens_loaded": "Prompt tokens loaded from a producer instead of computed.",
        "loads_failed": "Loads reported failed to vLLM, which recomputes the prompt.",
        "loads_aborted": "Loads dropped because vLLM aborted the request.",
        "loads_local": "Requests decode served alone (or preempted after their load) that "
        "loaded chunks landed for earlier requests (its consumer's cache) past its own prefix "
        "cache's hit, instead of computing.",
        "keeps_failed": "Requests decode served alone whose computed chunks were not kept in "
        "its consumer's cache (no room, or its process did not answer in time).",
        "loads_unneeded": "Requests decode computes itself (its own prefix cache covered the "
        "prompt, or lost what prefill skipped): pushed chunks released.",
        "load_timeouts": "Loads not complete by their deadline (also in loads_failed).",
        "loads_abandoned": "Loads failed at once: the producer or proxy abandoned their KV.",
        "integrity_failures": "Chunks whose checksum did not match (also in loads_failed).",
        "thread_errors": "Unexpected exceptions caught in the connector's threads.",
        "bad_transfer_params": "Requests whose kv_transfer_params (or first-token address) "
        "were unusable: served without disaggregation (or without a notice).",
        "preemption_recomputes": "Requests preempted after their load, recomputed by vLLM.",
        "preemption_reloads": "Requests preempted after their load, loaded again from the "
        "consumer's cache.",
        "adapters_unreadable": "Requests of a LoRA adapter whose files could not be read for "
        "its chunk keys (not a folder, missing, too large, too slow): served without "
        "disaggregation.",
        "held_prefix_lost": "Requests whose prefix the proxy saw decode's cache hold (prefill "
        "did not push it) but that decode no longer held when it scheduled them: recomputed.",
        # LMCache's proxy protocol (lmcache_proxy.py).
        "proxy_notices": "ProxyNotif messages queued for LMCache's proxy: one per decode rank "
        "per request, once the request's pushes to that rank are done.",
        "proxy_notices_unlanded": "Of those, notices sent after a push of the request to that "
        "rank failed or was given up (its decode computes what did not land).",
        "proxy_notices_dropped": "ProxyNotif messages ZMQ could not queue (LMCache's proxy "
        "not reading them): that request waits at LMCache's proxy.",
        "landed_waits": "Requests with no transfer parameters (from LMCache's proxy) that "
        "waited, at most landed_wait_s from their arrival, for their prompt's chunks to show "
        "landed.",
        # Handshakes, by the transports they settled on (transport.py).
        "peers_local_transport": "Handshakes with a consumer on this network stack (ucx_tls).",
        "peers_remote_transport": "Handshakes with a consumer on another host or namespace "
        "(ucx_tls_remote, TCP by default).",
        "peers_fallback_transport": "Handshakes whose first transports failed the self-test "
        "and that went on over TCP.",
        "transport_self_test_failures": "Transport self-tests failed at handshake.",
        "handshakes_refused": "Handshakes refused: the two sides' KV formats differ.",
        "peers_evicted": "Idle consumer senders let go to make room for a new consumer "
        "(the most one producer keeps is 64).",
        "consumer_process_down": "Times the consumer rank's own process was found gone; "
        "every load of that rank is recomputed from then on.",
        "consumer_messages_refused": "Messages to the consumer rank's own process that its "
        "outbox had no room for (the process read nothing: stopped, or not scheduled): the "
        "load a claim was for is recomputed, a release is sent again next step.",
        # What the connector costs vLLM's own threads: the time its hooks hold them.
        "model_thread_microseconds": "Microseconds the connector's worker hooks held vLLM's "
        "model-runner thread (loads, copies out, keeps, results): the step waits meanwhile.",
        "scheduler_thread_microseconds": "Microseconds the connector's scheduler hooks held "
        "vLLM's scheduler (engine-core) thread: scheduling waits meanwhile.",
        # The consumer rank's own counters (its process), as deltas each step.
        **{CONSUMER_PREFIX + name: text for name, text in EXPORTED_COUNTERS.items()},
    }
)
GAUGES: Mapping[str, str] = MappingProxyType(
    {
        "kv_events_unauthenticated": "1 while the scheduler publishes KV events beyond "
        "loopback with no deployment secret: anyone who connects reads every cached prompt's "
        "token ids.",
        **{CONSUMER_PREFIX + name: text for name, text in EXPORTED_GAUGES.items()},
    }
)

# Keys of PDConnectorStats.data.
COUNTERS_KEY = "counters"
GAUGES_KEY = "gauges"

# worker -> gauge name -> latest value
GaugeReports = dict[str, dict[str, int]]


# what one interval reported: COUNTERS_KEY -> name -> delta, GAUGES_KEY -> GaugeReports
StatsData = dict[str, Any]


def sum_gauges(reports: GaugeReports) -> dict[str, int]:
    """Each gauge's latest value summed over the workers that reported it."""
    totals: dict[str, int] = {}
    for values in reports.values():
        for name, value in values.items():
            totals[name] = totals.get(name, 0) + value
    return totals


class StatsRecorder:
    """Thread-safe counters of one connector half; ``take`` hands vLLM what is new.

    Cheap enough for hot paths: a lock and a dict update, no I/O. Unknown names raise at once,
    so a typo fails its first test rather than reporting nothing.
    """

    def __init__(self, worker: str) -> None:
        """``worker`` names this reporter among the engine's (e.g. ``"rank0"``,
        ``"scheduler"``); gauges from different workers are summed, from one are replaced."""
        self._worker = worker
        self._lock = threading.Lock()
        self._deltas: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._totals: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._gauges: dict[str, int] = {}
        self._reported_gauges: dict[str, int] = {}

    @property
    def worker(self) -> str:
        """The name this recorder reports its gauges under."""
        return self._worker

    def add(self, name: str, n: int = 1) -> None:
        """Count ``n`` more of counter ``name``."""
        if name not in COUNTERS:
            raise ValueError(f"unknown counter {name!r}; known: {', '.join(COUNTERS)}")
        if n < 0:
            raise ValueError(f"counter {name!r} only goes up, got {n}")
        with self._lock:
            self._deltas[name] += n
            self._totals[name] += n

    def set_gauge(self, name: str, value: int) -> None:
        """Set gauge ``name`` to its current ``value``."""
        if name not in GAUGES:
            raise ValueError(f"unknown gauge {name!r}; known: {', '.join(GAUGES)}")
        with self._lock:
            self._gauges[name] = value

    def take(self) -> StatsData | None:
        """What accumulated since the last call, starting a new interval, as the payload of
        vLLM's stats object (``stats.PDConnectorStats``); None when nothing.

        None matters: vLLM treats any stats object as output worth sending, even an empty one.
        """
        with self._lock:
            counters = {name: delta for name, delta in self._deltas.items() if delta}
            changed = {
                name: value
                for name, value in self._gauges.items()
                if self._reported_gauges.get(name) != value
            }
            if not counters and not changed:
                return None
            self._deltas = dict.fromkeys(COUNTERS, 0)
            self._reported_gauges.update(changed)
        gauges = {self._worker: changed} if changed else {}
        return {COUNTERS_KEY: counters, GAUGES_KEY: gauges}

    def totals(self) -> dict[str, int]:
        """Counters since start (taken or not), and each gauge's current value, for logs."""
        with self._lock:
            return {**self._totals, **self._gauges}


class Counted(Protocol):
    """A connector half's facade: it has a recorder."""

    _stats: StatsRecorder


P = ParamSpec("P")
R = TypeVar("R")
C = TypeVar("C", bound=Counted)


def holds_thread(
    counter: str,
) -> Callable[[Callable[Concatenate[C, P], R]], Callable[Concatenate[C, P], R]]:
    """A connector hook whose time on the vLLM thread that calls it is counted in ``counter``
    (microseconds, whether it returns or raises): vLLM's step or scheduling waits for every hook,
    so this is what the connector adds to them. ~1 us a call (two clock reads, a locked add)."""
    if counter not in COUNTERS:
        raise ValueError(f"unknown counter {counter!r}")

    def wrap(hook: Callable[Concatenate[C, P], R]) -> Callable[Concatenate[C, P], R]:
        @functools.wraps(hook)
        def timed(self: C, *args: P.args, **kwargs: P.kwargs) -> R:
            started = time.perf_counter_ns()
            try:
                return hook(self, *args, **kwargs)
            finally:
                self._stats.add(counter, (time.perf_counter_ns() - started) // 1000)

        return timed

    return wrap
