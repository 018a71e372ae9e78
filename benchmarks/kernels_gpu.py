"""The token-layout kernels on a GPU: Triton gather/scatter, bit-exact against the torch path,
and their GB/s against a device-to-device copy of the same bytes, timed in the same run.

Why: on a GPU the producer gathers every chunk out of vLLM's paged cache with the Triton kernel
(``kernels/triton_layout.py``) and the consumer scatters it back; the torch path is the reference
it must match bit for bit. Run by ``.venv/bin/python -m benchmarks.kernels --device cuda``, which
writes ``benchmarks/results/kernels_gpu.json`` naming the device. Per model shape and layout
(NHD, HND; block size 16, a chunk of a request's blocks filled in order):

- ``triton_gather_*`` / ``triton_scatter_*``: the Triton path, CUDA-event timed, medians;
- ``torch_gather_*`` / ``torch_scatter_*``: the torch path on the same CUDA tensors;
- ``d2h_pinned``: the chunk's copy from device to pinned host memory (the host staging path);

each with ``memcpy_gbps``, a ``copy_`` of the same bytes between two device buffers, timed
interleaved with it. Every record says whether the Triton result was bit-exact
(``bit_exact``); a mismatch fails the run before any timing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from benchmarks.common import interleaved_samples, throughput
from benchmarks.environment import run_environment
from lmcache_pd.kernels import KVLayout, TokenKVCache, TritonTokenKV, triton_available

logger = logging.getLogger(__name__)

WARMUP_RUNS = 3


def _cuda_seconds(step: Callable[[], None]) -> float:
    """Seconds of one ``step`` on the current stream, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _record(op: str, model: str, layout: str, nbytes: int, samples, exact: bool) -> dict[str, Any]:
    rates = throughput(nbytes, samples)
    logger.info(
        "%s %s %s: %.1f GB/s, device copy %.1f GB/s",
        model,
        op,
        layout,
        rates["gbps"],
        rates["memcpy_gbps"],
    )
    return {"op": op, "model": model, "layout": layout, **rates, "bit_exact": exact}


def measure_layout(
    shape: Any,
    layout: KVLayout,
    *,
    block_size: int,
    chunk_tokens: int,
    cache_bytes: int,
    runs: int,
    make_layers: Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]],
    make_slots: Callable[[int, int], torch.Tensor],
) -> list[dict[str, Any]]:
    """Triton vs torch on one model shape and layout (see module doc)."""
    itemsize = torch.empty(0, dtype=shape.torch_dtype).element_size()
    layer_bytes = 2 * block_size * shape.num_kv_heads * shape.head_size * itemsize
    blocks = -(-chunk_tokens // block_size)
    num_blocks = max(4 * blocks, cache_bytes // (shape.num_layers * layer_bytes))
    host_source, host_target = make_layers(shape, layout, num_blocks)
    source = [layer.cuda() for layer in host_source]
    target = [layer.cuda() for layer in host_target]
    del host_source, host_target
    slots = make_slots(num_blocks, chunk_tokens).cuda()
    reference, triton_cache = TokenKVCache(source, layout), TritonTokenKV(source, layout)
    torch_target, triton_target = TokenKVCache(target, layout), TritonTokenKV(target, layout)
    nbytes = reference.chunk_nbytes(chunk_tokens)
    expected = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    chunk = torch.empty_like(expected)

    reference.gather(slots, expected)
    triton_cache.gather(slots, chunk)
    triton_target.scatter(chunk, slots)
    landed = torch.empty_like(expected)
    torch_target.gather(slots, landed)
    torch.cuda.synchronize()
    exact = torch.equal(chunk, expected) and torch.equal(landed, expected)
    if not exact:
        raise RuntimeError(f"{shape.name} {layout.value}: Triton is not bit-exact with torch")

    copy_source = torch.empty_like(expected)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device_copy = lambda: copy_source.copy_(expected)  # noqa: E731
    name = layout.value.lower()
    steps = {
        f"triton_gather_{name}": lambda: triton_cache.gather(slots, chunk),
        f"triton_scatter_{name}": lambda: triton_target.scatter(chunk, slots),
        f"torch_gather_{name}": lambda: reference.gather(slots, chunk),
        f"torch_scatter_{name}": lambda: torch_target.scatter(chunk, slots),
        "d2h_pinned": lambda: pinned.copy_(chunk, non_blocking=True),
    }
    records = []
    for op, step in steps.items():
        samples = interleaved_samples(
            step, device_copy, runs, warmup_runs=WARMUP_RUNS, seconds=_cuda_seconds
        )
        records.append(
            _record(op, shape.name, layout.value, nbytes, samples, exact)
            | {"dtype": shape.dtype, "regime": "hot", "block_size": block_size}
        )
    return records


def run_gpu_benchmark(
    shapes: Sequence[Any],
    runs: int,
    *,
    block_size: int,
    chunk_tokens: int,
    cache_mib: int,
    make_layers: Callable[..., tuple[list[torch.Tensor], list[torch.Tensor]]],
    make_slots: Callable[[int, int], torch.Tensor],
) -> dict[str, Any]:
    """Every op for every shape and layout; the JSON document, naming the device."""
    if not triton_available():
        raise RuntimeError("--device cuda needs a CUDA device and Triton (a CUDA build of torch)")
    records = []
    for shape in shapes:
        for layout in KVLayout:
            records += measure_layout(
                shape,
                layout,
                block_size=block_size,
                chunk_tokens=chunk_tokens,
                cache_bytes=cache_mib << 20,
                runs=runs,
                make_layers=make_layers,
                make_slots=make_slots,
            )
    properties = torch.cuda.get_device_properties(0)
    return {
        **run_environment(("torch", "triton"), None),
        "device": {
            "name": properties.name,
            "memory_bytes": properties.total_memory,
            "capability": f"{properties.major}.{properties.minor}",
            "cuda": torch.version.cuda,
        },
        "settings": {
            "runs": runs,
            "warmup_runs": WARMUP_RUNS,
            "block_size": block_size,
            "chunk_tokens": chunk_tokens,
            "cache_mib": cache_mib,
            "memcpy": "torch copy_ between two device buffers, same bytes, interleaved",
            "timing": "CUDA events on the current stream, medians",
        },
        "records": records,
    }
