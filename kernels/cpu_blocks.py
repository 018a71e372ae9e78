"""Whole-block gather/scatter between vLLM's CPU paged KV cache and flat chunk buffers.

vLLM's CPU attention backend keeps, per layer, a tensor of shape
``(num_blocks, num_kv_heads, block_size, 2 * head_size)``: each ``(block, head)`` holds the block's
K, packed in an order chosen by the CPU's ISA (AMX, AVX-512, NEON...), then its V (vllm-project/vllm
``tests/kernels/attention/test_cpu_attn.py`` builds that cache and splits it with
``view(num_blocks, num_kv_heads, 2 * block_size, head_size).chunk(2, dim=2)``). Since a token's K
cannot be found without knowing that order, this module never looks inside a block: it moves whole
blocks as opaque bytes, which is right whenever both sides run the same dtype, block size and ISA.
So a chunk must be a whole number of blocks (:func:`validate_chunk_size`), except a request's last
chunk, which holds ``ceil(tokens / block_size)`` blocks.

Older vLLM CPU backends used ``(2, num_blocks, num_kv_heads, block_size, head_size)`` per layer
(``vllm/v1/attention/backends/cpu_attn.py``, K and V apart): pass each layer's ``cache.unbind(0)``
(its K, then its V) as two entries of ``layers`` and everything here still holds.

A chunk's bytes are ordered ``[layer][block][bytes of the block]``. The copies run in one
compiled call (``_cpu_block_copy.c``, built at install), which releases the GIL while bytes move.
With ``hashed=True`` that call also returns the chunk's XXH3-64 (``xxh3.h``), taken from the
registers that copy each 64 bytes: the checksum a chunk travels with costs no pass of its own
over the chunk (``kernels/integrity.py``).
Why compiled: with 1 MiB chunks of 128 KiB blocks, one numpy row assignment per block plus the
argument checks cost ~5-8 us of Python against a ~23 us memcpy (0.74x memcpy); the compiled loop
runs at 0.92-1.07x memcpy (1 and 32 MiB chunks, in and out of the CPU's caches).
``torch.index_select``/``index_copy_`` measured 0.5-0.9x memcpy on one thread, and with two
threads 30x slower than memcpy while another process held a core (OpenMP threads spin-waiting on
each other), which is how vLLM's CPU workers share a machine. Numbers and how to
reproduce them: ``benchmarks/kernels.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ._cpu_block_copy import copy_blocks, xxh3_64


def validate_chunk_size(chunk_size: int, block_size: int) -> int:
    """Blocks in a full chunk; raises ``ValueError`` unless ``chunk_size`` is a multiple of
    ``block_size``. Run it at start-up: on CPU a chunk is made of whole blocks, never parts."""
    if block_size < 1 or chunk_size < 1:
        raise ValueError(f"chunk_size ({chunk_size}) and block_size ({block_size}) must be >= 1")
    if chunk_size % block_size:
        lower = chunk_size // block_size * block_size
        hint = f"{lower} or {lower + block_size}" if lower else str(block_size)
        raise ValueError(
            f"chunk_size ({chunk_size}) is not a multiple of vLLM's block_size ({block_size}): "
            f"the CPU KV cache can only be moved in whole blocks; use e.g. {hint}"
        )
    return chunk_size // block_size


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: a partial last block counts as one."""
    if num_tokens < 1 or block_size < 1:
        raise ValueError(
            f"need num_tokens >= 1 and block_size >= 1, got {num_tokens}, {block_size}"
        )
    return math.ceil(num_tokens / block_size)


def chunk_nbytes(layers: Sequence[torch.Tensor], num_tokens: int) -> int:
    """Bytes of a chunk of ``num_tokens`` tokens: whole blocks of every layer."""
    return CpuKVCache(layers).chunk_nbytes(num_tokens)


def gather_blocks(
    layers: Sequence[torch.Tensor], block_ids: torch.Tensor, out: torch.Tensor
) -> None:
    """Copy blocks ``block_ids`` of every layer into ``out`` (flat uint8, exactly
    ``len(layers) * len(block_ids)`` blocks' bytes), ordered [layer][block][bytes].

    Checks ``layers`` on every call (~5-9 us a layer here): where it runs per
    request, build a :class:`CpuKVCache` once and call its ``gather``."""
    CpuKVCache(layers).gather(block_ids, out)


def scatter_blocks(
    chunk: torch.Tensor, layers: Sequence[torch.Tensor], block_ids: torch.Tensor
) -> None:
    """The inverse of :func:`gather_blocks`: write ``chunk``'s blocks into blocks ``block_ids``."""
    CpuKVCache(layers).scatter(chunk, block_ids)


