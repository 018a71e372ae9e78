"""Transfer throughput: a full ``Producer.push`` against bare NIXL and memcpy, on one machine.

Why: the protocol around a NIXL WRITE (ZMQ alloc round trip, checksums, WriteDone notification)
should cost little next to the WRITE, and the WRITE little next to what memory allows. Ratios are
taken only between numbers of the same run, interleaved run by run, because this machine's speed
drifts ~2x from one run to the next (see DESIGN.md, "NIXL between two processes on one machine").

For each (chunk size, chunks per request) a consumer runs in a child process (its own NIXL agent)
on free ports, and a producer here gathers each request's chunks from a paged source cache (blocks
of up to 128 KiB at scattered ids, as vLLM's) into pages of its registered staging buffer, then
sends them, as the connector does:

- ours: ``Producer.push`` with fresh keys and req_id each run, whose ``fill`` is the gather
  taking each chunk's checksum in the same pass (``CpuKVCache.gather(hashed=True)``): the
  consumer is asked for pages while it runs, as in the connector;
- ours_nochecksum: the same with a plain gather and integrity off;
- raw NIXL: a plain gather, then ``post_write`` + ``wait_for_transfer`` of the same pages, no
  protocol, no notification, into the consumer's pages in turn (as a receive buffer hands them
  out: a page written again and again stays in this core's 2 MiB cache, and a one-chunk WRITE
  into it took half the time of one into the next page, 80 vs 190 us for 1 MiB);
- memcpy: single-thread ``numpy.copyto`` of the same chunks into another buffer.

So "ours / raw NIXL" is what the protocol and integrity cost on top of the copy-out and the WRITE
that any design pays. Each record also keeps the push (or WRITE) alone (``*_send_gbps``); before
integrity moved into the gather, "ours" was the push alone with a checksum pass inside it.

With ``--netns`` the producer runs in one network namespace and the consumer in another, joined
by a veth pair (``lmcache_pd.harness.netns``; needs root), as two hosts are: the handshake then
picks ``ucx_tls_remote`` (TCP by default) and raw NIXL writes over that same agent, so both
cross the same link with the same transport. JSON in ``benchmarks/results/transfer-netns.json``.

Raw NIXL is a ceiling only where the initiator alone completes a write (the default: CMA, error
mode "none"). Over tcp, or in error mode "peer", completion waits on the consumer's progress, and
an idle consumer polls NIXL every 5 ms, against 0.1 ms while a push's write is pending: there raw
NIXL reads low and ours/raw can exceed 1.

Reproduce (medians of 7 runs; table on stdout, JSON in benchmarks/results/transfer.json)::

    .venv/bin/python -m benchmarks.transfer
    .venv/bin/python -m benchmarks.transfer --sizes 1M,16M --chunks-per-request 64 \\
        --runs 5 --ucx-tls tcp --output /tmp/transfer-tcp.json
    .venv/bin/python -m benchmarks.transfer --netns --runs 3   # across two network namespaces
"""

from __future__ import annotations

import itertools
import logging
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import numpy as np
import torch
import typer
from rich.console import Console
from rich.table import Table

from benchmarks.common import LOG_FORMAT, free_ports, write_json
from benchmarks.environment import run_environment
from lmcache_pd.config import PDConfig, load_config
from lmcache_pd.harness import netns
from lmcache_pd.harness.consumer_process import ConsumerProcess
from lmcache_pd.kernels import CpuKVCache
from lmcache_pd.kernels.integrity import checksum
from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.transfer.channel import wait_for_transfer
from lmcache_pd.transfer.producer import Peer, Producer

