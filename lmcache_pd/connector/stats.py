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
from dataclasses import dataclass
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

from lmcache_pd.connector.counters import (
    COUNTERS,
    COUNTERS_KEY,
    GAUGES,
    GAUGES_KEY,
    GaugeReports,
    sum_gauges,
)
from lmcache_pd.metrics_scrape import METRIC_PREFIX

logger = logging.getLogger(__name__)


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
        self.data.setdefault(COUNTERS_KEY, {})
        self.data.setdefault(GAUGES_KEY, {})

    @property
    def counters(self) -> dict[str, int]:
        """Counter deltas of the interval, by name."""
        return self.data[COUNTERS_KEY]

    @property
    def gauges(self) -> GaugeReports:
        """Latest gauge values reported in the interval, by worker then name."""
        return self.data[GAUGES_KEY]

    def reset(self) -> None:
        """Empty the container."""
        self.data = {COUNTERS_KEY: {}, GAUGES_KEY: {}}

    def aggregate(self, other: KVConnectorStats) -> PDConnectorStats:
        """Counters add; a worker's gauges in ``other`` replace its older ones here.

        vLLM always passes the newer (or another worker's) report as ``other``. Returns a new
        object, so neither input is changed and no nested dict is shared.
        """
        counters = dict(self.counters)
        for name, delta in other.data.get(COUNTERS_KEY, {}).items():
            counters[name] = counters.get(name, 0) + delta
        gauges = {worker: dict(values) for worker, values in self.gauges.items()}
        for worker, values in other.data.get(GAUGES_KEY, {}).items():
            gauges.setdefault(worker, {}).update(values)
        return PDConnectorStats(data={COUNTERS_KEY: counters, GAUGES_KEY: gauges})

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
        for name, delta in transfer_stats_data.get(COUNTERS_KEY, {}).items():
            if name in self._counters:
                if delta > 0:
                    self._counters[name][engine_idx].inc(delta)
            else:
                self._skip_unknown(name)
        latest = self._latest.setdefault(engine_idx, {})
        for worker, values in transfer_stats_data.get(GAUGES_KEY, {}).items():
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
