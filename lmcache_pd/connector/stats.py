"""The connector's counters and gauges, from the threads that bump them to vLLM's ``/metrics``.

Where each part runs (vLLM 0.32):

- ``StatsRecorder`` lives in every process that holds a connector half. In a worker process the
  model-runner thread and our sender/service threads call ``add``/``set_gauge``; the model-runner
  thread calls ``take`` through ``get_kv_connector_stats()`` once per ``execute_model``, steps
  with no scheduled tokens included. The scheduler half (engine-core process) may keep its own
  recorder: ``Scheduler.update_from_output`` also calls ``get_kv_connector_stats()`` there.
- ``PDConnectorStats`` is built by ``take``, pickled to the engine core (multiprocess executor),
  merged across TP workers by ``KVOutputAggregator`` with ``aggregate``, flattened by
  ``to_dict()`` into ``SchedulerStats`` and sent by msgpack to the API server, so ``data`` holds
  only str-keyed dicts of ints.
- ``PDPromMetrics`` lives in the API-server process: ``PrometheusStatLogger`` builds it once
  through ``build_prom_metrics`` and calls ``observe`` for each engine step that carried stats.
- Clients read them back with ``lmcache_pd.metrics_scrape`` (no vLLM import there).

Why deltas: vLLM adds up every report (Prometheus ``inc``, the log line's ``aggregate``), so a
worker reports what happened since its last report and ``take`` starts a fresh interval.

Why gauges are keyed by worker: ``aggregate`` serves two merges, across workers within a step
and across steps in the logger; a sum is right for the first and wrong for the second. So a gauge
travels as ``{worker: {name: value}}``: a newer report of one worker replaces its older one, and
``reduce``/``observe`` sum the latest value over workers. A worker reports a gauge only when it
changed, so ``observe`` remembers every worker's last value.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge
from vllm.config import VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from lmcache_pd.metrics_scrape import METRIC_PREFIX
from lmcache_pd.transfer.consumer_stats import EXPORTED_COUNTERS, EXPORTED_GAUGES

logger = logging.getLogger(__name__)

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
        "named no consumer rank for it, or TP sizes that cannot shard the model's KV heads.",
        "loads_completed": "Requests whose KV the consumer loaded into vLLM's blocks.",
        "loads_sync": "Loads done before the step that computes the request's last token "
        "(its KV had landed on every rank when vLLM scheduled it).",
        "sync_load_failures": "Of those, loads that failed (also in loads_failed): vLLM "
        "recomputes their blocks.",
        "tokens_loaded": "Prompt tokens loaded from a producer instead of computed.",
        "loads_failed": "Loads reported failed to vLLM, which recomputes the prompt.",
        "loads_aborted": "Loads dropped because vLLM aborted the request.",
        "loads_unneeded": "Requests decode computes itself (its own prefix cache covered the "
        "prompt, or lost what prefill skipped): pushed chunks released.",
        "load_timeouts": "Loads not complete by their deadline (also in loads_failed).",
        "loads_abandoned": "Loads failed at once: the producer or proxy abandoned their KV.",
        "integrity_failures": "Chunks whose checksum did not match (also in loads_failed).",
        "thread_errors": "Unexpected exceptions caught in the connector's threads.",
        "bad_transfer_params": "Requests whose kv_transfer_params (or first-token address) "
        "were unusable: served without disaggregation (or without a notice).",
        "preemption_recomputes": "Requests preempted after their load, recomputed by vLLM.",
        "held_prefix_lost": "Requests whose prefix the proxy saw decode's cache hold (prefill "
        "did not push it) but that decode no longer held when it scheduled them: recomputed.",
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
        # The consumer rank's own counters (its process), as deltas each step.
        **{CONSUMER_PREFIX + name: text for name, text in EXPORTED_COUNTERS.items()},
    }
)
GAUGES: Mapping[str, str] = MappingProxyType(
    {CONSUMER_PREFIX + name: text for name, text in EXPORTED_GAUGES.items()}
)

# Keys of PDConnectorStats.data.
_COUNTERS_KEY = "counters"
_GAUGES_KEY = "gauges"

# worker -> gauge name -> latest value
GaugeReports = dict[str, dict[str, int]]


@dataclass
class PDConnectorStats(KVConnectorStats):
    """One interval's counter deltas and the gauges that changed in it, per reporting worker.

    ``data`` is ``{"counters": {name: delta}, "gauges": {worker: {name: value}}}``; zero deltas
    are left out so an idle step sends nothing.
    """

    def __post_init__(self) -> None:
        # vLLM rebuilds stats from the to_dict() payload, or from None for an empty container.
        if not self.data:
            self.reset()
        self.data.setdefault(_COUNTERS_KEY, {})
        self.data.setdefault(_GAUGES_KEY, {})

    @property
    def counters(self) -> dict[str, int]:
        """Counter deltas of the interval, by name."""
        return self.data[_COUNTERS_KEY]

    @property
    def gauges(self) -> GaugeReports:
        """Latest gauge values reported in the interval, by worker then name."""
        return self.data[_GAUGES_KEY]

    def reset(self) -> None:
        """Empty the container."""
        self.data = {_COUNTERS_KEY: {}, _GAUGES_KEY: {}}

    def aggregate(self, other: KVConnectorStats) -> PDConnectorStats:
        """Counters add; a worker's gauges in ``other`` replace its older ones here.

        vLLM always passes the newer (or another worker's) report as ``other``. Returns a new
        object, so neither input is changed and no nested dict is shared.
        """
        counters = dict(self.counters)
        for name, delta in other.data.get(_COUNTERS_KEY, {}).items():
            counters[name] = counters.get(name, 0) + delta
        gauges = {worker: dict(values) for worker, values in self.gauges.items()}
        for worker, values in other.data.get(_GAUGES_KEY, {}).items():
            gauges.setdefault(worker, {}).update(values)
        return PDConnectorStats(data={_COUNTERS_KEY: counters, _GAUGES_KEY: gauges})

    def reduce(self) -> dict[str, int | float]:
        """For vLLM's periodic log line: non-zero counters, then each gauge summed over the
        workers that reported it."""
        summary: dict[str, int | float] = {
            name: self.counters[name] for name in COUNTERS if self.counters.get(name)
        }
        summary.update(sum_gauges(self.gauges))
        return summary

    def is_empty(self) -> bool:
        """True when nothing was counted and no gauge was reported."""
        return not any(self.counters.values()) and not any(self.gauges.values())


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

    def take(self) -> PDConnectorStats | None:
        """What accumulated since the last call, starting a new interval; None when nothing.

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
        return PDConnectorStats(data={_COUNTERS_KEY: counters, _GAUGES_KEY: gauges})

    def totals(self) -> dict[str, int]:
        """Counters since start (taken or not), and each gauge's current value, for logs."""
        with self._lock:
            return {**self._totals, **self._gauges}


class PDPromMetrics(KVConnectorPromMetrics):
    """Our counters and gauges on vLLM's ``/metrics``, one child per engine label set."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM re-creates its loggers in one process (elastic EP, tests) and unregisters only
        # "vllm:" collectors first; without this our second registration would raise.
        _unregister_ours()
        self._counters = {
            name: create_metric_per_engine(
                self._counter_cls(
                    name=METRIC_PREFIX + name, documentation=doc, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for name, doc in COUNTERS.items()
        }
        self._gauges = {
            name: create_metric_per_engine(
                self._gauge_cls(
                    name=METRIC_PREFIX + name,
                    documentation=doc,
                    labelnames=labelnames,
                    multiprocess_mode="mostrecent",  # as vLLM's own gauges
                ),
                per_engine_labelvalues,
            )
            for name, doc in GAUGES.items()
        }
        self._latest: dict[int, GaugeReports] = {}
        self._unknown: set[str] = set()

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        """Add one step's counter deltas; set each gauge to the sum of its workers' latest.

        Runs in the API server's output loop, where an exception would stop serving, so names
        this version does not know are logged once and skipped.
        """
        for name, delta in transfer_stats_data.get(_COUNTERS_KEY, {}).items():
            if name in self._counters:
                if delta > 0:
                    self._counters[name][engine_idx].inc(delta)
            else:
                self._skip_unknown(name)
        latest = self._latest.setdefault(engine_idx, {})
        for worker, values in transfer_stats_data.get(_GAUGES_KEY, {}).items():
            latest.setdefault(worker, {}).update(values)
        for name, total in sum_gauges(latest).items():
            if name in self._gauges:
                self._gauges[name][engine_idx].set(total)
            else:
                self._skip_unknown(name)

    def _skip_unknown(self, name: str) -> None:
        if name not in self._unknown:
            self._unknown.add(name)
            logger.warning("lmcache-pd stats: ignoring unknown metric %r", name)


def _unregister_ours() -> None:
    """Drop our collectors from prometheus_client's default registry, as vLLM does for its own."""
    for collector in list(REGISTRY._collector_to_names):
        if isinstance(collector, Counter | Gauge) and collector._name.startswith(METRIC_PREFIX):
            REGISTRY.unregister(collector)
