"""Read lmcache-pd's and vLLM's counters back from an instance's Prometheus ``/metrics``.

For clients (the launcher, the demo, benchmarks, tests): plain HTTP and prometheus_client's
parser, no vLLM import (that costs seconds), so the proxy side stays light.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

METRIC_PREFIX = "lmcache_pd_"
SCRAPE_TIMEOUT_S = 5.0


def _fetch_metrics(url: str, timeout_s: float) -> str:
    base = url.rstrip("/")
    if not base.endswith("/metrics"):
        base += "/metrics"
    response = httpx.get(base, timeout=timeout_s)
    response.raise_for_status()
    return response.text


def parse_pd_samples(text: str) -> dict[str, float]:
    """Our samples in a Prometheus exposition, summed over labels, keyed by bare name."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(METRIC_PREFIX):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):  # counters' creation timestamps
                continue
            name = sample.name.removeprefix(METRIC_PREFIX).removesuffix("_total")
            totals[name] = totals.get(name, 0.0) + sample.value
    return totals


def parse_prompt_tokens_by_source(text: str) -> dict[str, float]:
    """``vllm:prompt_tokens_by_source_total`` in an exposition, summed by its ``source``."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "vllm:prompt_tokens_by_source":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                source = sample.labels.get("source", "")
                totals[source] = totals.get(source, 0.0) + sample.value
    return totals


# Samples of the KV bytes a decode instance received: ours (the consumer rank's landed writes)
# and vLLM's NixlConnector's (decode reads the blocks it lacks).
KV_BYTES_RECEIVED = ("lmcache_pd_consumer_bytes_landed_total", "vllm:nixl_bytes_transferred_sum")


def parse_kv_bytes_received(text: str) -> float:
    """KV bytes received so far by the instance whose exposition ``text`` is, whichever of
    lmcache-pd or NixlConnector moved them (0 for neither)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in KV_BYTES_RECEIVED
    )


def decode_sources(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """One GET of a decode instance's ``/metrics``: its prompt tokens by source and, as
    ``kv_bytes_received``, the KV bytes it received. Raises ``httpx.HTTPError``."""
    text = _fetch_metrics(url, timeout_s)
    return parse_prompt_tokens_by_source(text) | {
        "kv_bytes_received": parse_kv_bytes_received(text)
    }


def scrape(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """GET ``<url>/metrics`` and return our ``lmcache_pd_*`` samples summed over labels, e.g.
    ``{"tokens_loaded": 1000.0, "consumer_used_pages": 0.0}``. Raises ``httpx.HTTPError``."""
    return parse_pd_samples(_fetch_metrics(url, timeout_s))


def prompt_tokens_by_source(url: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """GET ``<url>/metrics`` and return vLLM's prompt tokens by source (e.g. ``local_compute``,
    ``external_kv_transfer``), summed over engines. Raises ``httpx.HTTPError``."""
    return parse_prompt_tokens_by_source(_fetch_metrics(url, timeout_s))
