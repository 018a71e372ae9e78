"""The Triton gather/scatter on a GPU against a device copy of the same bytes, in the same run,
on the caches vLLM 0.32 hands out; bit-exact against the torch path before any timing.

Why: on a GPU the producer gathers every chunk out of vLLM's paged cache with the Triton kernel
(``kernels/triton_layout.py``) and the consumer scatters it back. Goal (issue 34): both at
>= 0.8 of a device-to-device copy for 1 MiB and 32 MiB chunks of an 8B model (bf16), with a
cold L2 and no launch overhead counted.

What is measured, per layout and chunk size:

- caches as vLLM 0.32 makes them: one buffer, each layer a ``(blocks, heads, block size,
  2 * head size)`` view whose strides follow the resolved layout (``LBNHC``: FlashAttention and
  Triton attention on Hopper; ``LBHNC``: FlashInfer on Blackwell and vLLM's NixlConnector;
  ``BLNHC``: block-outer), read through the connector's own ``paged_kv.recognise``;
- cold L2: each timed sample copies ``--rotation-mib`` of distinct chunks (distinct random
  blocks, distinct chunk buffers), several times the L2, so no chunk is still cached when its
  turn comes;
- no launch overhead: the sample's launches are one CUDA graph, replayed and timed by CUDA
  events; seconds per chunk = the replay / the chunks in it;
- the ceilings, each the same rotation of the same bytes in a graph of its own: a device copy
  (``copy_`` between two device buffers), and pinned host copies both ways;
- the kernel's launch shape: the default (``TritonTokenKV.tile``/``warps``) and a sweep
  of tokens per program and warps, so the default can be checked against the best;
- ``triton_scatter_load``: every chunk of the sample in one launch, as a load of that many
  chunks of one request is scattered (``CudaTokenKV.scatter_chunks``);
- correctness first: every chunk of the rotation gathered by Triton equals the torch path's
  gather; a scatter into a poisoned cache leaves it equal, bit for bit, to the torch path's
  scatter into the same poison (every slot not written keeps its poison).

Samples interleave kernel and ceiling replay by replay; records give medians and the samples.
Reproduce on a GPU machine (JSON in ``benchmarks/results/kernels_gpu.json``, naming the device)::

    python -m benchmarks.kernels --device cuda --runs 30
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from benchmarks.common import interleaved_samples, throughput
from benchmarks.environment import run_environment
from lmcache_pd.kernels import KVLayout, TokenKVCache, TritonTokenKV, triton_available
from lmcache_pd.kernels.paged_kv import vllm_nhd_views
from lmcache_pd.kernels.token_layout import slot_mapping
from lmcache_pd.kernels.triton_layout import PlanRow

logger = logging.getLogger(__name__)

WARMUP_RUNS = 3
# vLLM 0.32's layouts (vllm/v1/kv_cache_layout.py) as the physical order of one layer's
# (blocks, heads, tokens, K|V) view: the permutation of it that is contiguous.
LAYOUTS = {"LBNHC": (0, 2, 1, 3), "LBHNC": (0, 1, 2, 3), "BLNHC": (0, 2, 1, 3)}
BLOCK_OUTER = {"BLNHC"}
CHUNK_MIB = (1, 32)
# (tokens per program, warps) tried beside the default
SWEEP = [(tile, warps) for tile in (1, 2, 4) for warps in (1, 2, 4)]


def vllm_cache(
    shape: Any, layout: str, num_blocks: int, block_size: int, device: str = "cuda"
) -> dict[str, torch.Tensor]:
    """A random cache on the GPU laid out as vLLM 0.32 allocates it: one buffer, each layer a
    4-D ``(blocks, heads, block size, 2 * head size)`` view in ``layout``'s order."""
    heads, head, layers = shape.num_kv_heads, shape.head_size, shape.num_layers
    logical = (num_blocks, heads, block_size, 2 * head)
    order = LAYOUTS[layout]
    page = tuple(logical[axis] for axis in order)
    outer = (num_blocks, layers) if layout in BLOCK_OUTER else (layers, num_blocks)
    dtype = shape.torch_dtype
    bits = torch.randint(-(2**15), 2**15, (*outer, *page[1:]), dtype=torch.int16, device=device)
    buffer = bits.view(torch.uint8).view(dtype).view(*outer, *page[1:])
    inverse = [order.index(axis) for axis in range(4)]
    return {
        f"layer.{i}": (buffer[:, i] if layout in BLOCK_OUTER else buffer[i]).permute(*inverse)
        for i in range(layers)
    }


