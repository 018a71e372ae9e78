"""The proxy's Prometheus metrics, in a registry owned by one proxy (no process-wide state)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lmcache_pd.proxy.routing import Upstream

# Buckets for CPU-served tiny models up to real GPU serving: 1 ms to 60 s.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip


class Outcome(enum.Enum):
    """How a request ended, as counted in ``lmcache_pd_proxy_requests_total``."""

    OK = "ok"
    BAD_REQUEST = "bad_request"
    UPSTREAM_REJECTED = "upstream_rejected"
    PREFILL_FAILED = "prefill_failed"
    DECODE_FAILED = "decode_failed"
    NO_INSTANCE = "no_instance"
    CLIENT_DISCONNECTED = "client_disconnected"
    INTERNAL_ERROR = "internal_error"


class ProxyMetrics:
    """Counters and histograms of one proxy; ``/metrics`` serves ``exposition()``."""

    def __init__(
        self, upstreams: Callable[[], Iterable[Upstream]], in_flight: Callable[[], int]
    ) -> None:
        """``upstreams`` gives the instances there are now (a cluster engine changes them),
        ``in_flight`` the requests the proxy serves now."""
        self.registry = CollectorRegistry()
        self._upstreams = upstreams
        prefix = "lmcache_pd_proxy"
        self.requests = Counter(
            f"{prefix}_requests",
            "Client requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            f"{prefix}_ttft_seconds",
            "From the client's request to its first token leaving the proxy",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.itl = Histogram(
            f"{prefix}_inter_token_seconds",
            "Between consecutive streamed events of one response, as forwarded",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.placement = Histogram(
            f"{prefix}_placement_seconds",
            "Choosing a request's instances: with routing kv, finding its prompt's token ids "
            "(a text or chat prompt asks an instance's /tokenize) and scoring the instances",
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.upstream_errors = Counter(
            f"{prefix}_upstream_errors",
            "Failed upstream calls by instance and kind",
            ["role", "instance", "kind"],
            registry=self.registry,
        )
        self.kv_drops = Counter(
            f"{prefix}_kv_drops",
            "Requests whose pushed KV decode was told to drop (decode was not asked, or the "
            "request ended badly)",
            registry=self.registry,
        )
        self.kv_drops_skipped = Counter(
            f"{prefix}_kv_drops_skipped",
            "Drop notices not sent: as many were in flight as the proxy sends at once (the "
            "request's pages come back at decode's claim timeout)",
            registry=self.registry,
        )
        self.served_alone = Counter(
            f"{prefix}_served_alone",
            "Requests whose prompt was under min_disagg_tokens, served by decode alone",
            registry=self.registry,
        )
        self.not_disaggregated = Counter(
            f"{prefix}_not_disaggregated",
            "Requests served by decode alone, unchanged, for a field no first token from prefill "
            "can serve exactly: n (more than one choice), beam_search, echo, prompt_logprobs, "
            "suffix, prompt_embeds, include_reasoning (false); responses (the Responses API); "
            "prefill_refused (a stream prefill refused: decode gives vLLM's own refusal)",
            ["reason"],
            registry=self.registry,
        )
        self.adapter_replay_failures = Counter(
            f"{prefix}_adapter_replay_failures",
            "Instances back up that could not be given the LoRA adapters loaded at run time "
            "through the proxy (they stay down until a later health check gives them)",
            registry=self.registry,
        )
        self.prefill_retries = Counter(
            f"{prefix}_prefill_retries",
            "Requests retried on another prefill instance before their first token",
            registry=self.registry,
        )
        self.decode_migrations = Counter(
            f"{prefix}_decode_migrations",
            "Answers gone on on another decode instance after theirs failed under them, by the "
            "failure: connect, timeout, broken, truncated, status, bad_answer, unauthorized",
            ["cause"],
            registry=self.registry,
        )
        self.migrations_refused = Counter(
            f"{prefix}_migrations_refused",
            "Answers whose decode failed and that could not go on elsewhere, by why: limit "
            "(decode_migrations reached), no_instance, not_plain (the client has part of a "
            "stream that is not one choice's plain text)",
            ["reason"],
            registry=self.registry,
        )
        self.first_token_notices = Counter(
            f"{prefix}_first_token_notices",
            "Disaggregated requests by what prefill's first-token notice did: used (decode was "
            "asked on it), after_answer (prefill's answer came first, or no notice), unused (the "
            "answer ended at its first token), mismatched (it disagreed with the answer)",
            ["outcome"],
            registry=self.registry,
        )
        self.local_render_timeouts = Counter(
            f"{prefix}_local_render_timeouts",
            "Prompts the proxy's own tokenizer did not render within the health deadline, "
            "routed by load (routing kv or cache_aware)",
            registry=self.registry,
        )
        self.first_token_mismatches = Counter(
            f"{prefix}_first_token_mismatches",
            "Answers whose decode did not go on from the tokens it was forced through (prefill's "
            "first token; after a migration, what the client had): its instance lacks the forcing "
            "logits processor. A stream ends with an error, a whole answer is decode's own",
            registry=self.registry,
        )
        self.membership_errors = Counter(
            f"{prefix}_membership_errors",
            "Failed questions to the cluster engine about the pools' members",
            registry=self.registry,
        )
        self.refused = Counter(
            f"{prefix}_refused",
            "Requests refused at the door, before their body was read: unauthorized (no valid "
            "API key), over_capacity (max_in_flight reached; answered 503 with Retry-After)",
            ["reason"],
            registry=self.registry,
        )
        # Per instance URL, the (role, kind) series of upstream_errors it has.
        self._error_series: dict[str, set[tuple[str, str]]] = {}
        self.registry.register(_InstanceGauges(upstreams))
        self.registry.register(_InFlightGauge(in_flight))

    def count_notice_refusals(self, refused: Callable[[], int]) -> None:
        """Serve the first-token board's refused handshakes (``refused`` reads its
        gatekeeper's count): a key of no role that sends notices knocked on its port."""
        self.registry.register(_NoticeRefusals(refused))

    def upstream_error(self, member: Upstream, kind: str) -> None:
        """Count a failed call to ``member``, unless it left its pool while the call ran (it
        died, say): its series went then (``forget_instance``), and one made now would stay
        for good. The caller has logged the failure."""
        if all(other.url != member.url for other in self._upstreams()):
            return
        self.upstream_errors.labels(member.role.value, member.url, kind).inc()
        self._error_series.setdefault(member.url, set()).add((member.role.value, kind))

    def forget_instance(self, member: Upstream) -> None:
        """Drop the error series of an instance that left its pool: a cluster engine's pools
        change, and series of instances long gone would grow without bound."""
        for role, kind in self._error_series.pop(member.url, ()):
            self.upstream_errors.remove(role, member.url, kind)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _InFlightGauge(Collector):
    """Requests the proxy serves now (those admitted at its door), read at scrape time."""

    def __init__(self, in_flight: Callable[[], int]) -> None:
        self._in_flight = in_flight

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "lmcache_pd_proxy_in_flight",
            "Client requests the proxy serves now (at most max_in_flight)",
            value=self._in_flight(),
        )


