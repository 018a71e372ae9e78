"""Fresh starts of the pools, with requests sent the moment the proxy is healthy.

Why: the first requests after a start are the ones that meet every one-off cost (NIXL agents and
handshakes, UCX wire-up, vLLM's first steps). Once, 2 of 4 such requests took 30.5 s (a stalled
connect held a producer's only NIXL thread until decode gave up waiting). This starts the pools
``--starts`` times from nothing, sends ``--concurrency`` completions at once as soon as the proxy
answers /health, and records each one's latency and whether decode loaded its KV or computed it.
Goal: no request over ``--goal-s`` (5 s).

``--shared-prefix-tokens N``: the requests of a start share their first N token ids (drawn anew
per start, so that no start's cache serves another), then each has a short tail of its own
(``--tail-tokens``), and they are streamed: a request's latency is the time to its last byte.
Both prefill instances then push the same prefix chunks to decode at once, and decode's consumer
lands and posts them while the instances are still settling: once, 3 of 19 such starts took
~6.8 s a request (the consumer's serving loop stuck 2.1 s and more in a file system call).

Reproduce: ``.venv/bin/python -m benchmarks.cold_start --starts 20`` (2P1D, ~1 min a start here);
writes ``benchmarks/results/cold_start.json``. The shared-prefix mode:
``.venv/bin/python -m benchmarks.cold_start --starts 30 --shared-prefix-tokens 1000 --output
benchmarks/results/cold_start-shared-prefix.json``.
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import httpx
import typer
from rich.console import Console
from rich.table import Table

from benchmarks.common import write_json
from lmcache_pd.deploy.launcher import PoolLauncher
from lmcache_pd.deploy.pools import load_pools
from lmcache_pd.harness.app_thread import proxy_thread
from lmcache_pd.harness.model_maker import ensure_model
from lmcache_pd.metrics_scrape import prompt_tokens_by_source, scrape

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parent.parent
HEALTH_POLL_S = 0.05
HEALTH_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 120.0
# Token ids the shared-prefix mode draws from (the tiny model's vocabulary is 4096; 0-3 are its
# special tokens).
TOKEN_IDS = range(10, 4000)

app = typer.Typer(add_completion=False, help=__doc__)


def _prompt(start: int, index: int, tokens: int) -> list[int]:
    """Distinct token ids per request and start, so that no cache of any run serves another."""
    base = 100 + (start * 17 + index * 7) % 1000
    return [base + (i * 13) % 997 for i in range(tokens)]


def _shared_prefix_prompts(start: int, count: int, prefix: int, tail: int) -> list[list[int]]:
    """``count`` prompts that share their first ``prefix`` token ids, drawn for this start, then
    ``tail`` ids of their own each."""
    shared = random.Random(f"cold-start-{start}")
    common = [shared.choice(TOKEN_IDS) for _ in range(prefix)]
    return [
        common + [own.choice(TOKEN_IDS) for _ in range(tail)]
        for own in (random.Random(f"cold-start-{start}-{index}") for index in range(count))
    ]


def _complete(url: str, model: str, prompt: list[int]) -> float:
    started = time.monotonic()
    response = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0},
        timeout=REQUEST_TIMEOUT_S,
    )
    response.raise_for_status()
    return time.monotonic() - started


def _stream(url: str, model: str, prompt: list[int]) -> float:
    """A streamed completion; the seconds until its last byte. An error event in the stream
    (decode failed after the first token) raises as an HTTP error would."""
    started = time.monotonic()
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and "error" in json.loads(line[len("data: ") :]):
                raise httpx.HTTPError(f"error event in the stream: {line[:200]}")
    return time.monotonic() - started


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + HEALTH_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(HEALTH_POLL_S)
    raise TimeoutError(f"proxy {url} not healthy after {HEALTH_TIMEOUT_S} s")


def one_start(
    pools_path: Path,
    start: int,
    concurrency: int,
    tokens: int,
    workdir: Path,
    shared_prefix: int = 0,
    tail: int = 0,
) -> dict:
    """Start the pools and the proxy, fire the requests at once, stop everything. With
    ``shared_prefix``, the requests share that many leading tokens and are streamed."""
    pools = load_pools(pools_path)
    launcher_started = time.monotonic()
    start_dir = workdir / f"start-{start}"
    with PoolLauncher(pools, start_dir, Console(stderr=True)) as launcher:
        config = launcher.start()
        with proxy_thread(config) as proxy:
            _wait_healthy(proxy.url)
            ready_s = time.monotonic() - launcher_started
            if shared_prefix:
                prompts = _shared_prefix_prompts(start, concurrency, shared_prefix, tail)
                send = _stream
            else:
                prompts = [_prompt(start, i, tokens) for i in range(concurrency)]
                send = _complete
            with ThreadPoolExecutor(concurrency) as pool:
                futures = [pool.submit(send, proxy.url, pools.model, p) for p in prompts]
                latencies, errors = [], []
                for future in futures:
                    try:
                        latencies.append(future.result())
                    except httpx.HTTPError as exc:
                        errors.append(repr(exc))
            time.sleep(1.0)  # a step or two, so that the last counters reach /metrics
            decode = [server.url for name, server in launcher.servers.items() if "decode" in name]
            sources = [prompt_tokens_by_source(url) for url in decode]
            counters = [scrape(url) for url in decode]
    return {
        "start": start,
        "workdir": str(start_dir),
        "ready_s": round(ready_s, 1),
        "latencies_s": [round(x, 3) for x in latencies],
        "errors": errors,
        "decode_tokens_loaded": sum(c.get("tokens_loaded", 0) for c in counters),
        "decode_load_timeouts": sum(c.get("load_timeouts", 0) for c in counters),
        "decode_loads_failed": sum(c.get("loads_failed", 0) for c in counters),
        "decode_tokens_by_source": {
            source: sum(s.get(source, 0) for s in sources)
            for source in ("external_kv_transfer", "local_compute", "local_cache_hit")
        },
    }


@app.command()
def main(
    pools: Annotated[Path, typer.Option(help="pools YAML")] = ROOT / "configs/pools-2p1d.yaml",
    starts: Annotated[int, typer.Option(min=1)] = 20,
    concurrency: Annotated[int, typer.Option(min=1)] = 4,
    prompt_tokens: Annotated[int, typer.Option(min=2)] = 300,
    shared_prefix_tokens: Annotated[
        int, typer.Option(min=0, help="share this many leading tokens, streamed (0: off)")
    ] = 0,
    tail_tokens: Annotated[
        int, typer.Option(min=1, help="each request's own tokens after the shared prefix")
    ] = 24,
    goal_s: float = 5.0,
    output: Path = ROOT / "benchmarks/results/cold_start.json",
    workdir: Path | None = None,
) -> None:
    """Run the fresh starts and write what each request took."""
    logging.basicConfig(level=logging.WARNING)
    ensure_model(Path(load_pools(pools).model))
    workdir = workdir or Path(tempfile.mkdtemp(prefix="lmcache-pd-cold-"))
    console = Console()
    records = []
    for start in range(starts):
        record = one_start(
            pools, start, concurrency, prompt_tokens, workdir, shared_prefix_tokens, tail_tokens
        )
        records.append(record)
        worst = max(record["latencies_s"], default=float("nan"))
        console.print(
            f"start {start}: ready after {record['ready_s']} s, slowest request {worst:.2f} s, "
            f"{len(record['errors'])} errors, decode loaded {record['decode_tokens_loaded']:.0f} "
            f"tokens, computed {record['decode_tokens_by_source']['local_compute']:.0f}, "
            f"{record['decode_load_timeouts']:.0f} load timeouts"
        )
    latencies = [x for r in records for x in r["latencies_s"]]
    command = f"python -m benchmarks.cold_start --pools {pools} --starts {starts}"
    if shared_prefix_tokens:
        command += f" --shared-prefix-tokens {shared_prefix_tokens} --tail-tokens {tail_tokens}"
    summary = {
        "pools": str(pools),
        "starts": starts,
        "concurrency": concurrency,
        "prompt_tokens": (
            shared_prefix_tokens + tail_tokens if shared_prefix_tokens else prompt_tokens
        ),
        "shared_prefix_tokens": shared_prefix_tokens,
        "streamed": bool(shared_prefix_tokens),
        "requests": len(latencies) + sum(len(r["errors"]) for r in records),
        "errors": sum(len(r["errors"]) for r in records),
        "over_goal": sum(x > goal_s for x in latencies),
        "goal_s": goal_s,
        "max_latency_s": max(latencies, default=None),
        "median_latency_s": statistics.median(latencies) if latencies else None,
        "load_timeouts": sum(r["decode_load_timeouts"] for r in records),
        "loads_failed": sum(r["decode_loads_failed"] for r in records),
        "decode_tokens_by_source": {
            source: sum(r["decode_tokens_by_source"][source] for r in records)
            for source in ("external_kv_transfer", "local_compute", "local_cache_hit")
        },
        "starts_over_goal": [
            r["start"] for r in records if any(x > goal_s for x in r["latencies_s"]) or r["errors"]
        ],
        "command": command,
        "workdir": str(workdir),
    }
    write_json(output, {"summary": summary, "starts": records})
    table = Table(title=f"{starts} fresh starts of {pools.name}, {concurrency} requests each")
    for column in ("requests", "errors", f"over {goal_s:g} s", "median s", "max s", "timeouts"):
        table.add_column(column, justify="right")
    table.add_row(
        str(summary["requests"]),
        str(summary["errors"]),
        str(summary["over_goal"]),
        f"{summary['median_latency_s'] or 0:.2f}",
        f"{summary['max_latency_s'] or 0:.2f}",
        f"{summary['load_timeouts']:.0f}",
    )
    console.print(table)
    console.print(f"written to {output}")


if __name__ == "__main__":
    app()