def chunk_tables(
    num_blocks: int, block_size: int, tokens: int, count: int, seed: int
) -> list[list[int]]:
    """``count`` chunks of a request each (its tokens from a block's start), on distinct random
    blocks: their block tables."""
    per_chunk = -(-tokens // block_size)
    if per_chunk * count > num_blocks:
        raise ValueError(f"{count} chunks of {per_chunk} blocks need more than {num_blocks}")
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    return [blocks[index * per_chunk : (index + 1) * per_chunk] for index in range(count)]


def _cuda_seconds(step: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _graph(steps: Callable[[], None]) -> Callable[[], None]:
    """``steps`` captured once as a CUDA graph (after a warm-up run); returns its replay."""
    steps()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps()
    return graph.replay


def _check(
    views: list[torch.Tensor], tables: list[list[int]], tokens: int, chunks: list[torch.Tensor]
) -> list[torch.Tensor]:
    """Triton's gather equals the torch path's for every chunk; a scatter into poison equals
    the torch path's scatter into the same poison, every byte of the cache. Returns the block
    tables on the device."""
    block_size = views[0].shape[2]
    device = views[0].device
    triton, reference = TritonTokenKV(views, KVLayout.NHD), TokenKVCache(views, KVLayout.NHD)
    on_device = [torch.tensor(table, dtype=torch.int64, device=device) for table in tables]
    slots = [slot_mapping(table, 0, tokens, block_size).to(device) for table in tables]
    for index, chunk in enumerate(chunks):
        triton.gather(on_device[index], 0, tokens, chunk)
        expected = torch.empty_like(chunk)
        reference.gather(slots[index], expected)
        if not torch.equal(chunk, expected):
            raise RuntimeError(f"Triton gather of chunk {index} is not the torch path's")
    storage = views[0].untyped_storage()
    poisoned = [torch.full((storage.nbytes(),), 0x7F, dtype=torch.uint8, device=device)]
    poisoned.append(poisoned[0].clone())
    caches = [
        [
            torch.empty(0, dtype=view.dtype, device=device).set_(
                target.untyped_storage(), view.storage_offset(), view.shape, view.stride()
            )
            for view in views
        ]
        for target in poisoned
    ]
    TritonTokenKV(caches[0], KVLayout.NHD).scatter(chunks[0], on_device[0], 0, tokens)
    TokenKVCache(caches[1], KVLayout.NHD).scatter(chunks[0], slots[0])
    # a load that starts inside the chunk writes only its later tokens
    half = tokens // 2
    later = on_device[1][half // block_size :]
    TritonTokenKV(caches[0], KVLayout.NHD).scatter(
        chunks[1], later, half % block_size, tokens - half, skip=half
    )
    TokenKVCache(caches[1], KVLayout.NHD).scatter(chunks[1], slots[1][half:], skip=half)
    if not torch.equal(poisoned[0], poisoned[1]):
        raise RuntimeError("Triton scatter wrote other bytes than the torch path's")
    if torch.equal(poisoned[0], torch.full_like(poisoned[0], 0x7F)):
        raise RuntimeError("the scatter wrote nothing")
    return on_device


def measure(
    shape: Any,
    layout: str,
    chunk_mib: int,
    *,
    block_size: int,
    rotation_mib: int,
    runs: int,
    sweep: Sequence[tuple[int, int]],
) -> list[dict[str, Any]]:
    """Every op of one layout and chunk size (see the module's doc)."""
    itemsize = torch.empty(0, dtype=shape.torch_dtype).element_size()
    token_bytes = 2 * shape.num_layers * shape.num_kv_heads * shape.head_size * itemsize
    tokens = max(1, (chunk_mib << 20) // token_bytes)
    nbytes = tokens * token_bytes
    count = max(2, (rotation_mib << 20) // nbytes)
    num_blocks = max(2 * count * -(-tokens // block_size), 64)
    cache = vllm_cache(shape, layout, num_blocks, block_size)
    views = vllm_nhd_views(list(cache.values()))
    tables = chunk_tables(num_blocks, block_size, tokens, count, seed=chunk_mib)
    chunks = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(count)]
    blocks = _check(views, tables, tokens, chunks)

    copies = [torch.empty_like(chunk) for chunk in chunks]
    pinned = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    ceilings = {
        "device_copy": _graph(lambda: [c.copy_(k) for c, k in zip(copies, chunks, strict=True)]),
        "d2h_pinned": _graph(
            lambda: [p.copy_(k, non_blocking=True) for p, k in zip(pinned, chunks, strict=True)]
        ),
        "h2d_pinned": _graph(
            lambda: [k.copy_(p, non_blocking=True) for p, k in zip(pinned, chunks, strict=True)]
        ),
    }
    kernel = TritonTokenKV(views, KVLayout.NHD)
    shapes: list[tuple[int, int] | None] = [None, *sweep]
    records = []
    common = {"model": shape.name, "layout": layout, "dtype": shape.dtype, "tokens": tokens}
    common |= {"chunks_per_sample": count, "block_size": block_size}

    # Plans made once, outside the graphs (a plan's table crosses from the host).
    plans = [kernel.plan([chunk], [PlanRow(0, 0, tokens, 0)]) for chunk in chunks]
    per_chunk = -(-tokens // block_size)
    rows = [PlanRow(i * per_chunk, 0, tokens, 0) for i in range(count)]
    load_plan, load_table = kernel.plan(chunks, rows), torch.cat(blocks)

    def rotation(op: str, launch: dict[str, int]) -> Callable[[], None]:
        def copies() -> None:
            for table, plan in zip(blocks, plans, strict=True):
                kernel.run(plan, table, op == "scatter", **launch)

        def load() -> None:
            kernel.run(load_plan, load_table, True, **launch)

        return load if op == "scatter_load" else copies

    for op in ("gather", "scatter", "scatter_load"):
        for launch_shape in shapes if op != "scatter_load" else [None]:
            tile, warps = launch_shape or (kernel.tile, kernel.warps)
            replay = _graph(rotation(op, {"tile": tile, "num_warps": warps}))
            samples = interleaved_samples(
                replay,
                ceilings["device_copy"],
                runs,
                warmup_runs=WARMUP_RUNS,
                seconds=_cuda_seconds,
            )
            per_chunk = tuple([t / count for t in times] for times in samples)
            record = throughput(nbytes, per_chunk) | common
            record |= {"op": f"triton_{op}", "tile": tile, "warps": warps}
            record["default_launch"] = launch_shape is None
            records.append(record)
            if launch_shape is None:
                logger.info(
                    "%s %s %d MiB %s: %.0f GB/s, device copy %.0f GB/s (%.2f), tile %d x %d warps",
                    shape.name,
                    layout,
                    chunk_mib,
                    op,
                    record["gbps"],
                    record["memcpy_gbps"],
                    record["ratio_vs_memcpy"],
                    tile,
                    warps,
                )
    for name, replay in ceilings.items():
        if name == "device_copy":
            continue
        samples = interleaved_samples(
            replay, ceilings["device_copy"], runs, warmup_runs=WARMUP_RUNS, seconds=_cuda_seconds
        )
        per_chunk = tuple([t / count for t in times] for times in samples)
        records.append(throughput(nbytes, per_chunk) | common | {"op": name})
    return records


def run_gpu_benchmark(
    shapes: Sequence[Any], runs: int, *, block_size: int, rotation_mib: int, sweep: bool
) -> dict[str, Any]:
    """Every op for every shape, layout and chunk size; the JSON document, naming the device."""
    if not triton_available():
        raise RuntimeError("--device cuda needs a CUDA device and Triton (a CUDA build of torch)")
    records = []
    for shape in shapes:
        for layout in LAYOUTS:
            for chunk_mib in CHUNK_MIB:
                records += measure(
                    shape,
                    layout,
                    chunk_mib,
                    block_size=block_size,
                    rotation_mib=rotation_mib,
                    runs=runs,
                    sweep=SWEEP if sweep else [],
                )
                torch.cuda.empty_cache()
    properties = torch.cuda.get_device_properties(0)
    return {
        **run_environment(("torch", "triton"), None),
        "device": {
            "name": properties.name,
            "memory_bytes": properties.total_memory,
            "multiprocessors": properties.multi_processor_count,
            "l2_bytes": getattr(properties, "L2_cache_size", None),
            "capability": f"{properties.major}.{properties.minor}",
            "cuda": torch.version.cuda,
        },
        "settings": {
            "runs": runs,
            "warmup_runs": WARMUP_RUNS,
            "block_size": block_size,
            "chunk_mib": list(CHUNK_MIB),
            "rotation_mib": rotation_mib,
            "memcpy": "device copy_ of the same chunks between two device buffers, one CUDA "
            "graph per sample, interleaved",
            "timing": "CUDA graph replays timed by CUDA events, per chunk, medians",
        },
        "records": records,
    }


def print_gpu_table(document: dict[str, Any], console: Console | None = None) -> None:
    """The default launch's medians and the best of the sweep, against the device copy."""
    table = Table(
        title=f"Triton KV copies vs a device copy on {document['device']['name']}, GB/s "
        f"(medians of {document['settings']['runs']}, cold L2, CUDA graphs)"
    )
    for column in ("layout", "MiB", "op", "tile x warps", "GB/s", "copy GB/s", "ratio", "best"):
        table.add_column(column, justify="left" if column in ("layout", "op") else "right")
    records = document["records"]
    for record in records:
        if not record.get("default_launch", True):
            continue
        best = max(
            (
                r["ratio_vs_memcpy"]
                for r in records
                if (r["layout"], r["bytes"], r["op"])
                == (record["layout"], record["bytes"], record["op"])
            ),
            default=record["ratio_vs_memcpy"],
        )
        launch = f"{record['tile']} x {record['warps']}" if "tile" in record else "-"
        table.add_row(
            record["layout"],
            f"{record['bytes'] / (1 << 20):.1f}",
            record["op"],
            launch,
            f"{record['gbps']:.0f}",
            f"{record['memcpy_gbps']:.0f}",
            f"{record['ratio_vs_memcpy']:.2f}",
            f"{best:.2f}",
        )
    (console or Console()).print(table)
