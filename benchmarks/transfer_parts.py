"""Transfer throughput between prefill and decode at different tensor-parallel sizes: a request's
KV moved as parts (``lmcache_pd/tp_parts.py``), against bare NIXL moving the same bytes.

- fan-out: one producer (a prefill rank holding 2 KV heads) sends each of two consumers (decode
  ranks of one head each) its head of every chunk: a gather of that head from the paged cache
  (half of each block), then a push to that consumer.
- fan-in: two producers (prefill ranks of one head each, NIXL agents of their own) each send
  their head of every chunk to one consumer (a decode rank of two heads).

Consumers have configs/consumer.yaml's buffer (256 MiB), as serving decodes do.

Methods, as in ``benchmarks/transfer.py`` (whose helpers this uses): "ours" is
``Producer.push`` of each part, whose ``fill`` is the hashed gather of that part (the consumer
is asked for pages meanwhile); "raw NIXL" the plain gather then one bare WRITE per destination
of the same pages, no protocol. Both move every part once, one after
another (the connector pushes to two consumers from two sender threads at once; timed one after
the other here, so that the ratio is of the same work). Methods interleaved run by run; medians.
Beside the ratio, where ours spends more (``cost_split``): the checksums its gather takes, and the
rest of its push (the protocol) over the bare WRITE; and the ratio if only the checksums cost.

Reproduce (table on stdout, JSON in benchmarks/results/transfer-parts.json)::

    .venv/bin/python -m benchmarks.transfer_parts
    .venv/bin/python -m benchmarks.transfer_parts --sizes 1M --chunks-per-request 8 --runs 3
"""

from __future__ import annotations

import contextlib
import logging
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from benchmarks.common import LOG_FORMAT, free_ports, write_json
from benchmarks.environment import run_environment
from benchmarks.transfer import (
    CONFIGS,
    SPARE_PAGES,
    WARMUP_RUNS,
    Source,
    consumer_env,
    parse_sizes,
    push_once,
    raw_write_once,
)
from lmcache_pd.config import load_config
from lmcache_pd.harness.consumer_process import ConsumerProcess
from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.transfer.producer import Peer, Producer

logger = logging.getLogger(__name__)

OUTPUT = Path(__file__).resolve().parent / "results" / "transfer-parts.json"
HEADS = 2
SHAPES = ("fan-out", "fan-in")
METHODS = ("ours", "raw_nixl")