logger = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "transfer.json"
NETNS_OUTPUT = Path(__file__).resolve().parent / "results" / "transfer-netns.json"
DEFAULT_SIZES = "256K,1M,4M,16M"
DEFAULT_CHUNKS = "1,64"
DEFAULTS = (DEFAULT_SIZES, DEFAULT_CHUNKS, 7)
QUICK = ("64K,1M", "1,8", 3)
SPARE_PAGES = 16  # the consumer's pages beyond one request's
WARMUP_RUNS = 2  # with one spare consumer page, two pushes touch every page of its buffer
RELEASE_TIMEOUT_S = 10.0
METHODS = ("ours", "ours_nochecksum", "raw_nixl", "memcpy")
SENDERS = ("ours", "ours_nochecksum", "raw_nixl")  # timed as gather, then send
SOURCE_BLOCK_BYTES = 128 << 10  # a block of the tiny model's cache (4 layers x 2 heads x 128)
COLUMNS = ("chunk", "chunks", "ours", "no cksum", "raw NIXL", "memcpy", "ours/raw", "raw/memcpy")
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_sizes(text: str) -> list[int]:
    """``"256K,1M"`` -> ``[262144, 1048576]``; plain numbers are bytes."""
    sizes = []
    for item in filter(None, (part.strip().upper() for part in text.split(","))):
        scale = UNITS.get(item[-1], 1)
        sizes.append(int(item[:-1] if item[-1] in UNITS else item) * scale)
    if not sizes or min(sizes) < 1:
        raise ValueError(f"no positive sizes in {text!r}")
    return sizes


