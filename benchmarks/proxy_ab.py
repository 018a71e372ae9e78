"""A proxy setting measured A/B inside one running lmcache-pd: paired runs, not separate starts.

``python -m benchmarks.serving --interleave`` starts each system afresh per run, and on this
shared machine the speed drifts ~2x between starts, which buries a change of a few milliseconds.
Here one set of prefill and decode instances serves both sides: side A through the system's own
proxy, side B through a second proxy whose config differs in one setting (``--setting``, by
default ``first_token_notices=false``). Runs alternate A B, B A, ... on fresh prompts (no prefix
is cached from another run), and each pair's ratio A / B is taken while the machine is in one
phase.

    .venv/bin/python -m benchmarks.proxy_ab --pairs 10
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console

from benchmarks.serving import DEFAULT_MODEL
from benchmarks.serving_load import Workload, run_load, summarize
from benchmarks.serving_systems import make_system
from lmcache_pd.deploy.launcher import unused_port
from lmcache_pd.deploy.vllm_server import wait_until_healthy
from lmcache_pd.harness.model_maker import ensure_model

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "proxy-ab.json"
METRICS = ("ttft_ms_p50", "itl_ms_p50", "first_gap_ms_p50", "first_gap_over_itl_p50", "e2e_ms_p50")
PROXY_START_TIMEOUT_S = 60.0
SETTING_HELP = "KEY=VALUE of side B's proxy config (the value as YAML)"


def _second_proxy(workdir: Path, key: str, value: Any) -> tuple[subprocess.Popen, str]:
    """The system's proxy config with ``key`` set to ``value``, served on a port of its own."""
    config = yaml.safe_load((workdir / "proxy.yaml").read_text())
    config |= {"port": unused_port(set()), key: value, "trace_path": None}
    path = workdir / "proxy-b.yaml"
    path.write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [sys.executable, "-m", "lmcache_pd.cli", "proxy", str(path)],
        stdout=(workdir / "proxy-b.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{config['port']}"
    try:
        wait_until_healthy(url, process, PROXY_START_TIMEOUT_S)
    except BaseException:
        process.terminate()
        raise
    return process, url


def _run(url: str, model: str, workload: Workload, seed: int, concurrency: int) -> dict:
    prompts = workload.prompts(12, seed)
    started = time.perf_counter()
    results = asyncio.run(
        run_load(url, model, prompts, concurrency=concurrency, rate=None, seed=seed)
    )
    summary = summarize(results, time.perf_counter() - started)
    return {key: summary[key] for key in (*METRICS, "failures")}


def main(
    setting: Annotated[str, typer.Option(help=SETTING_HELP)] = "first_token_notices=false",
    pairs: Annotated[int, typer.Option(min=1)] = 10,
    workload: str = "1024/32",
    concurrency: Annotated[int, typer.Option(min=1)] = 2,
    model_dir: Path = DEFAULT_MODEL,
    output: Path = DEFAULT_OUTPUT,
) -> None:
    logging.basicConfig(level=logging.WARNING)
    console = Console()
    key, _, raw = setting.partition("=")
    value = yaml.safe_load(raw)
    model = ensure_model(model_dir)
    shape = Workload.parse(workload)
    workdir = Path(f"/tmp/lmcache-pd-ab-{int(time.time())}")
    sides: dict[str, list[dict]] = {"a": [], "b": []}
    with make_system("lmcache-pd", model, workdir, ["--max-num-batched-tokens", "1024"]) as system:
        proxy_b, url_b = _second_proxy(workdir, key, value)
        try:
            urls = {"a": system.url, "b": url_b}
            for side in sides:  # each proxy's first requests are not measured
                warm_seed = -1 - list(sides).index(side)
                _run(urls[side], str(model), Workload.parse("64/4"), warm_seed, 1)
            for pair in range(pairs):
                for side in ("a", "b") if pair % 2 == 0 else ("b", "a"):
                    seed = 2 * pair + (side == "b")
                    sides[side].append(_run(urls[side], str(model), shape, seed, concurrency))
                    console.print(f"pair {pair} side {side}: {sides[side][-1]}")
        finally:
            proxy_b.terminate()
            proxy_b.wait(30)
    ratios = {
        metric: sorted(a[metric] / b[metric] for a, b in zip(sides["a"], sides["b"], strict=True))
        for metric in METRICS
    }
    record = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "a": "lmcache-pd as configured",
        "b": f"the same instances through a proxy with {key}={value!r}",
        "workload": workload,
        "concurrency": concurrency,
        "runs": sides,
        "medians": {
            side: {m: statistics.median(r[m] for r in runs) for m in METRICS}
            for side, runs in sides.items()
        },
        "paired_ratio_a_over_b": {
            m: {"median": statistics.median(r), "min": r[0], "max": r[-1]}
            for m, r in ratios.items()
        },
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2))
    for metric, ratio in record["paired_ratio_a_over_b"].items():
        console.print(
            f"{metric}: A/B median {ratio['median']:.3f} over {pairs} pairs "
            f"[{ratio['min']:.3f}, {ratio['max']:.3f}]"
        )
    console.print(f"wrote {output}; instance logs in {workdir}")


if __name__ == "__main__":
    typer.run(main)
