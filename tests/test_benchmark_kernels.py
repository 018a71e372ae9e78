"""The kernel benchmark, run for a moment: every record the issue asks for, in both regimes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes  # the benchmark runs as a child process
BENCHMARK_TIMEOUT_S = 120.0
FIELDS = ("op", "regime", "bytes", "gbps", "memcpy_gbps", "ratio_vs_memcpy")


def test_kernel_benchmark_writes_hot_and_streaming_records_against_memcpy(tmp_path: Path) -> None:
    output = tmp_path / "kernels.json"
    argv = [sys.executable, "-m", "benchmarks.kernels", "--models", "tiny"]
    argv += ["--runs", "5", "--cache-mib", "8", "--stream-mib", "4", "--output", str(output)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BENCHMARK_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]

    document = json.loads(output.read_text())
    records = document["records"]
    assert {(r["op"], r["regime"]) for r in records} >= {
        ("cpu_gather", "hot"),
        ("cpu_scatter", "hot"),
        ("cpu_gather", "streaming"),
        ("cpu_scatter", "streaming"),
        ("cpu_gather_hashed", "hot"),
        ("cpu_scatter_hashed", "streaming"),
    }
    for record in records:
        assert all(field in record for field in FIELDS), record
        assert record["gbps"] > 0 and record["memcpy_gbps"] > 0
        assert record["ratio_vs_memcpy"] == record["gbps"] / record["memcpy_gbps"]
    streaming = [r for r in records if r["regime"] == "streaming"]
    assert all(r["chunks_per_sample"] == 4 for r in streaming)  # 4 MiB of 1 MiB chunks


def test_the_gpu_benchmark_says_what_is_missing_and_writes_nothing(tmp_path: Path) -> None:
    """No GPU here: ``--device cuda`` fails at once, naming what it needs, and no result file
    (which would claim a GPU measurement) is written."""
    output = tmp_path / "kernels_gpu.json"
    argv = [sys.executable, "-m", "benchmarks.kernels", "--device", "cuda"]
    argv += ["--models", "tiny", "--runs", "5", "--output", str(output)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=BENCHMARK_TIMEOUT_S)
    assert done.returncode != 0
    assert "needs a CUDA device and Triton" in done.stderr
    assert not output.exists()
