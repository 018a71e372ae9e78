"""The proxy overhead benchmark, run for a moment: every figure is there and sane (not fast)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.proxy import FIGURES, LATENCIES, MODES, PROCESSES

pytestmark = pytest.mark.processes  # the benchmark runs as a child process
CONCURRENCY = (1, 4)
RUNS = 2
BENCHMARK_TIMEOUT_S = 90.0


def test_proxy_benchmark_writes_every_figure_for_both_modes(tmp_path: Path) -> None:
    output = tmp_path / "proxy.json"
    argv = [sys.executable, "-m", "benchmarks.proxy"]
    argv += ["--concurrency", ",".join(map(str, CONCURRENCY)), "--runs", str(RUNS)]
    argv += ["--run-seconds", "0.3", "--warmup-seconds", "0.1", "--output", str(output)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BENCHMARK_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Added by the proxy" in done.stdout

    document = json.loads(output.read_text())
    assert "proxy.py --concurrency 1,4" in document["command"]
    assert document["machine"]["cpu_count"] >= 1
    assert document["settings"]["concurrency"] == list(CONCURRENCY)
    records = {(r["concurrency"], r["mode"]): r for r in document["records"]}
    assert set(records) == {(count, mode) for count in CONCURRENCY for mode in MODES}
    for (_, mode), record in records.items():
        assert all(record[name] > 0 for name in FIGURES), record
        for latency in LATENCIES:
            assert record[f"{latency}_p99_ms"] >= record[f"{latency}_p50_ms"]
        assert record["ttft_p50_ms"] < record["e2e_p50_ms"]
        assert record["requests_per_run"] >= 1 and len(record["runs"]) == RUNS
        assert isinstance(record["errors"], int) and record["errors"] >= 0
        cpu = record["cpu_ms_per_request"]
        assert set(cpu) == set(PROCESSES) and min(cpu.values()) >= 0
        assert cpu["decode"] > 0 and cpu["client"] > 0
        if mode == "proxy":
            assert cpu["proxy"] > 0
    added = {row["concurrency"]: row for row in document["added"]}
    assert set(added) == set(CONCURRENCY)
    for row in added.values():
        assert all(math.isfinite(row[name]) for name in FIGURES[1:])
        assert row["proxy_cpu_ms_per_request"] > 0
        assert isinstance(row["meets_goal"], bool)