def measure(shape: str, part_bytes: int, count: int, runs: int) -> dict[str, Any]:
    """One record: ``count`` chunks a request, each in 2 parts of ``part_bytes``."""
    consumers = 2 if shape == "fan-out" else 1
    producers = 1 if shape == "fan-out" else 2
    ports = free_ports(2 * consumers)
    specs = [
        DisaggSpec("bench-connect", "127.0.0.1", ports[2 * c], ports[2 * c + 1])
        for c in range(consumers)
    ]
    # Each consumer takes every part meant for it (count of them, or 2 x count fan-in), in a
    # buffer of configs/consumer.yaml's size: a consumer much smaller reserves a producer so
    # few pages that a one-chunk push asks for more every time (fan-in's two producers share
    # them), which a serving decode's buffer of hundreds of pages does not.
    served = load_config(CONFIGS / "consumer.yaml").buffer_size_bytes // part_bytes
    room = max(count * HEADS // consumers, served - SPARE_PAGES)
    staging = count * HEADS // producers  # pages each producer stages a request's parts in
    config = load_config(
        CONFIGS / "producer.yaml",
        page_bytes=part_bytes,
        buffer_size_bytes=staging * part_bytes,
        integrity_checksums=True,
    )
    with contextlib.ExitStack() as stack:
        sinks = [
            stack.enter_context(
                ConsumerProcess(
                    CONFIGS / "consumer.yaml",
                    env=consumer_env({}, "127.0.0.1", part_bytes, room, *ports[2 * c : 2 * c + 2]),
                )
            )
            for c in range(consumers)
        ]
        senders = [stack.enter_context(Producer(config)) for _ in range(producers)]
        # (producer, its source of one head, the consumer and spec that head goes to)
        routes: list[tuple[Producer, Source, ConsumerProcess, DisaggSpec]] = []
        sink_of: list[int] = []  # each route's consumer
        for head in range(HEADS):
            producer = senders[0] if shape == "fan-out" else senders[head]
            sink = 0 if shape == "fan-in" else head
            pages = stack.enter_context(producer.staged(count))
            routes.append((producer, Source(pages, HEADS, head), sinks[sink], specs[sink]))
            sink_of.append(sink)
        peers = [producer.connect(spec) for producer, _, _, spec in routes]
        written = [0] * consumers  # pages each consumer was given, in turn

        def raw(index: int) -> tuple[float, float]:
            producer, source, _, _ = routes[index]
            peer: Peer = peers[index]
            # Round the consumer's buffer, as a receive buffer hands pages out (a page written
            # again and again would stay in this core's cache: benchmarks/transfer.py), each
            # part into pages of its own: fan-in's second part, written into its first's page
            # (as before 2026-12-02), found that page's lines cached, as ours never does.
            first = written[sink_of[index]]
            far = [(first + i) % (room + SPARE_PAGES) for i in range(count)]
            written[sink_of[index]] += count
            return raw_write_once(producer, peer, far, source)

        def every_part(step: Callable[[int], tuple[float, float]]) -> tuple[float, float]:
            """Seconds of gathering every part, and of the rest of sending them."""
            gathers, sends = zip(*(step(index) for index in range(HEADS)), strict=True)
            return sum(gathers), sum(sends)

        steps = {
            "ours": lambda: every_part(
                lambda i: push_once(routes[i][0], config, routes[i][2], routes[i][3], routes[i][1])
            ),
            "raw_nixl": lambda: every_part(raw),
        }
        for index in range(HEADS):  # the bytes land where they should
            producer, source, sink, spec = routes[index]
            push_once(producer, config, sink, spec, source, verify=True)
        samples: dict[str, list[float]] = {name: [] for name in METHODS}
        gathers: dict[str, list[float]] = {name: [] for name in METHODS}
        for run in range(-WARMUP_RUNS, runs):
            for name in METHODS[run % 2 :] + METHODS[: run % 2]:
                gather_s, send_s = steps[name]()
                if run >= 0:
                    samples[name].append(gather_s + send_s)
                    gathers[name].append(gather_s)
    nbytes = HEADS * count * part_bytes
    gbps = {name: nbytes / statistics.median(times) / 1e9 for name, times in samples.items()}
    logger.info("%s %d x 2 x %d B: %s", shape, count, part_bytes, gbps)
    return {
        "shape": shape,
        "part_bytes": part_bytes,
        "chunks_per_request": count,
        "request_bytes": nbytes,
        **{f"{name}_gbps": value for name, value in gbps.items()},
        "ratio_vs_raw_nixl": gbps["ours"] / gbps["raw_nixl"],
        **cost_split(samples, gathers),
        "samples_s": samples,
        "gather_samples_s": gathers,
    }


def cost_split(
    samples: dict[str, list[float]], gathers: dict[str, list[float]]
) -> dict[str, float]:
    """Where ours spends more than raw NIXL, from the medians of a run's parts: the gather that
    takes the checksums in its pass against the plain one, and the rest of the push (the
    protocol: pages reserved or asked for, the notification the WRITE carries, the bookkeeping)
    against the bare WRITE; and the ratio ours would reach if only the checksums cost more."""
    gather = {name: statistics.median(times) for name, times in gathers.items()}
    rest = {
        name: statistics.median(t - g for t, g in zip(samples[name], gathers[name], strict=True))
        for name in samples
    }
    raw = statistics.median(samples["raw_nixl"])
    checksums_s = gather["ours"] - gather["raw_nixl"]
    return {
        "checksum_extra_s": checksums_s,
        "protocol_extra_s": rest["ours"] - rest["raw_nixl"],
        "ratio_with_checksums_only": raw / (raw + max(0.0, checksums_s)),
    }


def print_table(document: dict[str, Any]) -> None:
    table = Table(title=f"Parts, GB/s (medians of {document['settings']['runs']} runs)")
    columns = ("shape", "part", "chunks", "ours", "raw NIXL", "ours/raw")
    for column in (*columns, "+cksum us", "+proto us", "cksum only"):
        table.add_column(column, justify="right")
    for record in document["records"]:
        size = record["part_bytes"]
        table.add_row(
            record["shape"],
            f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB",
            str(record["chunks_per_request"]),
            f"{record['ours_gbps']:.2f}",
            f"{record['raw_nixl_gbps']:.2f}",
            f"{record['ratio_vs_raw_nixl']:.2f}",
            f"{record['checksum_extra_s'] * 1e6:.0f}",
            f"{record['protocol_extra_s'] * 1e6:.0f}",
            f"{record['ratio_with_checksums_only']:.2f}",
        )
    Console().print(table)


app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0])


@app.command()
def main(
    sizes: Annotated[str, typer.Option(help="part sizes")] = "256K,1M,4M",
    chunks_per_request: Annotated[str, typer.Option(help="chunks per request")] = "1,16",
    runs: Annotated[int, typer.Option(min=1, help="timed runs per method")] = 7,
    output: Annotated[Path, typer.Option(help="where the JSON goes")] = OUTPUT,
) -> None:
    """Run every shape, size and count; print the table and write the JSON."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    records = [
        measure(shape, size, count, runs)
        for shape in SHAPES
        for size in parse_sizes(sizes)
        for count in parse_sizes(chunks_per_request)
    ]
    document = {
        **run_environment(("torch", "nixl", "lmcache-pd"), None),
        "settings": {"runs": runs, "warmup_runs": WARMUP_RUNS, "heads": HEADS},
        "records": records,
    }
    print_table(document)
    write_json(output, document)
    logger.info("wrote %s", output)


if __name__ == "__main__":
    app()