class _NoticeRefusals(Collector):
    """The first-token board's refused CURVE handshakes, read at scrape time from the count
    its gatekeeper keeps (the consumer serves its own as ``peers_refused``)."""

    def __init__(self, refused: Callable[[], int]) -> None:
        self._refused = refused

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "lmcache_pd_proxy_notice_peers_refused",
            "CURVE clients refused at the first-token board's handshake: keys of no role that "
            "sends notices (only producers do)",
            value=self._refused(),
        )


class _InstanceGauges(Collector):
    """Per-instance gauges read at scrape time from the instances there are then: never stale,
    and an instance that left the pools is not reported."""

    def __init__(self, upstreams: Callable[[], Iterable[Upstream]]) -> None:
        self._upstreams = upstreams

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["role", "instance"]
        outstanding = GaugeMetricFamily(
            "lmcache_pd_proxy_outstanding", "Requests in flight per instance", labels=labels
        )
        up = GaugeMetricFamily(
            "lmcache_pd_proxy_instance_up",
            "1 while an instance is considered healthy",
            labels=labels,
        )
        for member in self._upstreams():
            outstanding.add_metric([member.role.value, member.url], member.outstanding)
            up.add_metric([member.role.value, member.url], float(member.healthy))
        yield outstanding
        yield up
