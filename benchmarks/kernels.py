"""Gather/scatter throughput of the KV-cache kernels against a memcpy of the same bytes.

Why: the producer copies every prompt chunk out of vLLM's paged cache before NIXL sends it, and
the consumer copies it back in; those copies should cost no more than memory allows. The ceiling
is a single-thread ``numpy.copyto`` (libc memcpy) of the same number of bytes between two
contiguous buffers, timed in the same run, interleaved run by run with the kernel, because this
machine's speed drifts ~2x between runs (DESIGN.md): compare ratios, not GB/s across runs.

For each model shape, a chunk of ``--chunk-tokens`` tokens (whole blocks, at random non-adjacent
block ids of a cache of ``--cache-mib`` MiB, all layers in one buffer as vLLM allocates them):

- ``cpu_gather`` / ``cpu_scatter``: ``CpuKVCache.gather``/``scatter``, the CPU layout's whole
  blocks (``CpuKVCache`` built once, as a connector would at start-up);
- ``cpu_gather_fn``: the free function ``gather_blocks``, which checks the layers on every call;
- ``cpu_gather_hashed`` / ``cpu_scatter_hashed``: the same copies taking the chunk's XXH3-64 in
  the same pass (``hashed=True``), as the connector runs them with integrity on (the default);

each in two regimes (the ``regime`` of a record):

- ``hot``: the same chunk, block ids and buffer on every call, one call per sample (``--runs``
  times 25 samples): everything stays in the CPU's caches, and so does the memcpy's pair of
  buffers;
- ``streaming``: one call per chunk over ``--stream-mib`` MiB of distinct chunks (distinct block
  ids, each gathered into its own staging page and scattered back from it), as a long prompt's
  save or a busy consumer's loads run; the memcpy copies as many distinct buffer pairs of the
  same size, and a sample is one pass, divided by the number of chunks.
- ``token_gather_{nhd,hnd}`` / ``token_scatter_{nhd,hnd}``: the torch token-level path for GPU
  layouts (``TokenKVCache``, block size 16 as vLLM's GPU default, a request's blocks filled in
  order), run here on CPU tensors; ``--device cuda`` measures the Triton path on a GPU instead
  (``kernels_gpu.py``, JSON in ``benchmarks/results/kernels_gpu.json``).

Every kernel's bytes are checked against a block-by-block reference before timing. Same ids and
buffers every run, so kernel and memcpy see equally warm caches. torch runs on one thread by
default (``--torch-threads``), so that one core is compared with one core: with two threads on
this 2-core machine, torch's OpenMP workers spin-wait on each other whenever another process
holds a core, and an index_select then ran 30-100x slower (the CPU block kernels are one compiled
call on the calling thread and never start threads).

Reproduce (medians of 7 runs; table on stdout, JSON in benchmarks/results/kernels.json)::

    .venv/bin/python -m benchmarks.kernels
    python -m benchmarks.kernels --device cuda --runs 30 --models big  # a GPU: kernels_gpu.json
    .venv/bin/python -m benchmarks.kernels --models tiny --runs 5 --output /tmp/k.json
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import torch
import typer
from rich.console import Console
from rich.table import Table

from benchmarks.common import LOG_FORMAT, interleaved_samples, throughput, write_json
from benchmarks.environment import run_environment
from lmcache_pd.kernels import (
    CpuKVCache,
    KVLayout,
    TokenKVCache,
    gather_blocks,
    validate_chunk_size,
)
from lmcache_pd.kernels.integrity import checksum

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "kernels.json"
DEFAULT_GPU_OUTPUT = DEFAULT_OUTPUT.with_name("kernels_gpu.json")
WARMUP_RUNS = 2
# A hot call lasts tens of microseconds, so one stray interrupt moves a median of 7 by 2x here:
# the hot regime takes this many interleaved samples per run.
HOT_SAMPLES_PER_RUN = 25
SEED = 0
# Token layouts are GPU backends': measured at vLLM's default block size there.
GPU_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The KV-cache geometry of one model on one rank."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def block_nbytes(self) -> int:
        """Bytes of one block of one layer, K and V."""
        itemsize = torch.empty(0, dtype=self.torch_dtype).element_size()
        return self.num_kv_heads * self.block_size * 2 * self.head_size * itemsize


MODELS = {
    # the tiny random Llama of DESIGN.md ("vLLM on CPU")
    "tiny": ModelShape("tiny", 4, 2, 64, 128, "float32"),
    # an 8B-class model (Llama-3-8B: 32 layers, 8 KV heads, head 128) in bfloat16
    "big": ModelShape("big", 32, 8, 128, 128, "bfloat16"),
}


def _record(
    op: str,
    shape: ModelShape,
    layout: str,
    nbytes: int,
    samples: tuple[list[float], list[float]],
    regime: str = "hot",
) -> dict[str, Any]:
    rates = throughput(nbytes, samples)
    logger.info(
        "%s %s (%s): %.2f GB/s, memcpy %.2f GB/s",
        shape.name,
        op,
        regime,
        rates["gbps"],
        rates["memcpy_gbps"],
    )
    return {
        "op": op,
        "regime": regime,
        "model": shape.name,
        "layout": layout,
        **{field: value for field, value in asdict(shape).items() if field != "name"},
        **rates,
    }


def _memcpy(nbytes: int) -> Callable[[], None]:
    """A single-thread memcpy of ``nbytes`` between two contiguous buffers (both touched once)."""
    source, target = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    return lambda: np.copyto(target, source)


def _block_ids(num_blocks: int, count: int) -> torch.Tensor:
    """``count`` distinct block ids, no two adjacent, so no copy can merge neighbours."""
    generator = torch.Generator().manual_seed(SEED)
    evens = torch.randperm(num_blocks // 2, generator=generator)[:count] * 2
    return evens.to(torch.int32)


def _random_cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED)
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).view(shape)


def _blocks_as_bytes(layers: Sequence[torch.Tensor], block_ids: torch.Tensor) -> torch.Tensor:
    rows = [layer[block].reshape(-1).view(torch.uint8) for layer in layers for block in block_ids]
    return torch.cat(rows)


def _cpu_layers(
    shape: ModelShape, num_blocks: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A random CPU cache of ``num_blocks`` blocks and a zeroed one like it, as layer views into
    one buffer each (as vLLM allocates them)."""
    geometry = (shape.num_kv_heads, shape.block_size, 2 * shape.head_size)
    source = _random_cache((shape.num_layers, num_blocks, *geometry), shape.torch_dtype)
    return list(source.unbind(0)), list(torch.zeros_like(source).unbind(0))


