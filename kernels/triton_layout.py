"""Token-level gather/scatter on GPU with one Triton launch for all layers.

Same layouts, chunk format (``KV_2LTD``) and checks as ``token_layout``, whose torch path is the
reference: where that path makes one ``index_select`` over rows, this makes one launch over a
grid of (token tile, layer), each program copying K and V of every head of its tokens. Layers
are reached through a device table of their offsets from the lowest one, so they need not be
evenly spaced, but they must share shape and strides (vLLM allocates them alike). Values move
as integers of their own width: no float conversion can touch a bit.

Why this shape (``benchmarks/kernels_gpu.py`` measures it against a device copy): in vLLM
0.32's layouts K and V of one head are the two halves of one run, so one program reads both;
each head's values are a contiguous run whose start is 16-byte aligned (asserted here, told to
the compiler), so the accesses are 16 bytes wide; a program moves ``PROGRAM_BYTES`` with its
loads issued before its stores; a request's tokens are found through its block table on the
device (a few block ids cross from the host per chunk, not a slot per token).

:class:`TritonTokenKV` checks the layers and puts their addresses on the device once, and its calls
trust block tables already on the device that the caller checked on the host (``chunk_blocks``):
checking there (a min, a max) would wait for the GPU, and the connector copies on a stream of its
own precisely so that its thread never waits for the model's work. The free functions check
everything on every call.

Triton is optional: it comes with CUDA builds of torch and is useless on CPU. This module imports
without it; using it without Triton raises ``ImportError`` saying so. With ``TRITON_INTERPRET=1``
(set before Triton is imported) the kernel also runs, slowly, on CPU tensors in Triton's
interpreter: that is how it is tested on machines without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch

from .token_layout import KVLayout, nhd_views

# What one program moves, and one warp of it (32 lanes of 16-byte accesses, four deep).
PROGRAM_BYTES = 4096
WARP_BYTES = 2048

# The integer type of each element width, which the kernel moves values as.
_INTEGERS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def triton_available() -> bool:
    """Whether the Triton path can run here: Triton imports and a CUDA device is present."""
    try:
        _kernel_module()
    except ImportError:
        return False
    return torch.cuda.is_available()


def gather_tokens_triton(
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    start: int,
    end: int,
    out: torch.Tensor,
    layout: KVLayout,
) -> None:
    """:func:`lmcache_pd.kernels.token_layout.gather_tokens` of a request's tokens ``start ..
    end`` (its blocks ``block_ids``, as ``token_layout.slot_mapping`` reads them) for CUDA
    tensors, in one launch."""
    cache = TritonTokenKV(layers, layout)
    blocks, first = chunk_blocks(block_ids, start, end, cache.block_size, cache.num_blocks)
    table = torch.tensor(blocks, dtype=torch.int64, device=out.device)
    cache.gather(table, first, end - start, out)


def scatter_tokens_triton(
    chunk: torch.Tensor,
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    start: int,
    end: int,
    layout: KVLayout,
) -> None:
    """The inverse of :func:`gather_tokens_triton`: write ``chunk`` into tokens ``start ..
    end`` of the request's blocks."""
    cache = TritonTokenKV(layers, layout)
    blocks, first = chunk_blocks(
        block_ids, start, end, cache.block_size, cache.num_blocks, unique=True
    )
    table = torch.tensor(blocks, dtype=torch.int64, device=chunk.device)
    cache.scatter(chunk, table, first, end - start)


def chunk_blocks(
    block_ids: Sequence[int],
    start: int,
    end: int,
    block_size: int,
    num_blocks: int,
    *,
    unique: bool = False,
) -> tuple[list[int], int]:
    """The blocks holding a request's tokens ``start .. end``, and where in the first of them
    token ``start`` is; checked on the host, in Python (a handful of ints: microseconds, where
    the same checks as tensors cost ~250 us a chunk). ``ValueError`` for a block outside the
    cache, too few blocks, or, with ``unique`` (a scatter), a block named twice."""
    if not 0 <= start < end:
        raise ValueError(f"no tokens in {start}..{end}")
    first, last = start // block_size, -(-end // block_size)
    if last > len(block_ids):
        raise ValueError(f"tokens up to {end} need more than the request's {len(block_ids)} blocks")
    blocks = list(block_ids[first:last])
    if min(blocks) < 0 or max(blocks) >= num_blocks:
        raise ValueError(
            f"blocks {min(blocks)}..{max(blocks)} fall outside the cache's {num_blocks}"
        )
    if unique and len(set(blocks)) != len(blocks):
        raise ValueError("the request's blocks name a block twice")
    return blocks, start - first * block_size


