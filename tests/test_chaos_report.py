"""The chaos report's reading of instance logs (``benchmarks/chaos/report.py``), on lines as the
connector writes them. Fast lane."""

from __future__ import annotations

from benchmarks.chaos.report import log_findings

LOADED = "INFO lmcache_pd.connector.consumer_worker: req {}: rank 0 loaded 512 prompt tokens{}"


def test_a_request_awaiting_pushed_kv_twice_is_flagged_a_reload_from_the_cache_is_not() -> None:
    lines = [
        LOADED.format("cmpl-a", " before its first step"),
        LOADED.format("cmpl-a", " from its consumer's cache before its first step"),  # reload
        LOADED.format("cmpl-b", ""),
        "WARNING lmcache_pd.connector.consumer_worker: req cmpl-b (pd-b): KV not landed within "
        "30.0 s; recomputing the prompt",
    ]
    assert log_findings({"decode-0": lines})["loads_repeated"] == ["cmpl-b"]
    assert log_findings({"prefill-0": lines})["loads_repeated"] == []  # decode's logs only
