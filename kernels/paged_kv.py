"""The worker's view of vLLM's paged KV cache: which chunk format it moves, and a request's tokens
gathered into a chunk or scattered out of one.

vLLM hands the connector one tensor per layer (``register_kv_caches``); what they hold decides
the chunk format, compared with the peer's at handshake (``compat.py``):

- ``blocks``: vLLM's CPU engine. Its attention backend packs K inside each block in an order of
  the CPU's ISA, so whole blocks move as opaque bytes (``kernels/cpu_blocks.py``), and a chunk is
  a whole number of blocks: ``blocks:<layers>x<heads>x<block size>x<2*head size>:<dtype>``.
- ``latent``: an MLA model's cache (DeepSeek-V2/V3 style: vLLM's MLA backends,
  ``(blocks, block size, latent + rope width)`` a layer, no heads and no V). A block is a
  contiguous run of its tokens' latents, the same on every tensor-parallel rank; chunks are
  whole blocks, as CPU blocks are: ``latent:<layers>x<block size>x<width>:<dtype>``. Moved from
  CPU memory only (vLLM's CPU MLA backend); refused at start-up on a GPU.
- ``tokens``: GPU attention backends store K and V per token, NHD or HND. A chunk is tokens-major
  (``kernels/token_layout.py``), the same whatever the layout, so an NHD producer feeds an HND
  consumer: ``tokens:KV_2LTD:<layers>x<heads*head size>:<dtype>``. CPU tensors take the torch
  path; CUDA tensors the Triton path on a stream of the connector's own (``cuda_kv.py``).

No two of them meet: the handshake refuses a peer whose chunk format differs (``compat.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from lmcache_pd.kernels.chunk_bytes import ChunkBytes
from lmcache_pd.kernels.cpu_blocks import CpuKVCache, validate_chunk_size
from lmcache_pd.kernels.token_layout import (
    KVLayout,
    TokenKVCache,
    dtype_name,
    slot_mapping,
    token_chunk_format,
)

# vLLM's resolved layout (``vllm/v1/kv_cache_layout.py``, or the older ``NHD``/``HND`` names)
# as the physical order of a block's interior: token before head (NHD) or after it (HND).
PHYSICAL_ORDERS = ("NHD", "HND")


class Copy(Protocol):
    """A copy into or out of the cache: done at once on CPU, later on a GPU's copy stream."""

    # The chunk's XXH3-64, taken in the copy's own pass where the cache can (whole blocks on
    # CPU, asked with ``hashed``); None otherwise.
    digest: int | None

    def done(self) -> bool: ...

    def wait(self, deadline: float) -> None:
        """Return once done; raise ``TransferError`` at ``deadline`` (``time.monotonic()``)."""

    def order_model(self) -> None:
        """Make the model's work queued from now on wait for this copy: for a scatter whose
        blocks vLLM may use again before the copy is seen done (a failed or aborted load)."""


class Copied:
    """A copy that finished before its call returned (every CPU copy)."""

    def __init__(self, digest: int | None = None) -> None:
        self.digest = digest

    def done(self) -> bool:
        return True

    def wait(self, deadline: float) -> None:
        return None

    def order_model(self) -> None:
        return None


COPIED = Copied()


