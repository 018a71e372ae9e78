"""The connector's stats: recorder, vLLM's stats hooks, Prometheus export and scraping."""

from __future__ import annotations

import http.server
import pickle
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client import REGISTRY, generate_latest
from vllm.config import KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
    PromMetric,
    PromMetricT,
)
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from lmcache_pd.connector import stats
from lmcache_pd.connector.counters import COUNTERS, GAUGES, StatsRecorder, holds_thread
from lmcache_pd.connector.stats import PDConnectorStats, PDPromMetrics
from lmcache_pd.metrics_scrape import decode_sources, prompt_tokens_by_source, scrape

LABELS = ["model_name", "engine"]


def taken(recorder: StatsRecorder) -> PDConnectorStats | None:
    """What ``recorder`` took, as the facade hands it to vLLM."""
    data = recorder.take()
    return None if data is None else PDConnectorStats(data=data)


ENGINE_LABELS: dict[int, list[object]] = {0: ["demo", "0"], 1: ["demo", "1"]}


class StatsOnlyConnector(KVConnectorBase_V1):
    """The stats hooks as LMCachePDConnector is to implement them; vLLM loads this class by
    module path, as it loads ours, and never instantiates it here."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PDConnectorStats:
        return PDConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PDPromMetrics:
        return PDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


def transfer_config() -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector=StatsOnlyConnector.__name__,
        kv_connector_module_path=__name__,
        kv_role="kv_both",
    )


@pytest.fixture
def prom() -> Iterator[KVConnectorProm]:
    """vLLM's own per-connector Prometheus hook, as PrometheusStatLogger builds it."""
    vllm_config = SimpleNamespace(kv_transfer_config=transfer_config())
    yield KVConnectorProm(vllm_config, LABELS, ENGINE_LABELS)  # type: ignore[arg-type]
    stats._unregister_ours()


def sample(name: str, engine: str = "0") -> float | None:
    return REGISTRY.get_sample_value(name, {"model_name": "demo", "engine": engine})


