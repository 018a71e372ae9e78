"""How long a KV load holds up the model's stream on a GPU, against the same step without one.

Why (issue 34, point 3): decode loads a prompt's KV while other requests decode. If the model's
stream waits for the load's copies, every running decode stalls for them: an 8k-token prompt
of an 8B model in bf16 is 1 GiB, ~20 ms from host memory. An asynchronous load is now reported
received only once its copy is done, and the model's stream does not wait for it
(``kernels/cuda_kv.py``); a synchronous load (read by the coming forward pass) still waits.

What runs, per sample, interleaved: a stand-in for a forward pass on the model's stream (bf16
matrix products, ``--step-ms`` long), timed by CUDA events from before the load is issued to
after the step; alone (the baseline) and right after the connector's own
``CudaTokenKV.scatter_chunks`` of every chunk of a ``--tokens`` prompt (one call, as the consumer
worker loads) (an 8B model's geometry, vLLM 0.32's LBNHC cache), from
a receive buffer in pinned host memory or on the device, with the model's stream waiting for
the copies (``model_waits``, as every load did before) or not. Recorded: the step's added time
(median over the baseline's median), the host time to issue the scatters (the model thread's
own cost), and the time until the load's copy is done.

Reproduce on a GPU machine (JSON in ``benchmarks/results/load_stall_gpu.json``)::

    python -m benchmarks.load_stall_gpu --runs 15
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Annotated, Any

import torch
import typer

from benchmarks.common import LOG_FORMAT, write_json
from benchmarks.environment import run_environment
from benchmarks.kernels import GPU_BLOCK_SIZE, MODELS
from benchmarks.kernels_gpu import vllm_cache
from lmcache_pd.kernels.chunk_bytes import ChunkBytes
from lmcache_pd.kernels.cuda_kv import CudaTokenKV
from lmcache_pd.kernels.paged_kv import vllm_nhd_views

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "load_stall_gpu.json"
CHUNK_TOKENS = 256
MATRIX = 8192


def _model_step(step_ms: float) -> Any:
    """Matrix products on the current stream lasting about ``step_ms`` (measured here)."""
    x = torch.randn(MATRIX, MATRIX, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(x)

    def products(count: int) -> None:
        for _ in range(count):
            torch.matmul(x, x, out=out)

    products(3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    products(10)
    end.record()
    end.synchronize()
    count = max(1, round(step_ms / (start.elapsed_time(end) / 10)))
    return lambda: products(count)


def run(tokens: int, runs: int, step_ms: float) -> dict[str, Any]:
    """Every placement and wait policy, interleaved with the baseline; the JSON document."""
    shape = MODELS["big"]
    blocks = -(-tokens // GPU_BLOCK_SIZE)
    cache = vllm_cache(shape, "LBNHC", 2 * blocks, GPU_BLOCK_SIZE)
    kv = CudaTokenKV(vllm_nhd_views(list(cache.values())), GPU_BLOCK_SIZE)
    block_ids = list(range(1, 2 * blocks, 2))  # every other block: a scattered table
    bounds = [(s, min(s + CHUNK_TOKENS, tokens)) for s in range(0, tokens, CHUNK_TOKENS)]
    sizes = [kv.chunk_nbytes(end - start) for start, end in bounds]
    buffers = {
        "pinned_host": torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=True),
        "device": torch.empty(sum(sizes), dtype=torch.uint8, device="cuda"),
    }
    step = _model_step(step_ms)
    model = torch.cuda.current_stream()

    def sample(buffer: str | None, model_waits: bool) -> tuple[float, float, float]:
        """(step seconds from before the load's issue, host seconds issuing it, seconds until
        its copy is done)."""
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(model)
        began = time.perf_counter()
        copy = None
        if buffer is not None:
            chunks = [
                ChunkBytes(data, first, last)
                for (first, last), data in zip(bounds, buffers[buffer].split(sizes), strict=True)
            ]
            copy, _ = kv.scatter_chunks(chunks, block_ids, 0, model_waits=model_waits)
        issued = time.perf_counter() - began
        step()
        end.record(model)
        if copy is not None:
            copy.wait(time.monotonic() + 30)
        loaded = time.perf_counter() - began
        end.synchronize()
        return start.elapsed_time(end) / 1e3, issued, loaded

    cases = [(None, False)] + [(b, w) for b in buffers for w in (True, False)]
    samples: dict[tuple[str | None, bool], list[tuple[float, float, float]]] = {
        case: [] for case in cases
    }
    for run_index in range(-2, runs):
        for case in cases:
            result = sample(*case)
            if run_index >= 0:
                samples[case].append(result)
    baseline = statistics.median(s[0] for s in samples[(None, False)])
    records = []
    for (buffer, model_waits), values in samples.items():
        if buffer is None:
            continue
        step_s = statistics.median(v[0] for v in values)
        record = {
            "buffer": buffer,
            "model_waits": model_waits,
            "tokens": tokens,
            "load_bytes": sum(sizes),
            "step_s": step_s,
            "baseline_step_s": baseline,
            "added_s": step_s - baseline,
            "host_issue_s": statistics.median(v[1] for v in values),
            "load_done_s": statistics.median(v[2] for v in values),
            "samples": {"step_s": [v[0] for v in values], "baseline_step_s": []},
        }
        record["samples"]["baseline_step_s"] = [v[0] for v in samples[(None, False)]]
        records.append(record)
        logger.info(
            "%s, model waits %s: step +%.2f ms (baseline %.2f ms), issue %.2f ms, load %.1f ms",
            buffer,
            model_waits,
            record["added_s"] * 1e3,
            baseline * 1e3,
            record["host_issue_s"] * 1e3,
            record["load_done_s"] * 1e3,
        )
    properties = torch.cuda.get_device_properties(0)
    return {
        **run_environment(("torch", "triton"), None),
        "device": {"name": properties.name, "cuda": torch.version.cuda},
        "settings": {"runs": runs, "tokens": tokens, "step_ms": step_ms, "model": "big"},
        "records": records,
    }


app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0])


@app.command()
def main(
    tokens: Annotated[int, typer.Option(min=1, help="prompt tokens loaded")] = 8192,
    runs: Annotated[int, typer.Option(min=3, help="timed samples per case (medians)")] = 15,
    step_ms: Annotated[float, typer.Option(help="the stand-in forward pass's length")] = 10.0,
    output: Annotated[Path, typer.Option(help="where the JSON goes")] = DEFAULT_OUTPUT,
) -> None:
    """Run the cases, log the medians and write the JSON."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    if not torch.cuda.is_available():
        raise typer.BadParameter("needs a CUDA device")
    write_json(output, run(tokens, runs, step_ms))
    logger.info("wrote %s", output)


if __name__ == "__main__":
    app()
