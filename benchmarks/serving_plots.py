"""The serving benchmark's plots: TTFT and inter-token latency CDFs per workload (one line per
system), and lmcache-pd's per-request timeline (prefill, push, exposed wait, decode)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; no display here
import matplotlib.pyplot as plt
import numpy as np

Raw = dict[tuple[str, str], dict[str, Any]]


def _cdf(axis: Any, values: list[float], label: str) -> None:
    if not values:
        return
    ordered = np.sort(values)
    axis.plot(ordered, np.arange(1, len(ordered) + 1) / len(ordered), label=label)


def _cdfs(raw: Raw, metric: str, path: Path) -> None:
    workloads = sorted({workload for _, workload in raw})
    figure, axes = plt.subplots(1, len(workloads), figsize=(4.5 * len(workloads), 3.5))
    for axis, workload in zip(np.atleast_1d(axes), workloads, strict=True):
        for (system, name), data in sorted(raw.items()):
            if name != workload:
                continue
            done = [r for r in data["requests"] if r["error"] is None]
            values = (
                [r["ttft_ms"] for r in done]
                if metric == "ttft"
                else [g for r in done for g in r["gaps_ms"]]
            )
            _cdf(axis, values, system)
        axis.set_title(workload)
        axis.set_xlabel("TTFT (ms)" if metric == "ttft" else "inter-token latency (ms)")
        axis.set_ylabel("fraction of requests" if metric == "ttft" else "fraction of gaps")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _timeline(phases: list[dict[str, Any]], title: str, path: Path) -> None:
    """One row per request: prefill, push, wait for KV after prefill, decode (ms from start)."""
    figure, axis = plt.subplots(figsize=(9, 0.35 * len(phases) + 1.5))
    origin = min(p["arrived"] for p in phases)
    colours = {
        "prefill": "tab:blue",
        "push": "tab:orange",
        "KV wait": "tab:red",
        "decode": "tab:green",
    }
    for row, p in enumerate(sorted(phases, key=lambda p: p["arrived"])):
        spans = {
            "prefill": (p["arrived"], p["prefilled"]),
            "push": (p["push_start"], p["push_end"]),
            "KV wait": (p["prefilled"], p["kv_loaded"]),
            "decode": (p["kv_loaded"], p["done"]),
        }
        for name, (start, end) in spans.items():
            height = 0.35 if name == "push" else 0.7
            axis.broken_barh(
                [((start - origin) * 1e3, max(end - start, 0) * 1e3)],
                (row - height / 2, height),
                color=colours[name],
                label=name if row == 0 else None,
            )
    axis.set_xlabel("ms since the first request")
    axis.set_ylabel("request")
    axis.set_title(title)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_plots(raw: Raw, stem: Path) -> list[Path]:
    """``{stem}_ttft_cdf.png``, ``{stem}_itl_cdf.png`` and, where lmcache-pd ran,
    ``{stem}_timeline.png`` (its workload with the most prompt tokens pushed)."""
    written = []
    for metric in ("ttft", "itl"):
        path = stem.with_name(f"{stem.name}_{metric}_cdf.png")
        _cdfs(raw, metric, path)
        written.append(path)
    ours = {w: d["phases"] for (s, w), d in raw.items() if s == "lmcache-pd" and d["phases"]}
    if ours:
        workload = max(ours, key=lambda w: sum(p["kv_bytes"] for p in ours[w]))
        path = stem.with_name(f"{stem.name}_timeline.png")
        _timeline(ours[workload], f"lmcache-pd, {workload}: one request per row", path)
        written.append(path)
    return written