class _Exposition(http.server.BaseHTTPRequestHandler):
    body = b""
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, format: str, *args: object) -> None:  # quiet test output
        pass


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, type[_Exposition]]]:
    """A /metrics endpoint on a free local port; the test sets the handler's body."""
    handler = type("Handler", (_Exposition,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        thread.join(timeout=5)
        server.server_close()


# ---- recorder ----


def test_take_returns_deltas_since_last_take_and_starts_a_new_interval() -> None:
    recorder = StatsRecorder("rank0")
    recorder.add("pushes")
    recorder.add("bytes_pushed", 4096)
    first = taken(recorder)
    assert first is not None
    assert first.counters == {"pushes": 1, "bytes_pushed": 4096}
    recorder.add("pushes", 2)
    second = taken(recorder)
    assert second is not None
    assert second.counters == {"pushes": 2}


def test_take_returns_none_when_nothing_happened() -> None:
    recorder = StatsRecorder("rank0")
    assert taken(recorder) is None
    recorder.add("pushes", 0)
    assert taken(recorder) is None
    recorder.add("pushes")  # control: one real count is reported
    assert taken(recorder) is not None
    assert taken(recorder) is None


def test_totals_count_since_start_across_takes() -> None:
    recorder = StatsRecorder("rank0")
    recorder.add("tokens_loaded", 100)
    taken(recorder)
    recorder.add("tokens_loaded", 50)
    recorder.set_gauge("consumer_used_pages", 3)
    totals = recorder.totals()
    assert totals["tokens_loaded"] == 150
    assert totals["consumer_used_pages"] == 3
    assert totals["pushes"] == 0
    assert set(totals) == set(COUNTERS) | {"consumer_used_pages"}


@pytest.mark.parametrize(
    ("call", "args"),
    [
        ("add", ("tokens_loded", 1)),
        ("add", ("consumer_used_pages", 1)),
        ("add", ("pushes", -1)),
        ("set_gauge", ("pushes", 1)),
        ("set_gauge", ("used_pages", 1)),
    ],
)
def test_unknown_name_or_negative_count_is_refused(call: str, args: tuple[str, int]) -> None:
    recorder = StatsRecorder("rank0")
    with pytest.raises(ValueError):
        getattr(recorder, call)(*args)
    assert taken(recorder) is None


class Hooks:
    """A connector half's hooks as the facade times them."""

    def __init__(self) -> None:
        self._stats = StatsRecorder("rank0")

    @holds_thread("model_thread_microseconds")
    def step(self, seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    @holds_thread("scheduler_thread_microseconds")
    def refuse(self) -> None:
        time.sleep(0.002)
        raise RuntimeError("refused")


def test_a_hook_counts_the_microseconds_it_held_its_thread_returning_or_raising() -> None:
    hooks = Hooks()
    assert hooks.step(0.005) == "done"
    with pytest.raises(RuntimeError):
        hooks.refuse()
    counted = hooks._stats.totals()
    assert 5_000 <= counted["model_thread_microseconds"] < 1_000_000
    assert 2_000 <= counted["scheduler_thread_microseconds"] < 1_000_000
    # Control: a hook that does nothing adds (next to) nothing. The least of a few calls: a busy
    # host can take the thread away for milliseconds in any one (3.9 ms once, a whole suite's).
    added = []
    for _ in range(5):
        before = hooks._stats.totals()["model_thread_microseconds"]
        hooks.step(0)
        added.append(hooks._stats.totals()["model_thread_microseconds"] - before)
    assert min(added) < 2_000


def test_a_hook_timed_into_an_unknown_counter_is_refused_where_it_is_declared() -> None:
    with pytest.raises(ValueError, match="unknown counter"):
        holds_thread("model_thread_seconds")


def test_every_hook_vllm_calls_each_step_is_timed() -> None:
    from lmcache_pd.connector.facade import LMCachePDConnector

    worker = ("start_load_kv", "get_block_ids_with_load_errors", "wait_for_save")
    worker += ("get_transfer_results", "build_connector_worker_meta")
    scheduler = ("get_num_new_matched_tokens", "update_state_after_alloc")
    scheduler += ("build_connector_meta", "request_finished", "update_connector_output")
    scheduler += ("has_pending_push_work", "take_events")
    for name in (*worker, *scheduler):
        assert hasattr(getattr(LMCachePDConnector, name), "__wrapped__"), name
    # control: a hook vLLM calls once, at start-up, is not
    assert not hasattr(LMCachePDConnector.register_kv_caches, "__wrapped__")


@pytest.fixture
def frequent_thread_switches() -> Iterator[None]:
    """Switch threads every microsecond, so an unlocked read-modify-write loses counts."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def count_and_drain(recorder: StatsRecorder, threads_n: int, adds_n: int) -> int:
    """Sender-like threads add while a model-runner-like thread takes; returns all taken."""
    drained: list[int] = []
    done = threading.Event()

    def count() -> None:
        for _ in range(adds_n):
            recorder.add("chunks_pushed")
            recorder.add("bytes_pushed", 3)

    def drain() -> None:
        while not done.is_set():
            if (got := taken(recorder)) is not None:
                drained.append(got.counters.get("chunks_pushed", 0))

    drainer = threading.Thread(target=drain)
    drainer.start()
    workers = [threading.Thread(target=count) for _ in range(threads_n)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
    done.set()
    drainer.join(timeout=10)
    if (rest := taken(recorder)) is not None:
        drained.append(rest.counters.get("chunks_pushed", 0))
    return sum(drained)


@pytest.mark.usefixtures("frequent_thread_switches")
def test_concurrent_adds_from_threads_sum_exactly() -> None:
    # Lost updates are rare under the GIL, so a few rounds give an unlocked recorder a chance
    # to show them (it failed about one round in three when tried).
    threads_n, adds_n = 8, 5_000
    for _ in range(4):
        recorder = StatsRecorder("rank0")
        assert count_and_drain(recorder, threads_n, adds_n) == threads_n * adds_n
        assert recorder.totals()["bytes_pushed"] == 3 * threads_n * adds_n


def test_gauge_is_reported_only_when_its_value_changed() -> None:
    recorder = StatsRecorder("rank1")
    recorder.set_gauge("consumer_used_pages", 0)
    first = taken(recorder)
    assert first is not None
    assert first.gauges == {"rank1": {"consumer_used_pages": 0}}
    recorder.set_gauge("consumer_used_pages", 0)
    assert taken(recorder) is None
    recorder.set_gauge("consumer_used_pages", 5)
    recorder.set_gauge("consumer_held_requests", 2)
    changed = taken(recorder)
    assert changed is not None
    assert changed.gauges == {"rank1": {"consumer_used_pages": 5, "consumer_held_requests": 2}}


# ---- stats objects through vLLM's plumbing ----


def worker_output(stats_: PDConnectorStats | None) -> ModelRunnerOutput:
    return ModelRunnerOutput.with_kv_conn_output_only(KVConnectorOutput(kv_connector_stats=stats_))


def test_two_workers_stats_aggregate_as_vllm_merges_tp_workers() -> None:
    rank0, rank1 = StatsRecorder("rank0"), StatsRecorder("rank1")
    rank0.add("loads_completed", 2)
    rank0.set_gauge("consumer_used_pages", 10)
    rank1.add("loads_completed", 3)
    rank1.add("loads_failed")
    rank1.set_gauge("consumer_used_pages", 4)
    outputs = [worker_output(taken(rank0)), worker_output(taken(rank1))]

    merged = KVOutputAggregator(expected_finished_count=2).aggregate(outputs)

    assert merged is not None and merged.kv_connector_output is not None
    result = merged.kv_connector_output.kv_connector_stats
    assert isinstance(result, PDConnectorStats)
    assert result.counters == {"loads_completed": 5, "loads_failed": 1}
    assert result.reduce() == {"loads_completed": 5, "loads_failed": 1, "consumer_used_pages": 14}


def test_aggregate_over_steps_keeps_a_workers_latest_gauge_not_the_sum() -> None:
    recorder = StatsRecorder("rank0")
    recorder.set_gauge("consumer_used_pages", 10)
    recorder.add("pushes")
    older = taken(recorder)
    recorder.set_gauge("consumer_used_pages", 7)
    recorder.add("pushes")
    newer = taken(recorder)
    assert older is not None and newer is not None

    merged = older.aggregate(newer)

    assert merged.reduce() == {"pushes": 2, "consumer_used_pages": 7}
    assert older.reduce() == {"pushes": 1, "consumer_used_pages": 10}  # inputs untouched


def test_empty_stats_are_empty_and_any_count_or_gauge_is_not() -> None:
    assert PDConnectorStats().is_empty()
    assert StatsOnlyConnector.build_kv_connector_stats(None).is_empty()
    assert not PDConnectorStats(data={"counters": {"pushes": 1}}).is_empty()
    assert not PDConnectorStats(data={"gauges": {"rank0": {"consumer_used_pages": 0}}}).is_empty()


def test_stats_cross_processes_by_pickle_and_vllm_msgpack() -> None:
    recorder = StatsRecorder("rank0")
    recorder.add("tokens_loaded", 256)
    recorder.set_gauge("consumer_held_requests", 1)
    report = taken(recorder)
    assert report is not None
    assert pickle.loads(pickle.dumps(report)) == report  # worker -> engine core

    # engine core -> API server: Scheduler.make_stats puts to_dict() into SchedulerStats
    frames = MsgpackEncoder().encode(SchedulerStats(kv_connector_stats=report.to_dict()))
    received = MsgpackDecoder(SchedulerStats).decode(frames)

    rebuilt = StatsOnlyConnector.build_kv_connector_stats(received.kv_connector_stats)
    assert rebuilt.reduce() == {"tokens_loaded": 256, "consumer_held_requests": 1}


def test_vllm_log_line_shows_counter_sums_and_latest_gauges() -> None:
    logging_ = KVConnectorLogging(transfer_config())
    for pages in (10, 7):
        recorder_step = PDConnectorStats(
            data={"counters": {"pushes": 1}, "gauges": {"rank0": {"consumer_used_pages": pages}}}
        )
        logging_.observe(recorder_step.to_dict())
    lines: list[str] = []
    logging_.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: pushes=2, consumer_used_pages=7"]


# ---- Prometheus ----


def test_prom_metrics_register_our_names_with_vllm_labels(prom: KVConnectorProm) -> None:
    assert isinstance(prom.prom_metrics, PDPromMetrics)
    for name in COUNTERS:
        assert sample(f"lmcache_pd_{name}_total") == 0.0
    for name in GAUGES:
        assert sample(f"lmcache_pd_{name}", engine="1") == 0.0
    assert sample("lmcache_pd_not_a_metric_total") is None  # control: lookup can miss


def test_prom_observe_adds_counters_per_engine(prom: KVConnectorProm) -> None:
    prom.observe({"counters": {"tokens_loaded": 100, "loads_completed": 1}}, engine_idx=0)
    prom.observe({"counters": {"tokens_loaded": 28}}, engine_idx=0)
    prom.observe({"counters": {"tokens_loaded": 5}}, engine_idx=1)
    assert sample("lmcache_pd_tokens_loaded_total") == 128.0
    assert sample("lmcache_pd_loads_completed_total") == 1.0
    assert sample("lmcache_pd_tokens_loaded_total", engine="1") == 5.0


def test_prom_gauge_is_the_sum_of_each_workers_latest_value(prom: KVConnectorProm) -> None:
    prom.observe(
        {"gauges": {"rank0": {"consumer_used_pages": 10}, "rank1": {"consumer_used_pages": 4}}}
    )
    assert sample("lmcache_pd_consumer_used_pages") == 14.0
    # Only rank0 changed this step: rank1's last value still counts, rank0's is replaced.
    prom.observe({"gauges": {"rank0": {"consumer_used_pages": 1}}})
    assert sample("lmcache_pd_consumer_used_pages") == 5.0
    assert sample("lmcache_pd_consumer_used_pages", engine="1") == 0.0


def test_prom_observe_skips_names_it_does_not_know(prom: KVConnectorProm) -> None:
    prom.observe({"counters": {"from_a_newer_version": 3, "pushes": 1}})
    assert sample("lmcache_pd_pushes_total") == 1.0


def test_prom_metrics_can_be_built_twice_in_one_process(prom: KVConnectorProm) -> None:
    prom.observe({"counters": {"pushes": 4}})
    again = KVConnectorProm(
        SimpleNamespace(kv_transfer_config=transfer_config()),  # type: ignore[arg-type]
        LABELS,
        ENGINE_LABELS,
    )
    assert isinstance(again.prom_metrics, PDPromMetrics)
    assert sample("lmcache_pd_pushes_total") == 0.0  # the new logger starts from zero


# ---- scraping ----

# As prometheus_client 0.26 writes it: a counter's _created samples form a separate gauge family.
FIXED_EXPOSITION = b"""\
# HELP lmcache_pd_tokens_loaded_total Prompt tokens loaded.
# TYPE lmcache_pd_tokens_loaded_total counter
lmcache_pd_tokens_loaded_total{engine="0",model_name="m"} 600.0
lmcache_pd_tokens_loaded_total{engine="1",model_name="m"} 400.0
# HELP lmcache_pd_tokens_loaded_created Prompt tokens loaded.
# TYPE lmcache_pd_tokens_loaded_created gauge
lmcache_pd_tokens_loaded_created{engine="0",model_name="m"} 1.7e+09
# HELP lmcache_pd_consumer_used_pages Pages in use.
# TYPE lmcache_pd_consumer_used_pages gauge
lmcache_pd_consumer_used_pages{engine="0",model_name="m"} 0.0
# HELP vllm:prompt_tokens_by_source_total Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 24.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="external_kv_transfer"} 1000.0
vllm:prompt_tokens_by_source_total{engine="1",model_name="m",source="local_compute"} 8.0
# HELP vllm:prompt_tokens_by_source_created Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_created gauge
vllm:prompt_tokens_by_source_created{engine="0",model_name="m",source="local_compute"} 1.7e+09
# HELP vllm:num_requests_running Number of requests.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_scrape_sums_our_samples_over_labels(metrics_server: tuple[str, Any]) -> None:
    url, handler = metrics_server
    handler.body = FIXED_EXPOSITION
    assert scrape(url) == {"tokens_loaded": 1000.0, "consumer_used_pages": 0.0}


def test_prompt_tokens_by_source_sums_over_engines(metrics_server: tuple[str, Any]) -> None:
    url, handler = metrics_server
    handler.body = FIXED_EXPOSITION
    assert prompt_tokens_by_source(url + "/metrics") == {
        "local_compute": 32.0,
        "external_kv_transfer": 1000.0,
    }


NIXL_EXPOSITION = b"""\
# HELP vllm:nixl_bytes_transferred Number of bytes transferred per NIXL KV Cache transfers.
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf",model_name="m"} 2.0
vllm:nixl_bytes_transferred_count{engine="0",model_name="m"} 2.0
vllm:nixl_bytes_transferred_sum{engine="0",model_name="m"} 3145728.0
"""


@pytest.mark.parametrize(
    ("body", "received"),
    [(FIXED_EXPOSITION, 0.0), (NIXL_EXPOSITION, 3145728.0)],
    ids=["ours_none_landed", "nixl"],
)
def test_decode_sources_reads_kv_bytes_of_either_connector(
    metrics_server: tuple[str, Any], body: bytes, received: float
) -> None:
    url, handler = metrics_server
    handler.body = body + b"lmcache_pd_consumer_bytes_landed_total 0.0\n"
    assert decode_sources(url)["kv_bytes_received"] == received
    handler.body = FIXED_EXPOSITION + b"lmcache_pd_consumer_bytes_landed_total 1048576.0\n"
    assert decode_sources(url) == {
        "local_compute": 32.0,
        "external_kv_transfer": 1000.0,
        "kv_bytes_received": 1048576.0,
    }


def test_scrape_raises_when_metrics_are_not_served(metrics_server: tuple[str, Any]) -> None:
    url, handler = metrics_server
    handler.body = FIXED_EXPOSITION
    handler.status = 503
    with pytest.raises(httpx.HTTPStatusError):
        scrape(url)


def test_worker_counts_reach_a_scrape_of_vllm_registry(
    prom: KVConnectorProm, metrics_server: tuple[str, Any]
) -> None:
    """Recorder -> TP merge -> API server's Prometheus hook -> exposition -> scrape."""
    rank0, rank1 = StatsRecorder("rank0"), StatsRecorder("rank1")
    rank0.add("tokens_loaded", 600)
    rank1.add("tokens_loaded", 400)
    rank1.set_gauge("consumer_held_requests", 2)
    merged = KVOutputAggregator(2).aggregate(
        [worker_output(taken(rank0)), worker_output(taken(rank1))]
    )
    assert merged is not None and merged.kv_connector_output is not None
    payload = merged.kv_connector_output.kv_connector_stats
    assert payload is not None
    prom.observe(payload.to_dict(), engine_idx=0)

    url, handler = metrics_server
    handler.body = generate_latest(REGISTRY)
    scraped = scrape(url)
    assert scraped["tokens_loaded"] == 1000.0
    assert scraped["consumer_held_requests"] == 2.0
    assert scraped["pushes"] == 0.0