class CpuKVCache:
    """The layers of one vLLM CPU KV cache, checked and mapped to block addresses once, so that
    a gather or scatter costs only its copies and the checks of its own arguments."""

    def __init__(self, layers: Sequence[torch.Tensor]) -> None:
        sample = _check_layers(layers)
        self.num_layers = len(layers)
        self.block_size: int = sample.shape[2]
        self.num_blocks = min(x.shape[0] for x in layers)
        self.block_nbytes = sample[0].numel() * sample.element_size()
        # The compiled copy gets raw addresses: holding the layers keeps them valid.
        self._layers = tuple(layers)
        self._addrs = tuple(x.data_ptr() for x in layers)
        self._strides = tuple(x.stride(0) * x.element_size() for x in layers)

    def chunk_nbytes(self, num_tokens: int) -> int:
        """Bytes of a chunk of ``num_tokens`` tokens."""
        return blocks_for_tokens(num_tokens, self.block_size) * self.num_layers * self.block_nbytes

    def gather(
        self, block_ids: torch.Tensor, out: torch.Tensor, *, hashed: bool = False
    ) -> int | None:
        """Copy blocks ``block_ids`` of every layer into ``out``, ordered [layer][block][bytes];
        with ``hashed``, return the XXH3-64 of ``out``'s bytes, taken in the same pass."""
        return self._copy(block_ids, out, "out", to_chunk=True, hashed=hashed)

    def scatter(
        self, chunk: torch.Tensor, block_ids: torch.Tensor, *, hashed: bool = False
    ) -> int | None:
        """Write ``chunk`` (as :meth:`gather` made it) into blocks ``block_ids`` of every layer;
        with ``hashed``, return the XXH3-64 of all of ``chunk``'s bytes, taken in the same pass.

        A chunk may hold more blocks a layer than ``block_ids`` names: a load that starts inside
        it (decode's own cache holds its first blocks) writes only its last ``len(block_ids)``
        blocks of each layer, and the first ones are only hashed, so the hash still covers every
        byte the producer's checksum did."""
        return self._copy(block_ids, chunk, "chunk", to_chunk=False, hashed=hashed)

    def _copy(
        self, block_ids: torch.Tensor, chunk: torch.Tensor, name: str, to_chunk: bool, hashed: bool
    ) -> int | None:
        """Check the chunk and the block ids (the compiled copy checks their range), then copy."""
        ids = _check_block_ids(block_ids)
        if not to_chunk and len(set(ids)) != len(ids):
            raise ValueError(
                f"block_ids name a block twice; two chunk blocks cannot share it: {ids}"
            )
        layer_bytes = self.num_layers * self.block_nbytes
        total = chunk.numel() // layer_bytes if chunk.numel() % layer_bytes == 0 else -1
        fits = total == len(ids) or (not to_chunk and total > len(ids))
        if not (
            chunk.dtype == torch.uint8
            and chunk.dim() == 1
            and chunk.is_cpu
            and chunk.is_contiguous()
            and fits
        ):
            expected = layer_bytes * len(ids)
            extra = "" if to_chunk else " (or more whole blocks a layer, the first ones skipped)"
            raise ValueError(
                f"{name} must be a flat contiguous uint8 CPU tensor of {expected} bytes{extra} "
                f"({self.num_layers} layers x {len(ids)} blocks x {self.block_nbytes} bytes), "
                f"got {_describe(chunk)} on {chunk.device}"
            )
        return copy_blocks(
            chunk.data_ptr(),
            self._addrs,
            self._strides,
            self.num_blocks,
            self.block_nbytes,
            ids,
            to_chunk,
            total - len(ids),
            hashed,
        )


def xxh3_64_of(data: torch.Tensor) -> int:
    """XXH3-64 of a contiguous CPU tensor's bytes, by the same code as a hashed copy."""
    if not (data.is_cpu and data.is_contiguous()):
        raise ValueError(f"need a contiguous CPU tensor, got {_describe(data)} on {data.device}")
    return xxh3_64(data.data_ptr(), data.numel() * data.element_size())


def _check_layers(layers: Sequence[torch.Tensor]) -> torch.Tensor:
    if not layers:
        raise ValueError("no layers")
    sample = layers[0]
    for layer in layers:
        if layer.dim() != 4 or layer.shape[0] < 1:
            raise ValueError(
                "a CPU KV cache layer is (num_blocks, num_kv_heads, block_size, 2 * head_size), "
                f"got {_describe(layer)}"
            )
        if layer.shape[1:] != sample.shape[1:] or layer.dtype != sample.dtype:
            raise ValueError(
                f"layers differ: {_describe(layer)} vs {_describe(sample)}; every layer needs "
                "the same block shape and dtype"
            )
        if not layer[0].is_contiguous() or layer.stride(0) < layer[0].numel():
            raise ValueError(f"each block of a layer must be contiguous, got {_describe(layer)}")
        if layer.device.type != "cpu":
            raise ValueError(f"a layer is on {layer.device}; the CPU KV cache lives in CPU memory")
    return sample


def _check_block_ids(block_ids: torch.Tensor) -> list[int]:
    if block_ids.dim() != 1 or block_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_ids must be a 1-D int32/int64 tensor, got {_describe(block_ids)}")
    ids = block_ids.tolist()
    if not ids:
        raise ValueError("block_ids is empty: a chunk holds at least one block")
    return ids


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {tensor.dtype} strides {tensor.stride()}"