class PagedKV(Protocol):
    """What the worker halves ask of the cache, whatever its format."""

    chunk_format: str
    # vLLM's block size, which a token's block is found by.
    block_size: int
    # Whether a chunk is whole blocks (then chunk_size must be a multiple of block_size, and
    # so must the peer's block size be the same).
    whole_blocks: bool
    # Whether a copy with ``hashed`` returns its chunk's digest (taken in the copy's own pass).
    hashes_in_pass: bool
    device: torch.device

    def chunk_nbytes(self, num_tokens: int) -> int: ...

    def gather(
        self,
        block_ids: Sequence[int],
        start: int,
        end: int,
        out: torch.Tensor,
        hashed: bool = False,
    ) -> Copy:
        """Copy the request's tokens ``start .. end`` (its blocks ``block_ids``) into ``out``
        (exactly ``chunk_nbytes(end - start)`` bytes); with ``hashed``, the copy's ``digest``
        is ``out``'s XXH3-64 where the cache can take it in the same pass."""

    def scatter(
        self,
        chunk: torch.Tensor,
        block_ids: Sequence[int],
        chunk_start: int,
        chunk_end: int,
        start: int,
        hashed: bool = False,
        model_waits: bool = True,
    ) -> Copy:
        """Write ``chunk`` (the request's tokens ``chunk_start .. chunk_end``, as ``gather``
        made it) into the request's blocks, its tokens from ``start`` on only (decode's own
        prefix-cache hit ends there, on a block boundary); with ``hashed``, the copy's
        ``digest`` is all of ``chunk``'s XXH3-64 where the cache can take it in the same pass.
        ``model_waits``: on a GPU, the model's next work waits for the copy (a load the coming
        forward pass reads); otherwise the caller must see the copy done before any model work
        reads the blocks. A CPU copy is done when this returns, either way."""

    def scatter_chunks(
        self,
        chunks: Sequence[ChunkBytes],
        block_ids: Sequence[int],
        start: int,
        hashed: bool = False,
        model_waits: bool = True,
    ) -> tuple[Copy, list[int | None]]:
        """``scatter`` of several chunks of one request (a load) at once: one copy, done when
        all are (on a GPU, one launch), and each chunk's digest where taken in the pass."""

    def adopt(self, buffer: torch.Tensor, *, loads: bool = True) -> None:
        """Chunks will be read from or written to ``buffer``: make copies with it fast;
        ``loads``: chunks in it will be loaded into this cache (not only gathered into it)."""

    def close(self) -> None: ...


class ChunkByChunk:
    """``PagedKV.scatter_chunks`` as one ``scatter`` (the subclass's) a chunk: the CPU caches,
    whose every copy is done when its call returns, so nothing is gained by one call a load."""

    def scatter_chunks(
        self,
        chunks: Sequence[ChunkBytes],
        block_ids: Sequence[int],
        start: int,
        hashed: bool = False,
        model_waits: bool = True,
    ) -> tuple[Copy, list[int | None]]:
        copy: Copy = COPIED
        digests: list[int | None] = []
        for chunk in chunks:
            copy = self.scatter(
                chunk.data, block_ids, chunk.start, chunk.end, start, hashed, model_waits
            )
            digests.append(copy.digest)
        return copy, digests