class TritonTokenKV:
    """A CUDA token-layout cache for the Triton kernel, its layers checked once and its kernels
    compiled once, here: a compile on first use would stall vLLM's model thread for seconds.

    A program copies ``tile`` tokens of one layer, K and V of every head: about
    ``PROGRAM_BYTES``, with a warp per ``WARP_BYTES`` (the best of the shapes
    ``benchmarks/kernels_gpu.py`` tried on an H200 for an 8B model's 4 KiB tokens: one token,
    two warps)."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout) -> None:
        self._kernels = _kernel_module()
        self.views = nhd_views(layers, layout)
        sample = self.views[0]
        if sample.device.type != "cuda" and not _interpreting():
            raise ValueError(f"the Triton path moves CUDA tensors, the cache is on {sample.device}")
        self._integer = _INTEGERS[sample.element_size()]
        _, self.num_blocks, self.block_size, num_heads, head_size = sample.shape
        stride_kv, stride_block, stride_token, stride_head, _ = sample.stride()
        self._token_bytes = 2 * num_heads * head_size * sample.element_size()
        # A chunk token: K and V of every layer.
        self._chunk_token_bytes = self._token_bytes * len(self.views)
        self.tile = _prev_pow2(max(1, min(64, PROGRAM_BYTES // self._token_bytes)))
        self.warps = self._warps(self.tile)
        base = min(view.data_ptr() for view in self.views)
        offsets = [(view.data_ptr() - base) // sample.element_size() for view in self.views]
        # Wide accesses need every head's run to start on 16 bytes: the layers' starts and the
        # strides (Triton learns the strides' alignment from their values, not these).
        align = 16 // sample.element_size()
        aligned = base % 16 == 0 and not any(offset % align for offset in offsets)
        self._constants = {
            "NUM_LAYERS": len(self.views),
            "BLOCK_SIZE": self.block_size,
            "NUM_HEADS": num_heads,
            "HEAD_SIZE": head_size,
            "HEADS_POW2": _next_pow2(num_heads),
            "HEAD_SIZE_POW2": _next_pow2(head_size),
            "ALIGN": align if aligned else 1,
        }
        # The bytes a chunk's start is counted in: ALIGN values (the kernel is told so).
        self._values_align_bytes = self._constants["ALIGN"] * sample.element_size()
        self._strides = (stride_block, stride_token, stride_head, stride_kv)
        self._base = self._as_integers(min(self.views, key=torch.Tensor.data_ptr))
        # Made once: a host-to-device copy per call would wait for the stream it runs on.
        self._layer_offsets = torch.tensor(offsets, dtype=torch.int64, device=sample.device)
        self._compile_ahead()

    def gather(
        self, blocks: torch.Tensor, first: int, num_tokens: int, out: torch.Tensor, **shape: int
    ) -> None:
        """Copy ``num_tokens`` tokens into ``out``, on the current stream: the request's, from
        token ``first`` of block ``blocks[0]`` on. ``blocks``: int64 block ids on the cache's
        device, checked by the caller (``chunk_blocks``). ``shape``: see ``run``."""
        self.run(self.plan([out], [PlanRow(0, first, num_tokens, 0)]), blocks, False, **shape)

    def scatter(
        self,
        chunk: torch.Tensor,
        blocks: torch.Tensor,
        first: int,
        num_tokens: int,
        skip: int = 0,
        **shape: int,
    ) -> None:
        """Write the chunk's tokens ``skip .. skip + num_tokens`` into the request's tokens from
        token ``first`` of block ``blocks[0]`` on, on the current stream (blocks distinct,
        checked by the caller)."""
        self.run(self.plan([chunk], [PlanRow(0, first, num_tokens, skip)]), blocks, True, **shape)

    def plan(self, chunks: Sequence[torch.Tensor], rows: Sequence[PlanRow]) -> CopyPlan:
        """One launch's chunks of a request, on the device (queued on the current stream):
        ``rows[i]`` says what ``chunks[i]`` copies (``PlanRow``). Made apart from ``run`` so
        that a run can be captured in a CUDA graph (``benchmarks/kernels_gpu.py``). Each chunk
        is checked by its size, place and start only: microseconds, for a load of many."""
        if not chunks or len(chunks) != len(rows):
            raise ValueError(f"{len(chunks)} chunks, {len(rows)} plan rows")
        device = self.views[0].device
        lowest = min(chunks, key=torch.Tensor.data_ptr)
        base = lowest.data_ptr()
        offsets = []
        for chunk, row in zip(chunks, rows, strict=True):
            nbytes = (row.skip + row.num_tokens) * self._chunk_token_bytes
            if chunk.device != device or not chunk.is_contiguous() or chunk.nbytes != nbytes:
                raise ValueError(
                    f"a chunk of {row.skip + row.num_tokens} tokens is {nbytes} contiguous bytes "
                    f"on {device}, got {chunk.nbytes} on {chunk.device}"
                )
            offset, misaligned = divmod(chunk.data_ptr() - base, self._values_align_bytes)
            if misaligned or (self._constants["ALIGN"] > 1 and base % 16):
                raise ValueError("every chunk of a launch must start on 16 bytes, as pages do")
            offsets.append(offset * self._constants["ALIGN"])
        table = torch.tensor(
            [
                (o, r.block, r.first, r.num_tokens, r.skip)
                for o, r in zip(offsets, rows, strict=True)
            ],
            dtype=torch.int64,
        )
        if device.type == "cuda":
            # From pinned memory, without blocking: a pageable copy would wait for the stream.
            table = table.pin_memory().to(device, non_blocking=True)
        longest = max(row.num_tokens for row in rows)
        pointer = lowest.view(torch.uint8)[: self._integer.itemsize].view(self._integer)
        return CopyPlan(pointer, table, len(rows), longest, list(chunks))

    def run(
        self,
        plan: CopyPlan,
        blocks: torch.Tensor,
        to_cache: bool,
        *,
        tile: int | None = None,
        num_warps: int | None = None,
    ) -> None:
        """Copy every chunk of ``plan`` (into the cache with ``to_cache``, else out of it), one
        launch on the current stream; ``blocks``: the block table the plan's rows index (int64,
        on the cache's device). ``tile`` and ``num_warps`` override the launch shape
        (``benchmarks/kernels_gpu.py`` measures the choices); a shape not compiled ahead
        compiles here."""
        device = self.views[0].device
        if blocks.dtype != torch.int64 or blocks.dim() != 1 or blocks.device != device:
            raise ValueError(f"blocks must be 1-D int64 on {device}, got {blocks.dtype}")
        tile = tile or self.tile
        grid = (-(-plan.longest // tile), len(self.views), plan.count)
        self._kernels.copy_kv_kernel[grid](
            self._base,
            self._layer_offsets,
            plan.base,
            plan.table,
            blocks,
            *self._strides,
            **self._constants,
            TILE=tile,
            TO_CACHE=to_cache,
            num_warps=num_warps or self._warps(tile),
        )

    def _warps(self, tile: int) -> int:
        return max(1, min(8, _prev_pow2(max(1, tile * self._token_bytes // WARP_BYTES))))

    def _compile_ahead(self) -> None:
        """Compile both directions now; no argument is specialised on but the strides, known
        here, and nothing runs."""
        if _interpreting():
            return
        pointers = (self._integer, torch.int64, self._integer, torch.int64, torch.int64)
        for to_cache in (False, True):
            self._kernels.copy_kv_kernel.warmup(
                *pointers,
                *self._strides,
                **self._constants,
                TILE=self.tile,
                TO_CACHE=to_cache,
                num_warps=self.warps,
                grid=(1,),
            )

    def _as_integers(self, view: torch.Tensor) -> torch.Tensor:
        """The memory from ``view``'s first value on, as the kernel's integers (a pointer)."""
        return view.as_strided((1,), (1,)).view(self._integer)


class PlanRow(NamedTuple):
    """What one chunk of a launch copies: ``num_tokens`` tokens, the chunk's from ``skip`` on,
    the request's from token ``first`` of block table entry ``block`` on."""

    block: int
    first: int
    num_tokens: int
    skip: int


@dataclass(frozen=True)
class CopyPlan:
    """A launch's chunks on the device: the lowest chunk (the kernel's pointer), the plan rows
    with each chunk's offset from it, and the chunks themselves (kept alive until the launch's
    plan is dropped)."""

    base: torch.Tensor
    table: torch.Tensor
    count: int
    longest: int
    chunks: list[torch.Tensor]


def _interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernel_module() -> ModuleType:
    """The module holding the jitted kernel, imported on first use so Triton stays optional."""
    try:
        from . import _triton_kernel
    except ImportError as error:
        raise ImportError(
            "the Triton gather/scatter needs Triton (it comes with CUDA builds of torch); "
            "on CPU use lmcache_pd.kernels.gather_tokens/scatter_tokens, the torch path"
        ) from error
    return _triton_kernel


def _next_pow2(value: int) -> int:
    return 1 << (value - 1).bit_length()


def _prev_pow2(value: int) -> int:
    return 1 << (value.bit_length() - 1)
