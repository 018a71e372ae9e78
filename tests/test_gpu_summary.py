"""The GPU results' summary (``benchmarks/gpu_summary.py``) read from the committed H200 files:
each goal judged from the records it names, a miss shown as one."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu_summary import FILES, summarise

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


def test_the_summary_judges_each_goal_from_the_records() -> None:
    kernels, stall, transfer = (json.loads((RESULTS / name).read_text()) for name in FILES)
    summary = summarise(kernels, stall, transfer)
    assert summary["device"]["name"] == kernels["device"]["name"]
    copies = summary["copies_vs_device_copy"]
    lowest = min(v for by_layout in copies["default_launch"].values() for v in by_layout.values())
    assert copies["met"] is (lowest >= 0.8)
    # a record made to miss flips the verdict
    worst = next(r for r in stall["records"] if not r["model_waits"])
    worst["added_s"] = 0.5
    assert summarise(kernels, stall, transfer)["load_added_to_step_ms"]["met"] is False
    assert summary["transfer"]["all_bit_exact"] is True
