"""What the authenticated KV channel costs: the transfer benchmark with a deployment secret and
without, interleaved in one run.

Why: issue 31 puts CURVE on every ZMQ socket (the alloc round trip of each push is encrypted) and
a MAC on every NIXL notification; the goal is a push with auth on at >= 0.97 of one with it off,
and >= 0.9 of raw NIXL, at 1 MiB x 64 chunks. A CURVE consumer answers only CURVE producers, so
each mode has its own consumer process: ``benchmarks.transfer.measure`` runs one (warm-up, then
``runs`` timed pushes of every method, each method first in turn), and the modes alternate,
``rounds`` times each, the first mode of each round alternating too. The record of each round
keeps its own raw NIXL ceiling; ratios are medians over rounds of the ratio within a round, so
the machine's drift between rounds cancels.

Reproduce (table on stdout, JSON in benchmarks/results/auth_cost.json)::

    .venv/bin/python -m benchmarks.auth_cost
    .venv/bin/python -m benchmarks.auth_cost --sizes 1M,16M --chunks-per-request 64 --rounds 5
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from benchmarks.common import LOG_FORMAT, write_json
from benchmarks.environment import run_environment
from benchmarks.transfer import measure, parse_sizes
from lmcache_pd.auth import generate_secret

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "auth_cost.json"
MODES = ("auth_off", "auth_on")


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_benchmark(
    sizes: list[int], chunks_per_request: list[int], rounds: int, runs: int, command: str
) -> dict[str, Any]:
    """Every (size, chunks) with auth off and on, alternating; the JSON document."""
    records = []
    with tempfile.TemporaryDirectory(prefix="lmcache-pd-auth-") as folder:
        secret_file = Path(folder) / "secret"
        secret_file.write_text(generate_secret())
        settings = {"auth_off": {}, "auth_on": {"secret_file": str(secret_file)}}
        for size in sizes:
            for count in chunks_per_request:
                rounds_seen: list[dict[str, dict[str, Any]]] = []
                for index in range(rounds):
                    order = MODES if index % 2 == 0 else MODES[::-1]
                    rounds_seen.append(
                        {mode: measure(size, count, runs, settings[mode]) for mode in order}
                    )
                records.append(_record(size, count, rounds_seen))
    return {
        **run_environment(("torch", "nixl", "pyzmq", "lmcache-pd"), command),
        "settings": {"rounds": rounds, "runs_per_round": runs, "modes": list(MODES)},
        "records": records,
    }


def _record(size: int, count: int, rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    on_vs_off = [r["auth_on"]["ours_gbps"] / r["auth_off"]["ours_gbps"] for r in rounds]
    return {
        "chunk_bytes": size,
        "chunks_per_request": count,
        **{f"{mode}_gbps": _spread([r[mode]["ours_gbps"] for r in rounds]) for mode in MODES},
        **{
            f"{mode}_vs_raw_nixl": _spread([r[mode]["ratio_vs_raw_nixl"] for r in rounds])
            for mode in MODES
        },
        "auth_on_vs_off": _spread(on_vs_off),
        "rounds": rounds,
    }


def print_table(document: dict[str, Any]) -> None:
    table = Table(
        title=f"Auth on vs off, GB/s (medians of {document['settings']['rounds']} rounds)"
    )
    for column in ("chunk", "chunks", "off", "on", "on/off", "on/off range", "on/raw", "off/raw"):
        table.add_column(column, justify="right")
    for record in document["records"]:
        ratio = record["auth_on_vs_off"]
        table.add_row(
            f"{record['chunk_bytes'] >> 10} KiB",
            str(record["chunks_per_request"]),
            f"{record['auth_off_gbps']['median']:.2f}",
            f"{record['auth_on_gbps']['median']:.2f}",
            f"{ratio['median']:.3f}",
            f"{ratio['min']:.3f}-{ratio['max']:.3f}",
            f"{record['auth_on_vs_raw_nixl']['median']:.2f}",
            f"{record['auth_off_vs_raw_nixl']['median']:.2f}",
        )
    Console().print(table)


app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0])


@app.command()
def main(
    sizes: Annotated[str, typer.Option(help="chunk sizes")] = "1M",
    chunks_per_request: Annotated[str, typer.Option(help="chunks per request")] = "64",
    rounds: Annotated[int, typer.Option(min=1, help="rounds of each mode")] = 3,
    runs: Annotated[int, typer.Option(min=1, help="timed pushes per round")] = 7,
    output: Annotated[Path, typer.Option(help="where the JSON goes")] = DEFAULT_OUTPUT,
) -> None:
    """Run the benchmark, print the table and write the JSON."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    command = f"python -m benchmarks.auth_cost --sizes {sizes} --chunks-per-request "
    command += f"{chunks_per_request} --rounds {rounds} --runs {runs}"
    document = run_benchmark(
        parse_sizes(sizes), parse_sizes(chunks_per_request), rounds, runs, command
    )
    print_table(document)
    write_json(output, document)
    logger.info("wrote %s", output)


if __name__ == "__main__":
    app()