def _check_moved(
    shape: ModelShape,
    layers: Sequence[torch.Tensor],
    target_layers: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    chunk: torch.Tensor,
) -> None:
    """Fail unless ``chunk`` and the target's blocks ``block_ids`` hold the source's bytes."""
    expected = _blocks_as_bytes(layers, block_ids)
    if not torch.equal(chunk, expected) or not torch.equal(
        _blocks_as_bytes(target_layers, block_ids), expected
    ):
        raise RuntimeError(f"{shape.name}: the CPU block kernels moved the wrong bytes")


def measure_cpu_blocks(
    shape: ModelShape, chunk_tokens: int, cache_bytes: int, runs: int
) -> list[dict[str, Any]]:
    """Whole-block gather (object and free function) and scatter of one full chunk."""
    blocks = validate_chunk_size(chunk_tokens, shape.block_size)
    num_blocks = max(4 * blocks, cache_bytes // (shape.num_layers * shape.block_nbytes()))
    layers, target_layers = _cpu_layers(shape, num_blocks)
    block_ids = _block_ids(num_blocks, blocks)
    cache, target = CpuKVCache(layers), CpuKVCache(target_layers)
    chunk = torch.empty(cache.chunk_nbytes(chunk_tokens), dtype=torch.uint8)

    digest = cache.gather(block_ids, chunk, hashed=True)
    if target.scatter(chunk, block_ids, hashed=True) != digest or digest != checksum(chunk):
        raise RuntimeError(f"{shape.name}: the hashed copies disagree with the checksum")
    _check_moved(shape, layers, target_layers, block_ids, chunk)
    memcpy = _memcpy(chunk.numel())
    steps = {
        "cpu_gather": lambda: cache.gather(block_ids, chunk),
        "cpu_scatter": lambda: target.scatter(chunk, block_ids),
        "cpu_gather_hashed": lambda: cache.gather(block_ids, chunk, hashed=True),
        "cpu_scatter_hashed": lambda: target.scatter(chunk, block_ids, hashed=True),
        "cpu_gather_fn": lambda: gather_blocks(layers, block_ids, chunk),
    }
    return [
        _record(
            op,
            shape,
            "cpu",
            chunk.numel(),
            interleaved_samples(step, memcpy, runs * HOT_SAMPLES_PER_RUN, warmup_runs=WARMUP_RUNS),
        )
        for op, step in steps.items()
    ]


def _memcpy_rotating(nbytes: int, count: int) -> Callable[[], None]:
    """One single-thread memcpy of ``nbytes`` into each of ``count`` distinct buffer pairs."""
    source, target = np.ones(nbytes * count, dtype=np.uint8), np.zeros(nbytes * count, np.uint8)
    pairs = [
        (source[i * nbytes : (i + 1) * nbytes], target[i * nbytes : (i + 1) * nbytes])
        for i in range(count)
    ]

    def copy_all() -> None:
        for src, dst in pairs:
            np.copyto(dst, src)

    return copy_all


def measure_cpu_blocks_streaming(
    shape: ModelShape, chunk_tokens: int, stream_bytes: int, runs: int
) -> list[dict[str, Any]]:
    """Whole-block gather and scatter of distinct chunks one after another (see module doc)."""
    blocks = validate_chunk_size(chunk_tokens, shape.block_size)
    chunk_bytes = shape.num_layers * blocks * shape.block_nbytes()
    count = max(2, -(-stream_bytes // chunk_bytes))
    layers, target_layers = _cpu_layers(shape, 2 * blocks * count)
    tables = _block_ids(2 * blocks * count, blocks * count).view(count, blocks)
    cache, target = CpuKVCache(layers), CpuKVCache(target_layers)
    staging = torch.empty(count * chunk_bytes, dtype=torch.uint8)
    pages = list(staging.view(count, chunk_bytes))

    def gather_all(hashed: bool = False) -> None:
        for table, page in zip(tables, pages, strict=True):
            cache.gather(table, page, hashed=hashed)

    def scatter_all(hashed: bool = False) -> None:
        for table, page in zip(tables, pages, strict=True):
            target.scatter(page, table, hashed=hashed)

    gather_all()
    scatter_all()
    for table, page in zip(tables, pages, strict=True):
        _check_moved(shape, layers, target_layers, table, page)
    memcpy = _memcpy_rotating(chunk_bytes, count)
    steps = {
        "cpu_gather": gather_all,
        "cpu_scatter": scatter_all,
        "cpu_gather_hashed": lambda: gather_all(hashed=True),
        "cpu_scatter_hashed": lambda: scatter_all(hashed=True),
    }
    records = []
    for op, step in steps.items():
        kernel_s, memcpy_s = interleaved_samples(step, memcpy, runs, warmup_runs=WARMUP_RUNS)
        per_chunk = ([t / count for t in kernel_s], [t / count for t in memcpy_s])
        record = _record(op, shape, "cpu", chunk_bytes, per_chunk, "streaming")
        records.append(record | {"chunks_per_sample": count})
    return records


def token_layers(
    shape: ModelShape, layout: KVLayout, num_blocks: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A random token-layout cache (GPU backends' order, block size ``GPU_BLOCK_SIZE``) and a
    zeroed one like it, layer views into one buffer each as vLLM allocates them."""
    heads, block, head = shape.num_kv_heads, GPU_BLOCK_SIZE, shape.head_size
    per_layer = (2, num_blocks, block, heads, head)
    if layout is KVLayout.HND:
        per_layer = (2, num_blocks, heads, block, head)
    source = _random_cache((shape.num_layers, *per_layer), shape.torch_dtype)
    return list(source.unbind(0)), list(torch.zeros_like(source).unbind(0))


def request_slots(num_blocks: int, chunk_tokens: int) -> torch.Tensor:
    """The slots of one chunk of a request: its blocks at random, filled in order."""
    tokens = torch.arange(chunk_tokens)
    blocks = _block_ids(num_blocks, -(-chunk_tokens // GPU_BLOCK_SIZE)).long()
    return blocks[tokens // GPU_BLOCK_SIZE] * GPU_BLOCK_SIZE + tokens % GPU_BLOCK_SIZE


def measure_tokens(
    shape: ModelShape, layout: KVLayout, chunk_tokens: int, cache_bytes: int, runs: int
) -> list[dict[str, Any]]:
    """Token-level gather and scatter (torch path, ``TokenKVCache`` built once as the connector
    does) of one chunk of a request's slots."""
    layer_bytes = 2 * GPU_BLOCK_SIZE * shape.num_kv_heads * shape.head_size
    layer_bytes *= torch.empty(0, dtype=shape.torch_dtype).element_size()
    blocks = -(-chunk_tokens // GPU_BLOCK_SIZE)
    num_blocks = max(4 * blocks, cache_bytes // (shape.num_layers * layer_bytes))
    layers, target_layers = token_layers(shape, layout, num_blocks)
    cache, target = TokenKVCache(layers, layout), TokenKVCache(target_layers, layout)
    slots = request_slots(num_blocks, chunk_tokens)
    chunk = torch.empty(cache.chunk_nbytes(chunk_tokens), dtype=torch.uint8)

    cache.gather(slots, chunk)
    target.scatter(chunk, slots)
    check = torch.empty_like(chunk)
    target.gather(slots, check)
    if not torch.equal(check, chunk):
        raise RuntimeError(f"{shape.name}: the token kernels ({layout.value}) lost bytes")
    memcpy = _memcpy(chunk.numel())
    name = layout.value.lower()
    steps = {
        f"token_gather_{name}": lambda: cache.gather(slots, chunk),
        f"token_scatter_{name}": lambda: target.scatter(chunk, slots),
    }
    return [
        _record(
            op,
            shape,
            layout.value,
            chunk.numel(),
            interleaved_samples(step, memcpy, runs * HOT_SAMPLES_PER_RUN, warmup_runs=WARMUP_RUNS),
        )
        | {"block_size": GPU_BLOCK_SIZE}
        for op, step in steps.items()
    ]


def run_benchmark(
    models: Sequence[str] = tuple(MODELS),
    runs: int = 7,
    *,
    chunk_tokens: int = 256,
    cache_mib: int = 256,
    stream_mib: int = 64,
    command: str | None = None,
) -> dict[str, Any]:
    """Measure every op for every model and return the JSON document (see module doc)."""
    cache_bytes = cache_mib << 20
    records = []
    for name in models:
        shape = MODELS[name]
        records += measure_cpu_blocks(shape, chunk_tokens, cache_bytes, runs)
        records += measure_cpu_blocks_streaming(shape, chunk_tokens, stream_mib << 20, runs)
        for layout in KVLayout:
            records += measure_tokens(shape, layout, chunk_tokens, cache_bytes, runs)
    environment = run_environment(("torch", "numpy"), command)
    return {
        **environment,
        "settings": {
            "runs": runs,
            "warmup_runs": WARMUP_RUNS,
            "hot_samples_per_run": HOT_SAMPLES_PER_RUN,
            "chunk_tokens": chunk_tokens,
            "cache_mib": cache_mib,
            "stream_mib": stream_mib,
            "torch_threads": torch.get_num_threads(),
            "memcpy": "numpy.copyto, one thread, same bytes, interleaved with each kernel",
            "models": {name: asdict(MODELS[name]) for name in models},
        },
        "records": records,
    }


def print_table(document: dict[str, Any], console: Console | None = None) -> None:
    """The medians as a rich table."""
    settings = document["settings"]
    table = Table(
        title=f"KV kernels vs memcpy, GB/s (medians of {settings['runs']} runs, "
        f"{settings['chunk_tokens']}-token chunks)",
        caption=f"memcpy: {settings['memcpy']}; torch threads {settings.get('torch_threads', '-')}",
    )
    for column in ("model", "dtype", "op", "regime", "MiB", "GB/s", "memcpy GB/s", "ratio"):
        justify = "left" if column in ("model", "op", "regime") else "right"
        table.add_column(column, justify=justify, no_wrap=True)
    for record in document["records"]:
        table.add_row(
            record["model"],
            record["dtype"],
            record["op"],
            record["regime"],
            f"{record['bytes'] / (1 << 20):.1f}",
            f"{record['gbps']:.2f}",
            f"{record['memcpy_gbps']:.2f}",
            f"{record['ratio_vs_memcpy']:.2f}",
        )
    (console or Console()).print(table)


app = typer.Typer(add_completion=False, help=__doc__.splitlines()[0])


@app.command()
def main(
    models: Annotated[str, typer.Option(help="comma-separated model shapes")] = ",".join(MODELS),
    runs: Annotated[int, typer.Option(min=5, help="timed runs per op (medians)")] = 7,
    chunk_tokens: Annotated[int, typer.Option(min=1, help="tokens per chunk")] = 256,
    cache_mib: Annotated[int, typer.Option(min=1, help="size of each KV cache made")] = 256,
    stream_mib: Annotated[
        int, typer.Option(min=1, help="distinct chunks per streaming sample, in MiB")
    ] = 64,
    torch_threads: Annotated[int, typer.Option(min=1, help="torch intra-op threads")] = 1,
    device: Annotated[
        str, typer.Option(help="cpu: every kernel on CPU tensors; cuda: the Triton path on a GPU")
    ] = "cpu",
    rotation_mib: Annotated[
        int, typer.Option(min=1, help="cuda: distinct chunks per timed sample, in MiB (> L2)")
    ] = 512,
    sweep: Annotated[
        bool, typer.Option(help="cuda: also time other tokens-per-program and warp counts")
    ] = True,
    output: Annotated[
        Path | None, typer.Option(help="where the JSON goes (default: results/kernels*.json)")
    ] = None,
) -> None:
    """Run the benchmark, print the table and write the JSON."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    names = [name.strip() for name in models.split(",") if name.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        raise typer.BadParameter(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    if device not in ("cpu", "cuda"):
        raise typer.BadParameter(f"--device is cpu or cuda, got {device}")
    torch.set_num_threads(torch_threads)
    if device == "cuda":
        # Imported here: it is the GPU's, and needs Triton only when run.
        from benchmarks.kernels_gpu import print_gpu_table, run_gpu_benchmark

        document = run_gpu_benchmark(
            [MODELS[name] for name in names],
            runs,
            block_size=GPU_BLOCK_SIZE,
            rotation_mib=rotation_mib,
            sweep=sweep,
        )
        print_gpu_table(document)
        write_json(output or DEFAULT_GPU_OUTPUT, document)
        logger.info("wrote %s", output or DEFAULT_GPU_OUTPUT)
        return
    document = run_benchmark(
        names, runs, chunk_tokens=chunk_tokens, cache_mib=cache_mib, stream_mib=stream_mib
    )
    output = output or DEFAULT_OUTPUT
    print_table(document)
    write_json(output, document)
    logger.info("wrote %s", output)


if __name__ == "__main__":
    app()
