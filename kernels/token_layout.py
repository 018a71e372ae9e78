"""Token-level gather/scatter between GPU-style paged KV caches and tokens-major chunks (torch).

GPU attention backends store K and V per token, so unlike the CPU cache (``cpu_blocks``) a chunk
can be cut at any token. A layer is seen as a ``(2, num_blocks, block_size, num_kv_heads,
head_size)`` tensor (K/V, block, token, head, dim) with any strides that keep each head's
``head_size`` values contiguous; :class:`KVLayout` says which of the given tensor's dimensions
is the token and which the head:

- NHD: ``(2, num_blocks, block_size, num_kv_heads, head_size)``, FlashAttention's default
  (vllm-project/vllm ``vllm/v1/attention/backends/flash_attn.py``, ``get_kv_cache_shape``);
- HND: ``(2, num_blocks, num_kv_heads, block_size, head_size)``, its order with
  ``VLLM_KV_CACHE_LAYOUT=HND`` (stride order ``(0, 1, 3, 2, 4)``).

Other arrangements need only a view, no copy: FlashInfer's ``(num_blocks, 2, ...)`` is
``cache.transpose(0, 1)``; vLLM 0.32 hands every layer a 4-D ``(num_blocks, num_kv_heads,
block_size, 2 * head_size)`` view whose strides follow the resolved layout (``LBNHC`` is NHD in
memory, ``LBHNC`` HND; ``vllm/v1/kv_cache_layout.py``), which is
``cache.unflatten(-1, (2, head_size)).permute(3, 0, 2, 1, 4)`` as NHD whatever its strides.

The chunk is tokens-major and independent of the cache's layout, as LMCache's ``KV_2LTD``:
``[K/V][layer][token][head][dim]`` in the cache's dtype, so an NHD producer feeds an HND
consumer. Token ``i`` of a chunk lives at ``slot_mapping[i] = block_id * block_size + offset``.

How it copies: the cache's memory is seen as a table of rows, each the values of one chunk row
(all heads of a run of tokens that follow each other in a block, where a token's heads are
adjacent as in NHD, else one head of one token), and a chunk is one ``index_select`` over every
layer (one per layer and K/V when the layers do not share one buffer). A scatter on CPU assigns
whole rows with numpy as opaque items: ``index_copy_`` ran at 2.6-7.7 GB/s where that runs at
9-14 (memcpy 14) on one core here. ``benchmarks/kernels.py`` measures both against memcpy.
This is also the reference for ``triton_layout``, the GPU path.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch


class KVLayout(enum.Enum):
    """The dimension order of one layer's cache, after the leading K/V dimension."""

    NHD = "NHD"  # (2, num_blocks, block_size, num_kv_heads, head_size)
    HND = "HND"  # (2, num_blocks, num_kv_heads, block_size, head_size)


def nhd_views(layers: Sequence[torch.Tensor], layout: KVLayout) -> list[torch.Tensor]:
    """Each layer as a ``(2, num_blocks, block_size, num_kv_heads, head_size)`` view (no copy),
    checked to share shape, strides, dtype and device and to keep each head's values contiguous."""
    if not layers:
        raise ValueError("no layers")
    views = []
    for layer in layers:
        if layer.dim() != 5 or layer.shape[0] != 2:
            raise ValueError(
                f"a {layout.value} layer is (2, num_blocks, ...) with 5 dimensions, got "
                f"{_describe(layer)}"
            )
        views.append(layer if layout is KVLayout.NHD else layer.transpose(2, 3))
    sample = views[0]
    for view in views:
        if _signature(view) != _signature(sample):
            raise ValueError(f"layers differ: {_describe(view)} vs {_describe(sample)}")
    if sample.stride(4) != 1:
        raise ValueError(f"each head's values must be contiguous, got {_describe(sample)}")
    _row_width(sample)
    return views


def token_chunk_nbytes(layers: Sequence[torch.Tensor], num_tokens: int, layout: KVLayout) -> int:
    """Bytes of a chunk of ``num_tokens`` tokens of every layer."""
    return TokenKVCache(layers, layout).chunk_nbytes(num_tokens)


def gather_tokens(
    layers: Sequence[torch.Tensor], slot_mapping: torch.Tensor, out: torch.Tensor, layout: KVLayout
) -> None:
    """Copy the tokens at ``slot_mapping`` of every layer into ``out``,
    ordered [K/V][layer][token][head][dim]. Checks ``layers`` on every call: where it runs per
    request, build a :class:`TokenKVCache` once."""
    TokenKVCache(layers, layout).gather(slot_mapping, out)


def scatter_tokens(
    chunk: torch.Tensor,
    layers: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    layout: KVLayout,
) -> None:
    """The inverse of :func:`gather_tokens`: write ``chunk`` into the slots ``slot_mapping``."""
    TokenKVCache(layers, layout).scatter(chunk, slot_mapping)