class BlockKV(ChunkByChunk):
    """vLLM's CPU cache (``blocks``, 4-D layers) or an MLA latent cache in CPU memory
    (``latent``, 3-D layers, seen as blocks of one head): chunks of whole blocks, as opaque
    bytes."""

    whole_blocks = True
    hashes_in_pass = True

    def __init__(self, layers: Sequence[torch.Tensor], chunk_size: int) -> None:
        """Refuses a ``chunk_size`` that is not a whole number of blocks, at start-up."""
        sample = layers[0]
        kind = "latent" if sample.dim() == 3 else "blocks"
        self._layers = [layer.unsqueeze(1) if layer.dim() == 3 else layer for layer in layers]
        self._chunk_size = chunk_size
        self._cache = CpuKVCache(self._layers)
        self.block_size = self._cache.block_size
        validate_chunk_size(chunk_size, self.block_size)
        shape = "x".join(str(n) for n in (len(layers), *sample.shape[1:]))
        self.chunk_format = f"{kind}:{shape}:{dtype_name(sample.dtype)}"
        self.device = sample.device

    def chunk_nbytes(self, num_tokens: int) -> int:
        return self._cache.chunk_nbytes(num_tokens)

    def gather(
        self,
        block_ids: Sequence[int],
        start: int,
        end: int,
        out: torch.Tensor,
        hashed: bool = False,
    ) -> Copy:
        return Copied(self._cache.gather(self._blocks(block_ids, start, end), out, hashed=hashed))

    def scatter(
        self,
        chunk: torch.Tensor,
        block_ids: Sequence[int],
        chunk_start: int,
        chunk_end: int,
        start: int,
        hashed: bool = False,
        model_waits: bool = True,
    ) -> Copy:
        blocks = self._blocks(block_ids, max(chunk_start, start), chunk_end)
        return Copied(self._cache.scatter(chunk, blocks, hashed=hashed))

    def adopt(self, buffer: torch.Tensor, *, loads: bool = True) -> None:
        return None

    def close(self) -> None:
        return None

    def heads(self, lo: int, hi: int) -> BlockKV:
        """The same cache, KV heads ``lo .. hi`` of each block only (each head's packed K and V
        lie together inside a block, so a head range is one run of bytes a block): what one
        rank sends another at a different tensor-parallel size (``tp_parts.py``)."""
        count = self._layers[0].shape[1]
        if not 0 <= lo < hi <= count:
            raise ValueError(f"heads {lo}..{hi} of a cache of {count}")
        if (lo, hi) == (0, count):  # all of them (an MLA latent is one)
            return self
        return BlockKV([layer[:, lo:hi] for layer in self._layers], self._chunk_size)

    def _blocks(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        """The blocks holding tokens ``start .. end`` (``start`` on a block boundary)."""
        first, last = start // self.block_size, math.ceil(end / self.block_size)
        if last > len(block_ids):
            raise ValueError(
                f"tokens up to {end} need {last} blocks, the request has {len(block_ids)}"
            )
        return torch.tensor(block_ids[first:last], dtype=torch.int64)


class TokenKV(ChunkByChunk):
    """A token-layout cache in CPU memory: the torch path (the GPU backends' layouts, on CPU
    tensors: how they are tested and measured without a GPU)."""

    whole_blocks = False
    hashes_in_pass = False

    def __init__(self, views: Sequence[torch.Tensor], block_size: int) -> None:
        """``views``: the layers in NHD order (see ``recognise``)."""
        self._cache = TokenKVCache(views, KVLayout.NHD)
        self.block_size = block_size
        self.chunk_format = token_chunk_format(self._cache)
        self.device = self._cache.device

    def chunk_nbytes(self, num_tokens: int) -> int:
        return self._cache.chunk_nbytes(num_tokens)

    def gather(
        self,
        block_ids: Sequence[int],
        start: int,
        end: int,
        out: torch.Tensor,
        hashed: bool = False,
    ) -> Copy:
        self._cache.gather(slot_mapping(block_ids, start, end, self.block_size), out)
        return COPIED

    def scatter(
        self,
        chunk: torch.Tensor,
        block_ids: Sequence[int],
        chunk_start: int,
        chunk_end: int,
        start: int,
        hashed: bool = False,
        model_waits: bool = True,
    ) -> Copy:
        first = max(chunk_start, start)
        slots = slot_mapping(block_ids, first, chunk_end, self.block_size)
        self._cache.scatter(chunk, slots, skip=first - chunk_start)
        return COPIED

    def adopt(self, buffer: torch.Tensor, *, loads: bool = True) -> None:
        return None

    def close(self) -> None:
        return None


def head_slice(cache: PagedKV, lo: int, hi: int) -> PagedKV:
    """``cache``'s KV heads ``lo .. hi`` (``BlockKV.heads``); ``ValueError`` for a format that
    cannot be cut by heads (token chunks are not yet)."""
    if not isinstance(cache, BlockKV):
        raise ValueError(
            f"a {cache.chunk_format.split(':', 1)[0]} cache is not cut by heads: prefill and "
            "decode at different tensor-parallel sizes need whole-block (vLLM's CPU engine) or "
            "MLA latent caches"
        )
    return cache.heads(lo, hi)


def recognise(
    kv_caches: dict[str, torch.Tensor],
    chunk_size: int,
    *,
    block_size: int | None = None,
    physical_order: str | None = None,
    packed_blocks: bool | None = None,
) -> PagedKV:
    """The cache vLLM gave this worker, as the format it moves.

    ``block_size``: vLLM's (tells a 5-D layer's token dimension from its head dimension).
    ``physical_order``: "NHD" or "HND" from vLLM's resolved layout, which tells them apart
    when the block size equals the number of heads. ``packed_blocks``: the engine's attention
    backend packs blocks (vLLM's CPU engine); None: decided by the tensors (4-D on CPU).
    """
    layers = list(kv_caches.values())
    if not layers:
        raise ValueError("vLLM registered no KV cache layers")
    sample = layers[0]
    if sample.dim() == 3:
        # vLLM's MLA layers: (blocks, block size, kv_lora_rank + qk_rope_head_dim).
        if sample.device.type != "cpu":
            raise ValueError(
                f"an MLA latent cache {tuple(sample.shape)} on {sample.device}: moving MLA "
                "caches is supported from CPU memory only (vLLM's CPU MLA backend), not yet "
                "from a GPU"
            )
        return BlockKV(layers, chunk_size)
    if packed_blocks is None:
        packed_blocks = sample.dim() == 4 and sample.device.type == "cpu"
    if packed_blocks:
        return BlockKV(layers, chunk_size)
    if sample.dim() == 4:
        # vLLM 0.32: (blocks, heads, block size, 2 * head size), K then V in the last dimension,
        # strides as the resolved layout has them (vllm/v1/attention/backends/flash_attn.py).
        views = vllm_nhd_views(layers)
        if block_size is not None and block_size != sample.shape[2]:
            views = [_manager_blocks(view, block_size) for view in views]
        return _token_kv(views, views[0].shape[2])
    if sample.dim() == 5 and sample.shape[0] == 2:
        layout = shape_order(sample, block_size, physical_order)
        views = layers if layout is KVLayout.NHD else [layer.transpose(2, 3) for layer in layers]
        return _token_kv(views, views[0].shape[2])
    raise ValueError(
        f"unrecognised KV cache layer {tuple(sample.shape)} {sample.dtype} on {sample.device}: "
        "expected vLLM's CPU blocks (4-D), an MLA latent cache (blocks, block size, width), "
        "its per-layer (blocks, heads, block size, 2 * head size) view, or a (2, blocks, ...) "
        "NHD or HND layer"
    )


def vllm_nhd_views(layers: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """vLLM 0.32's per-layer ``(blocks, heads, block size, 2 * head size)`` views (K then V in
    the last dimension, strides as the resolved layout has them) as ``(2, blocks, block size,
    heads, head size)`` NHD views of the same memory."""
    head_size = layers[0].shape[-1] // 2
    return [layer.unflatten(-1, (2, head_size)).permute(3, 0, 2, 1, 4) for layer in layers]


def shape_order(layer: torch.Tensor, block_size: int | None, physical: str | None) -> KVLayout:
    """Which of a ``(2, blocks, X, Y, head size)`` layer's middle dimensions is the token: by
    the block size where X and Y differ, else by vLLM's physical order and the strides (the
    token dimension is the outer one in NHD memory, the inner one in HND)."""
    first, second = layer.shape[2], layer.shape[3]
    if block_size is not None and first != second:
        if block_size not in (first, second):
            raise ValueError(f"block size {block_size} is neither of {tuple(layer.shape)}")
        return KVLayout.NHD if first == block_size else KVLayout.HND
    if physical not in PHYSICAL_ORDERS:
        raise ValueError(
            f"cannot tell tokens from heads in {tuple(layer.shape)}: give vLLM's block size "
            f"and layout (NHD or HND), got {block_size}, {physical}"
        )
    token_outer = physical == "NHD"
    first_outer = layer.stride(2) >= layer.stride(3)
    return KVLayout.NHD if first_outer == token_outer else KVLayout.HND


def _manager_blocks(view: torch.Tensor, block_size: int) -> torch.Tensor:
    """An NHD view of kernel blocks (vLLM splits a block into smaller ones for some attention
    kernels) as one of vLLM's blocks, which block ids name: possible without a copy only where a
    block's kernel blocks follow each other token after token (a dense NHD page)."""
    kv, blocks, kernel_block, heads, head_size = view.shape
    ratio = block_size // kernel_block
    if block_size % kernel_block or blocks % ratio:
        raise ValueError(f"block size {block_size} is not whole kernel blocks of {kernel_block}")
    try:
        return view.unflatten(1, (blocks // ratio, ratio)).view(
            kv, blocks // ratio, block_size, heads, head_size
        )
    except RuntimeError as exc:
        raise ValueError(
            f"kernel blocks of {kernel_block} tokens do not follow each other inside vLLM's "
            f"blocks of {block_size} in this layout (strides {view.stride()}): use a block "
            "size equal to the kernel's, or a layer-compact NHD layout (LBNHC)"
        ) from exc


def _token_kv(views: list[torch.Tensor], block_size: int) -> PagedKV:
    if views[0].device.type == "cuda":
        # Imported here: it needs a CUDA device (and Triton), which CPU machines lack.
        from lmcache_pd.kernels.cuda_kv import CudaTokenKV

        return CudaTokenKV(views, block_size)
    return TokenKV(views, block_size)
