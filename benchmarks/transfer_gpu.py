"""A prompt's KV from a producer's GPU cache to a consumer's, on one GPU machine, through the
connector's own worker halves and real NIXL, against a pinned host copy of the same bytes.

Why (issue 34): this is the path every GPU deployment runs: the producer gathers each chunk out
of vLLM's cache (Triton), stages it (pinned host memory, or GPU memory with ``buffer_device:
cuda``), NIXL writes it into the consumer process's receive buffer (which that process owns
and registered), and the consumer worker scatters it into vLLM's blocks.

Per buffer placement and prompt length (an 8B model's geometry in bf16, vLLM 0.32's LBNHC
caches, 256-token chunks): seconds from the producer's save (the whole prompt computed in one
step) until the consumer reports the load received, each run a new request; the same run's
ceiling is one pinned device-to-host copy of the same bytes (``pinned_copy_gbps``), interleaved.
Every run is checked bit for bit (the consumer's blocks against the producer's, token by token
through both block tables) before it counts. Checksums follow the default (on for host
buffers, off on the GPU, where the config refuses them).

Reproduce on a GPU machine (JSON in ``benchmarks/results/transfer_gpu.json``)::

    python -m benchmarks.transfer_gpu --runs 5
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from benchmarks.common import LOG_FORMAT, free_ports, write_json
from benchmarks.environment import run_environment
from benchmarks.kernels import GPU_BLOCK_SIZE, MODELS
from benchmarks.kernels_gpu import vllm_cache
from lmcache_pd.config import load_config
from lmcache_pd.connector.consumer_worker import ConsumerWorker
from lmcache_pd.connector.counters import StatsRecorder
from lmcache_pd.connector.metadata import LoadRequest, PDConnectorMetadata, SaveRequest
from lmcache_pd.connector.worker import CacheFacts, ProducerWorker
from lmcache_pd.kernels import KVLayout, TokenKVCache
from lmcache_pd.kernels.paged_kv import vllm_nhd_views
from lmcache_pd.kernels.token_layout import slot_mapping
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.protocol import DisaggSpec

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "transfer_gpu.json"
CHUNK = 256
LOAD_DEADLINE_S = 60.0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _same_tokens(
    source: dict[str, torch.Tensor],
    src: list[int],
    target: dict[str, torch.Tensor],
    dst: list[int],
    tokens: int,
) -> bool:
    """Whether the consumer's blocks hold, bit for bit, the producer's KV of every token."""
    out = []
    for cache, table in ((source, src), (target, dst)):
        kv = TokenKVCache(vllm_nhd_views(list(cache.values())), KVLayout.NHD)
        chunk = torch.empty(kv.chunk_nbytes(tokens), dtype=torch.uint8, device=kv.device)
        kv.gather(slot_mapping(table, 0, tokens, GPU_BLOCK_SIZE).to(kv.device), chunk)
        out.append(chunk)
    return torch.equal(*out)


def run_placement(
    buffer_device: str, prompts: list[int], runs: int, device: str = "cuda"
) -> list[dict[str, Any]]:
    """Every prompt length, ``runs`` times each, through one producer/consumer pair (caches on
    ``device``: "cpu" runs the same code through the torch path, to check it without a GPU)."""
    shape = MODELS["big"]
    most = max(prompts)
    blocks = -(-most // GPU_BLOCK_SIZE)
    source = vllm_cache(shape, "LBNHC", 2 * blocks + 1, GPU_BLOCK_SIZE, device)
    target = vllm_cache(shape, "LBNHC", 2 * blocks + 1, GPU_BLOCK_SIZE, device)
    for layer in target.values():
        layer.zero_()
    keyer = ChunkKeyer(
        model_name="bench", world_size=1, worker_id=0, kv_dtype="bfloat16", chunk_size=CHUNK
    )
    init_port, alloc_port = free_ports(2)
    page = 2 * shape.num_layers * shape.num_kv_heads * shape.head_size * 2 * CHUNK
    common = {
        "chunk_size": CHUNK,
        "buffer_size_bytes": 2 * page * -(-most // CHUNK),
        "init_port": init_port,
        "alloc_port": alloc_port,
        "buffer_device": buffer_device,
        "integrity_checksums": buffer_device == "cpu",
        "load_timeout_s": LOAD_DEADLINE_S,
    }
    facts = CacheFacts(block_size=GPU_BLOCK_SIZE, physical_order="NHD", packed_blocks=False)
    consumer = ConsumerWorker(
        load_config(None, environ={}, kv_role="kv_consumer", **common),
        keyer,
        target,
        StatsRecorder("c"),
        facts=facts,
    )
    producer = ProducerWorker(
        load_config(None, environ={}, kv_role="kv_producer", **common),
        keyer,
        source,
        StatsRecorder("p"),
        facts=facts,
    )
    src = list(range(0, 2 * blocks, 2))
    dst = list(range(1, 2 * blocks + 1, 2))
    records = []
    try:
        for tokens in prompts:
            nbytes = page // CHUNK * tokens
            device_bytes = torch.empty(nbytes, dtype=torch.uint8, device=device)
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
            seconds, ceiling, model_thread = [], [], []
            for run in range(-1, runs):
                req = f"r{tokens}-{run}"
                prompt = [(7 * i + run) % 30000 for i in range(tokens)]
                spec = DisaggSpec(req, "127.0.0.1", init_port, alloc_port)
                _sync(device)
                began = time.perf_counter()
                producer.wait_for_save(
                    PDConnectorMetadata(saves=[SaveRequest(req, spec, prompt, src, tokens)])
                )
                saved = time.perf_counter()
                load = LoadRequest(req, req, prompt, dst, 0)
                consumer.start_load_kv(PDConnectorMetadata(loads=[load]))
                deadline = time.monotonic() + LOAD_DEADLINE_S
                received: set[str] = set()
                # The consumer's model thread: its time in the connector's calls, per step.
                steps: list[float] = [time.perf_counter() - saved]
                while req not in received and time.monotonic() < deadline:
                    step = time.perf_counter()
                    got, failed = consumer.finished_loads()
                    steps.append(time.perf_counter() - step)
                    if failed:
                        raise RuntimeError(f"{buffer_device} {tokens}: load failed")
                    received |= got
                _sync(device)
                elapsed = time.perf_counter() - began
                if req not in received:
                    raise RuntimeError(f"{buffer_device} {tokens}: not loaded in time")
                if not _same_tokens(source, src, target, dst, tokens):
                    raise RuntimeError(f"{buffer_device} {tokens}: KV differs after the load")
                producer.wait_for_save(PDConnectorMetadata(finished={req}))
                start = time.perf_counter()
                pinned.copy_(device_bytes)
                copy_s = time.perf_counter() - start
                if run >= 0:
                    seconds.append(elapsed)
                    ceiling.append(copy_s)
                    model_thread.append((saved - began, max(steps)))
                for layer in target.values():
                    layer.zero_()
            median, copy_median = statistics.median(seconds), statistics.median(ceiling)
            record = {
                "buffer_device": buffer_device,
                "tokens": tokens,
                "bytes": nbytes,
                "seconds": median,
                "gbps": nbytes / median / 1e9,
                "pinned_copy_gbps": nbytes / copy_median / 1e9,
                "ratio_vs_pinned_copy": copy_median / median,
                "bit_exact": True,
                # vLLM's model thread on each side: the producer's save step (gathers queued),
                # and the consumer's longest step in the connector while loading.
                "producer_save_step_s": statistics.median(m[0] for m in model_thread),
                "consumer_longest_step_s": statistics.median(m[1] for m in model_thread),
                "samples_s": {
                    "transfer": seconds,
                    "pinned_copy": ceiling,
                    "model_thread": model_thread,
                },
            }
            records.append(record)
            logger.info(
                "%s buffer, %d tokens (%.0f MiB): %.1f ms, %.1f GB/s; pinned copy %.1f GB/s; "
                "model thread: save step %.2f ms, longest load step %.2f ms",
                buffer_device,
                tokens,
                nbytes / (1 << 20),
                median * 1e3,
                record["gbps"],
                record["pinned_copy_gbps"],
                record["producer_save_step_s"] * 1e3,
                record["consumer_longest_step_s"] * 1e3,
            )
    finally:
        producer.close()
        consumer.close()
    return records


app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0])


@app.command()
def main(
    runs: Annotated[int, typer.Option(min=1, help="timed runs per case (medians)")] = 5,
    prompts: Annotated[str, typer.Option(help="comma-separated prompt lengths")] = "150,8192",
    output: Annotated[Path, typer.Option(help="where the JSON goes")] = DEFAULT_OUTPUT,
) -> None:
    """Both buffer placements, every prompt length; the JSON."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if not torch.cuda.is_available():
        raise typer.BadParameter("needs a CUDA device")
    lengths = [int(n) for n in prompts.split(",") if n.strip()]
    records = [r for device in ("cpu", "cuda") for r in run_placement(device, lengths, runs)]
    properties = torch.cuda.get_device_properties(0)
    write_json(
        output,
        {
            **run_environment(("torch", "triton", "nixl"), None),
            "device": {"name": properties.name, "cuda": torch.version.cuda},
            "settings": {"runs": runs, "prompts": lengths, "chunk_tokens": CHUNK},
            "records": records,
        },
    )
    logger.info("wrote %s", output)


if __name__ == "__main__":
    app()