class TokenKVCache:
    """The layers of one token-layout cache, checked once, so that a gather or scatter costs only
    its copies and the checks of its own arguments."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout) -> None:
        self._views = nhd_views(layers, layout)
        sample = self._views[0]
        _, num_blocks, self.block_size, self.num_heads, self.head_size = sample.shape
        self.num_layers = len(self._views)
        self.num_slots = num_blocks * self.block_size
        self.dtype, self.device = sample.dtype, sample.device
        # One chunk token: K and V of every layer.
        self.token_nbytes = 2 * self.num_layers * self.num_heads * self.head_size
        self.token_nbytes *= sample.element_size()
        self._width = _row_width(sample)
        self._bases = _layer_bases(self._views)
        # Tables of rows by (layer or None for all, width): a handful, built on first use.
        self._tables: dict[tuple[int | None, int], torch.Tensor] = {}

    def chunk_nbytes(self, num_tokens: int) -> int:
        """Bytes of a chunk of ``num_tokens`` tokens."""
        if num_tokens < 1:
            raise ValueError(f"a chunk holds at least one token, got {num_tokens}")
        return num_tokens * self.token_nbytes

    def gather(self, slot_mapping: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the tokens at ``slot_mapping`` into ``out`` (see :func:`gather_tokens`)."""
        num_tokens = check_slot_mapping(slot_mapping, self._views[0], unique=False)
        typed = typed_chunk(out, self._views, num_tokens)
        width, starts = self._rows(slot_mapping)
        for table, rows, chunk_rows in self._pieces(width, starts, typed):
            torch.index_select(table, 0, rows.reshape(-1), out=chunk_rows.view(-1, width))

    def scatter(self, chunk: torch.Tensor, slot_mapping: torch.Tensor, skip: int = 0) -> None:
        """Write the chunk's tokens from ``skip`` on into the slots ``slot_mapping`` (one slot
        per token written): a load that starts inside a chunk writes only its later tokens."""
        num_tokens = check_slot_mapping(slot_mapping, self._views[0], unique=True)
        if skip < 0:
            raise ValueError(f"skip must be >= 0, got {skip}")
        typed = typed_chunk(chunk, self._views, skip + num_tokens)[:, :, skip:]
        width, starts = self._rows(slot_mapping)
        for table, rows, chunk_rows in self._pieces(width, starts, typed):
            if table.device.type == "cpu":
                _as_items(table)[rows.numpy()] = _as_items(chunk_rows)
            else:
                table.index_copy_(0, rows.reshape(-1), chunk_rows.reshape(-1, width))

    def _rows(self, slot_mapping: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The row width in values and the offset of each chunk row's first value from its
        layer's start (K), in chunk order: per run of tokens, or per token and head."""
        sample = self._views[0]
        _, stride_block, stride_token, stride_head, _ = sample.stride()
        slots = slot_mapping.to(torch.int64)
        token = (slots // self.block_size) * stride_block + (slots % self.block_size) * stride_token
        if self._width == self.head_size and self.num_heads > 1:
            heads = torch.arange(self.num_heads, device=slots.device) * stride_head
            return self._width, (token[:, None] + heads).reshape(-1)
        run = self._run_length(token)
        return run * self._width, token[::run]

    def _run_length(self, token: torch.Tensor) -> int:
        """The most tokens per row: a power of two dividing the block size and the token count
        such that each row's tokens follow each other in memory and start on a row boundary."""
        stride_kv, _, stride_token, _, _ = self._views[0].stride()
        if stride_token != self._width:
            return 1
        run = self.block_size & -self.block_size  # its largest power-of-two divisor
        while run > 1:
            width = run * self._width
            if token.numel() % run == 0 and stride_kv % width == 0:
                runs = token.view(-1, run)
                steps = torch.arange(run, device=token.device) * stride_token
                if bool((runs[:, :1] % width == 0).all()) and torch.equal(
                    runs - runs[:, :1], steps.expand_as(runs)
                ):
                    return run
            run //= 2
        return 1

    def _table(self, layer: int | None, width: int) -> torch.Tensor:
        """The rows of one layer, or of every layer (``None``), built once per width."""
        table = self._tables.get((layer, width))
        if table is None:
            views = self._views if layer is None else [self._views[layer]]
            table = self._tables[(layer, width)] = _table(views, width)
        return table

    def _pieces(
        self, width: int, starts: torch.Tensor, typed: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(table of rows, row indices, the chunk's matching rows): one piece covering every
        layer when they share a buffer at offsets of whole rows, else one per layer and K/V."""
        # Every offset is a whole number of rows: divided before they are added up (an int64
        # division of every row index cost more than the copy of HND's small rows).
        kv = torch.arange(2, device=starts.device) * (self._views[0].stride(0) // width)
        starts = starts // width
        shape = (2, self.num_layers, starts.numel(), width)
        if self._bases is not None and not any(base % width for base in self._bases):
            bases = torch.tensor([base // width for base in self._bases], device=starts.device)
            rows = kv[:, None, None] + bases[None, :, None] + starts[None, None, :]
            yield self._table(None, width), rows, typed.reshape(shape)
            return
        for index in range(self.num_layers):
            table = self._table(index, width)
            for half in range(2):
                yield table, kv[half] + starts, typed[half, index].reshape(-1, width)


def check_slot_mapping(slot_mapping: torch.Tensor, view: torch.Tensor, *, unique: bool) -> int:
    """The number of tokens; raises ``ValueError`` for a slot outside ``view``'s cache, or for a
    repeated slot where ``unique`` (two chunk tokens cannot land in one slot)."""
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"slot_mapping must be a 1-D int32/int64 tensor, got {_describe(slot_mapping)}"
        )
    if slot_mapping.device != view.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device}, the cache on {view.device}")
    if slot_mapping.numel() == 0:
        raise ValueError("slot_mapping is empty: a chunk holds at least one token")
    num_slots = view.shape[1] * view.shape[2]
    low, high = int(slot_mapping.min()), int(slot_mapping.max())
    if low < 0 or high >= num_slots:
        raise ValueError(f"slots {low}..{high} fall outside the cache's {num_slots} slots")
    if unique and torch.unique(slot_mapping).numel() != slot_mapping.numel():
        raise ValueError("slot_mapping names a slot twice")
    return slot_mapping.numel()


def typed_chunk(
    chunk: torch.Tensor, views: Sequence[torch.Tensor], num_tokens: int
) -> torch.Tensor:
    """``chunk`` seen as ``(2, layers, num_tokens, num_kv_heads, head_size)`` in the cache's
    dtype; it must be contiguous, on the cache's device, and exactly that many bytes."""
    sample = views[0]
    shape = (2, len(views), num_tokens, sample.shape[3], sample.shape[4])
    expected = torch.Size(shape).numel() * sample.element_size()
    if not chunk.is_contiguous() or chunk.device != sample.device:
        raise ValueError(
            f"the chunk must be contiguous and on {sample.device}, got {_describe(chunk)}"
        )
    if chunk.numel() * chunk.element_size() != expected:
        raise ValueError(
            f"the chunk has {chunk.numel() * chunk.element_size()} bytes, {shape} of "
            f"{sample.dtype} need {expected}"
        )
    return chunk.reshape(-1).view(torch.uint8).view(sample.dtype).view(shape)


def _row_width(view: torch.Tensor) -> int:
    """The widest row that holds whole heads of one slot: all its heads where they are adjacent
    (NHD), else one head (HND)."""
    _, _, _, num_heads, head_size = view.shape
    stride_kv, stride_block, stride_token, stride_head, _ = view.stride()
    outer = (stride_kv, stride_block, stride_token)
    if stride_head == head_size and not any(s % (num_heads * head_size) for s in outer):
        return num_heads * head_size
    if not any(s % head_size for s in (*outer, stride_head)):
        return head_size
    raise ValueError(f"strides {view.stride()} split a head's values across rows")


def _layer_bases(views: Sequence[torch.Tensor]) -> list[int] | None:
    """Each layer's first value, counted from the lowest layer's, when every layer lies in one
    buffer (as vLLM allocates them); else None."""
    storage = views[0].untyped_storage().data_ptr()
    if any(view.untyped_storage().data_ptr() != storage for view in views):
        return None
    low = min(view.storage_offset() for view in views)
    return [view.storage_offset() - low for view in views]


def _table(views: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """The memory ``views`` span (one buffer), from the lowest layer's first value, as rows of
    ``width`` values: the strides checked in :func:`_row_width` and the row plan make every row
    of a slot start on a row boundary."""
    low = min(views, key=lambda view: view.storage_offset())
    end = max(
        view.storage_offset()
        + 1
        + sum((size - 1) * stride for size, stride in zip(view.shape, view.stride(), strict=True))
        for view in views
    )
    span = end - low.storage_offset()
    return low.as_strided((span // width, width), (width, 1), low.storage_offset())


def _as_items(rows: torch.Tensor) -> np.ndarray:
    """A CPU tensor of rows (last dimension contiguous) as a numpy array of opaque row-sized
    items: numpy copies each with one memcpy."""
    raw = rows.view(torch.uint8).numpy()
    return raw.view(f"V{raw.shape[-1]}")[..., 0]


def _signature(view: torch.Tensor) -> tuple[object, ...]:
    return view.shape, view.stride(), view.dtype, view.device


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {tensor.dtype} strides {tensor.stride()} on {tensor.device}"


def token_chunk_format(cache: TokenKVCache) -> str:
    """``tokens:KV_2LTD:<layers>x<heads*head size>:<dtype>``: what a token chunk's bytes are."""
    hidden = cache.num_heads * cache.head_size
    return f"tokens:KV_2LTD:{cache.num_layers}x{hidden}:{dtype_name(cache.dtype)}"


def slot_mapping(block_ids: Sequence[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """The slots of a request's tokens ``start .. end``: ``block * block_size + offset``."""
    if not 0 <= start < end:
        raise ValueError(f"no tokens in {start}..{end}")
    if math.ceil(end / block_size) > len(block_ids):
        raise ValueError(f"tokens up to {end} need more than the request's {len(block_ids)} blocks")
    tokens = torch.arange(start, end)
    blocks = torch.tensor(block_ids, dtype=torch.int64)[tokens // block_size]
    return blocks * block_size + tokens % block_size


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: the dtype as chunk formats and profiles name it."""
    return str(dtype).removeprefix("torch.")
