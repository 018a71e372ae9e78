"""Two systems of the serving benchmark compared over all their runs, with how sure that is.

``serving.py`` reports each figure as the median over runs of that run's percentile; on these
machines one system's TTFT p50 spans ~2x from run to run, so a 5-15% difference between two
systems needs many runs and a statement of how uncertain it is. This reads any number of
``serving.py`` result files (e.g. runs in both orders, ``--interleave``), pools the runs of each
system per workload, and gives per metric the ratio of the medians (``system / against``) and a
bootstrap interval: the runs of each system resampled with replacement, the ratio taken again,
and the interval between the ``(1 - confidence) / 2`` quantiles. An interval that contains 1 says
the runs cannot tell the two apart at that confidence.

Reproduce (the consumer's cache on vs off, 12 runs each, open loop)::

    .venv/bin/python -m benchmarks.serving --systems lmcache-pd,lmcache-pd-nocache \\
        --workloads 1500/32@1400,400/32x3 --num-prompts 48 --rate 10 --runs 3 --interleave \\
        --output /tmp/cache-a.json     # then the reverse order and more seeds, likewise
    .venv/bin/python -m benchmarks.serving_compare /tmp/cache-*.json \\
        --system lmcache-pd --against lmcache-pd-nocache
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

METRICS = (
    "ttft_ms_p50",
    "ttft_ms_p90",
    "itl_ms_p50",
    "itl_ms_p90",
    "itl_ms_p99",
    "first_gap_ms_p50",
    "e2e_ms_p50",
)

app = typer.Typer(add_completion=False, help=__doc__)


def pooled_runs(documents: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, float]]]:
    """Every run of every (workload, system) across ``documents`` (serving.py's JSON)."""
    runs: dict[tuple[str, str], list[dict[str, float]]] = {}
    for document in documents:
        for result in document["results"]:
            runs.setdefault((result["workload"], result["system"]), []).extend(result["runs"])
    return runs


def ratio_interval(
    ours: list[float], theirs: list[float], resamples: int, confidence: float, seed: int
) -> tuple[float, float, float]:
    """(median(ours) / median(theirs), low, high): the bootstrap interval of that ratio."""
    rng = random.Random(seed)
    ratios = sorted(
        statistics.median(rng.choices(ours, k=len(ours)))
        / statistics.median(rng.choices(theirs, k=len(theirs)))
        for _ in range(resamples)
    )
    tail = (1 - confidence) / 2
    low = ratios[int(tail * (resamples - 1))]
    high = ratios[int((1 - tail) * (resamples - 1))]
    return statistics.median(ours) / statistics.median(theirs), low, high


def compare(
    documents: list[dict[str, Any]],
    system: str,
    against: str,
    metrics: tuple[str, ...] = METRICS,
    resamples: int = 4000,
    confidence: float = 0.9,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One record per workload both systems ran and metric: runs, ratio and its interval."""
    runs = pooled_runs(documents)
    records = []
    for workload in sorted({w for w, s in runs if s == system and (w, against) in runs}):
        ours, theirs = runs[(workload, system)], runs[(workload, against)]
        for metric in metrics:
            ratio, low, high = ratio_interval(
                [run[metric] for run in ours],
                [run[metric] for run in theirs],
                resamples,
                confidence,
                seed,
            )
            records.append(
                {
                    "workload": workload,
                    "metric": metric,
                    "runs": [len(ours), len(theirs)],
                    "ratio": ratio,
                    "low": low,
                    "high": high,
                    "confidence": confidence,
                }
            )
    return records


@app.command()
def main(
    results: Annotated[list[Path], typer.Argument(help="serving.py result JSON files")],
    system: str = "lmcache-pd",
    against: str = "lmcache-pd-nocache",
    resamples: Annotated[int, typer.Option(min=100)] = 4000,
    confidence: Annotated[float, typer.Option(min=0.5, max=0.99)] = 0.9,
    seed: int = 0,
    output: Annotated[Path | None, typer.Option(help="write the records as JSON here")] = None,
) -> None:
    """Print (and write) SYSTEM / AGAINST per workload and metric over all runs of RESULTS."""
    documents = [json.loads(path.read_text()) for path in results]
    records = compare(documents, system, against, METRICS, resamples, confidence, seed)
    if not records:
        raise typer.BadParameter(f"no workload in these files has runs of {system} and {against}")
    table = Table(title=f"{system} / {against}, {confidence:.0%} bootstrap interval over runs")
    for column in ("workload", "metric", "runs", "ratio", "interval"):
        table.add_column(column)
    for record in records:
        table.add_row(
            record["workload"],
            record["metric"],
            "/".join(map(str, record["runs"])),
            f"{record['ratio']:.2f}",
            f"[{record['low']:.2f}, {record['high']:.2f}]",
        )
    Console().print(table)
    if output is not None:
        output.write_text(json.dumps({"files": [str(p) for p in results], "records": records}))


if __name__ == "__main__":
    app()