class Source:
    """A paged KV cache to gather the pushed chunks from: one chunk's blocks at scattered ids
    per staging page, as a prompt's are in vLLM's cache; with ``heads``, each page one head's
    part of a chunk (``head``'s bytes of each block), as a rank sends another at a different
    TP size (``benchmarks/transfer_parts.py``)."""

    def __init__(self, pages: list[torch.Tensor], heads: int = 1, head: int = 0) -> None:
        chunk_bytes = pages[0].numel()
        head_bytes = next(
            size
            for size in range(min(SOURCE_BLOCK_BYTES // heads, chunk_bytes), 0, -1)
            if chunk_bytes % size == 0
        )
        per_chunk = chunk_bytes // head_bytes
        total = 2 * per_chunk * len(pages)
        cache = torch.randint(0, 256, (total, heads, 1, head_bytes), dtype=torch.uint8)
        self.cache = CpuKVCache([cache[:, head : head + 1]])
        ids = torch.randperm(total, generator=torch.Generator().manual_seed(head))
        self.tables = list(ids[: per_chunk * len(pages)].view(len(pages), per_chunk))
        self.pages = pages

    def gather(self, hashed: bool) -> tuple[float, list[int]]:
        """Seconds of gathering every chunk into its page, and their checksums if ``hashed``."""
        started = time.perf_counter()
        digests = [
            self.cache.gather(table, page, hashed=hashed)
            for table, page in zip(self.tables, self.pages, strict=True)
        ]
        elapsed = time.perf_counter() - started
        return elapsed, [d for d in digests if d is not None]


def push_once(
    producer: Producer,
    config: PDConfig,
    consumer: ConsumerProcess,
    spec: DisaggSpec,
    source: Source,
    verify: bool = False,
) -> tuple[float, float]:
    """Seconds of gathering the chunks (hashed when ``config`` checks integrity) and of the
    rest of pushing them under fresh keys; the consumer then frees them. The gather is the
    push's ``fill``, as the connector's is: the consumer is asked for pages while it runs."""
    # Producer reads its config per push; swapping it lets both checksum modes share one
    # staging buffer, one agent and one handshake, so they differ only in the checksums.
    producer.config = config
    spec = msgspec.structs.replace(spec, req_id=f"bench-{uuid.uuid4().hex}")
    gathered: list[tuple[float, list[int]]] = []

    def fill() -> list[int] | None:
        gathered.append(source.gather(hashed=config.integrity_checksums))
        return gathered[0][1] or None

    chunks = [(uuid.uuid4().bytes, page) for page in source.pages]
    started = time.perf_counter()
    result = producer.push(spec, chunks, fill=fill)
    ((gather_s, checksums),) = gathered
    elapsed = time.perf_counter() - started - gather_s
    if result.chunks_sent != len(chunks):
        raise RuntimeError(f"{spec.req_id}: only {result.chunks_sent} of {len(chunks)} sent")
    if verify:  # the benchmark must measure bytes that really land where they should
        consumer.wait_until(lambda s: s["pending_writes"] == 0, RELEASE_TIMEOUT_S, "landed")
        landed = consumer.call("checksums", keys=[key.hex() for key, _ in chunks])
        if landed != [checksum(page) for page in source.pages] or landed != checksums:
            raise RuntimeError(f"{spec.req_id}: landed bytes differ from the gathered ones")
    consumer.call("release", req_id=spec.req_id)
    consumer.wait_until(lambda s: s["used_pages"] == 0, RELEASE_TIMEOUT_S, "pages returned")
    return gather_s, elapsed


def raw_write_once(
    producer: Producer, peer: Peer, far_pages: Sequence[int], source: Source
) -> tuple[float, float]:
    """Seconds of a plain gather and of one bare NIXL WRITE, with an empty notification, of
    the source's pages into the consumer's ``far_pages``; the WRITE's descriptors are made in
    its time, as any sender makes them."""
    gather_s, _ = source.gather(hashed=False)
    deadline = time.monotonic() + producer.config.transfer_timeout_s
    started = time.perf_counter()
    base, page_bytes = peer.buffer.base_addr, peer.page_bytes
    segments = [
        (page.data_ptr(), base + at * page_bytes, page.numel())
        for page, at in zip(source.pages, far_pages, strict=True)
    ]
    handle = peer.channel.post_write(peer.name, segments, peer.buffer, b"")
    try:
        wait_for_transfer(peer.channel, handle, deadline, "raw NIXL write")
        return gather_s, time.perf_counter() - started
    finally:
        peer.channel.release(handle)


def _memcpy(sources: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    """Seconds of copying each source chunk into its target, on one thread. numpy's copy is
    libc memcpy; torch's single-threaded ``copy_`` of uint8 measured ~3x slower here."""
    pairs = [
        (source.numpy(), target.numpy()) for source, target in zip(sources, targets, strict=True)
    ]
    started = time.perf_counter()
    for source, target in pairs:
        np.copyto(target, source)
    return time.perf_counter() - started


def consumer_env(
    settings: dict[str, Any],
    host: str,
    page_bytes: int,
    pages: int,
    init_port: int,
    alloc_port: int,
) -> dict[str, str]:
    """A consumer process's environment: ``settings``, its address, and room for ``pages`` pages
    of ``page_bytes`` and for pages reserved ahead (at most 1/8 of the buffer, >= 2)."""
    overrides = {
        **settings,
        "receiver_host": host,
        "page_bytes": page_bytes,
        "buffer_size_bytes": (pages + SPARE_PAGES) * page_bytes,
        "init_port": init_port,
        "alloc_port": alloc_port,
    }
    return {
        f"LMCACHE_PD_{name.upper()}": str(value).lower() if isinstance(value, bool) else str(value)
        for name, value in overrides.items()
        if value is not None
    }


def measure(
    chunk_bytes: int,
    count: int,
    runs: int,
    settings: dict[str, Any],
    consumer_netns: str | None = None,
    consumer_host: str = "127.0.0.1",
) -> dict[str, Any]:
    """One record: medians and samples of every method for ``count`` chunks of ``chunk_bytes``;
    the consumer in network namespace ``consumer_netns`` at ``consumer_host`` if given.
    ``settings`` are transfer config keys of both sides (e.g. ``secret_file``)."""
    init_port, alloc_port = free_ports(2)
    env = consumer_env(settings, consumer_host, chunk_bytes, count, init_port, alloc_port)
    staging = {"page_bytes": chunk_bytes, "buffer_size_bytes": count * chunk_bytes}
    checked = load_config(
        CONFIGS / "producer.yaml", **settings, **staging, integrity_checksums=True
    )
    unchecked = msgspec.structs.replace(checked, integrity_checksums=False)
    spec = DisaggSpec("bench-connect", consumer_host, init_port, alloc_port)
    wrap = ["ip", "netns", "exec", consumer_netns] if consumer_netns else []
    with (
        ConsumerProcess(CONFIGS / "consumer.yaml", env=env, wrap=wrap) as consumer,
        Producer(checked) as producer,
        producer.staged(count) as pages,
    ):
        source = Source(pages)
        peer = producer.connect(spec)
        written = itertools.count()

        def next_pages() -> list[int]:
            """The consumer's next ``count`` pages, round its buffer."""
            first = next(written) * count
            return [(first + i) % (count + SPARE_PAGES) for i in range(count)]

        targets = list(torch.empty(count, chunk_bytes, dtype=torch.uint8).unbind())
        push_once(producer, checked, consumer, spec, source, verify=True)
        steps: dict[str, Callable[[], tuple[float, float]]] = {
            "ours": lambda: push_once(producer, checked, consumer, spec, source),
            "ours_nochecksum": lambda: push_once(producer, unchecked, consumer, spec, source),
            # Runs after the pushes' pages came back: a chunk it overwrites stays cached under a
            # fresh key nobody asks for again, a page reserved ahead is written again by its push.
            "raw_nixl": lambda: raw_write_once(producer, peer, next_pages(), source),
            "memcpy": lambda: (0.0, _memcpy(pages, targets)),
        }
        samples: dict[str, list[float]] = {name: [] for name in METHODS}
        send_samples: dict[str, list[float]] = {name: [] for name in SENDERS}
        order = list(steps)
        for run in range(-WARMUP_RUNS, runs):
            # Each method takes its turn first: the first of a round finds the caches cold
            # after the memcpy's and the consumer's work.
            for name in order[run % len(order) :] + order[: run % len(order)]:
                gather_s, send_s = steps[name]()
                if run >= 0:
                    samples[name].append(gather_s + send_s)
                    if name in send_samples:
                        send_samples[name].append(send_s)
        pushes = 1 + 2 * (WARMUP_RUNS + runs)
        # A push into pages reserved ahead is told to land by its notification alone: the
        # last may still be on its way.
        stats = consumer.wait_until(
            lambda s: s["chunks_landed"] >= pushes * count, RELEASE_TIMEOUT_S, "every push landed"
        )
    if stats["chunks_landed"] != pushes * count or stats["integrity_failures"]:
        raise RuntimeError(f"consumer saw {stats}, expected {pushes * count} chunks landed")
    nbytes = chunk_bytes * count
    gbps = {name: nbytes / statistics.median(times) / 1e9 for name, times in samples.items()}
    send = {name: nbytes / statistics.median(t) / 1e9 for name, t in send_samples.items()}
    record = {
        "chunk_bytes": chunk_bytes,
        "chunks_per_request": count,
        "request_bytes": nbytes,
        **{f"{name}_gbps": value for name, value in gbps.items()},
        "ratio_vs_raw_nixl": gbps["ours"] / gbps["raw_nixl"],
        "ratio_nochecksum_vs_raw_nixl": gbps["ours_nochecksum"] / gbps["raw_nixl"],
        **{f"{name}_send_gbps": value for name, value in send.items()},
        "send_ratio_vs_raw_nixl": send["ours"] / send["raw_nixl"],
        "raw_vs_memcpy": gbps["raw_nixl"] / gbps["memcpy"],
        "samples_s": samples,
        "send_samples_s": send_samples,
        "consumer_unknown_notifications": stats["unknown_notifications"],
        "transport": peer.ucx_tls,
    }
    logger.info("%d x %d B: %s", count, chunk_bytes, {k: round(v, 2) for k, v in gbps.items()})
    return record


def run_benchmark(
    sizes: Sequence[int] = tuple(parse_sizes(DEFAULT_SIZES)),
    chunks_per_request: Sequence[int] = tuple(parse_sizes(DEFAULT_CHUNKS)),
    runs: int = 7,
    *,
    ucx_error_mode: str = "none",
    progress_thread: bool = False,
    ucx_tls: str | None = None,
    command: str | None = None,
    consumer_netns: str | None = None,
    consumer_host: str = "127.0.0.1",
) -> dict[str, Any]:
    """Measure every (size, chunks per request) and return the JSON document (see module doc)."""
    settings = {
        "ucx_error_handling_mode": ucx_error_mode,
        "nixl_progress_thread": progress_thread,
        "ucx_tls": ucx_tls,
    }
    inherited_tls = os.environ.get("UCX_TLS")  # what UCX uses when ucx_tls is None
    default = load_config(CONFIGS / "producer.yaml")
    records = [
        measure(size, count, runs, settings, consumer_netns, consumer_host)
        for size in sizes
        for count in chunks_per_request
    ]
    environment = run_environment(("torch", "nixl", "lmcache-pd"), command)
    return {
        **environment,
        "settings": {
            **settings,
            "ucx_tls_inherited": inherited_tls,
            "nixl_backends": default.nixl_backends,
            "integrity_checksums_default": default.integrity_checksums,
            "runs": runs,
            "warmup_runs": WARMUP_RUNS,
            "memcpy": "numpy.copyto, one thread",
            "ucx_tls_remote": default.ucx_tls_remote,
            "across_network_namespaces": consumer_netns is not None,
        },
        "records": records,
    }


def print_table(document: dict[str, Any], console: Console | None = None) -> None:
    """The medians as a rich table; "ours" runs with checksums, the default."""
    settings = document["settings"]
    table = Table(
        title=f"Transfer throughput, GB/s (medians of {settings['runs']} runs)",
        caption="ucx error mode {ucx_error_handling_mode}, progress thread "
        "{nixl_progress_thread}, UCX_TLS {ucx_tls}; checksums on by default".format(**settings),
    )
    for column in COLUMNS:
        table.add_column(column, justify="right")
    for record in document["records"]:
        size = record["chunk_bytes"]
        table.add_row(
            f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB",
            str(record["chunks_per_request"]),
            *(f"{record[f'{name}_gbps']:.2f}" for name in METHODS),
            f"{record['ratio_vs_raw_nixl']:.2f}",
            f"{record['raw_vs_memcpy']:.2f}",
        )
    (console or Console()).print(table)


app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0])


@app.command()
def main(
    sizes: Annotated[str | None, typer.Option(help=f"chunk sizes [{DEFAULT_SIZES}]")] = None,
    chunks_per_request: Annotated[
        str | None, typer.Option(help=f"chunks per request [{DEFAULT_CHUNKS}]")
    ] = None,
    runs: Annotated[int | None, typer.Option(min=1, help="timed runs per method [7]")] = None,
    output: Annotated[Path, typer.Option(help="where the JSON goes")] = DEFAULT_OUTPUT,
    ucx_error_mode: Annotated[Literal["none", "peer"], typer.Option()] = "none",
    progress_thread: Annotated[
        bool, typer.Option("--progress-thread/--no-progress-thread")
    ] = False,
    ucx_tls: Annotated[str | None, typer.Option(help="UCX_TLS for both sides [unset]")] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="defaults 64K,1M x 1,8 chunks, 3 runs")
    ] = False,
    across_netns: Annotated[
        bool,
        typer.Option("--netns", help="producer and consumer in two network namespaces (root)"),
    ] = False,
    consumer_netns: Annotated[str | None, typer.Option(hidden=True)] = None,
    consumer_host: Annotated[str, typer.Option(hidden=True)] = "127.0.0.1",
    command: Annotated[str | None, typer.Option(hidden=True)] = None,
) -> None:
    """Run the benchmark, print the table and write the JSON."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if across_netns:
        _rerun_across_namespaces(output if output != DEFAULT_OUTPUT else NETNS_OUTPUT)
        return
    default_sizes, default_chunks, default_runs = QUICK if quick else DEFAULTS
    document = run_benchmark(
        parse_sizes(sizes or default_sizes),
        parse_sizes(chunks_per_request or default_chunks),
        runs or default_runs,
        ucx_error_mode=ucx_error_mode,
        progress_thread=progress_thread,
        ucx_tls=ucx_tls,
        command=command,
        consumer_netns=consumer_netns,
        consumer_host=consumer_host,
    )
    print_table(document)
    write_json(output, document)
    logger.info("wrote %s", output)


def _rerun_across_namespaces(output: Path) -> None:
    """Make two namespaces, and run this benchmark again inside the first with its consumers
    in the second: every NIXL agent and socket of the producer is then in its namespace."""
    argv = [arg for arg in sys.argv[1:] if arg != "--netns"]
    argv = [a for i, a in enumerate(argv) if a != "--output" and argv[i - 1 : i] != ["--output"]]
    with netns.veth_pair("lmpd-bench") as pair:
        command = [
            *pair.left.wrap,
            sys.executable,
            str(Path(__file__).resolve()),
            *argv,
            "--output",
            str(output),
            "--consumer-netns",
            pair.right.netns,
            "--consumer-host",
            pair.right.address,
            "--command",
            " ".join([Path(sys.executable).name, *sys.argv]),
        ]
        subprocess.run(command, check=True)


if __name__ == "__main__":
    app()
