"""Token-level gather/scatter between GPU-style paged KV caches and chunk buffers (torch).

GPU attention backends store K and V per token, so unlike the CPU cache (``cpu_blocks``) a chunk
can be cut at any token. vLLM's FlashAttention backend (vllm-project/vllm
``vllm/v1/attention/backends/flash_attn.py``, ``get_kv_cache_shape`` and
``get_kv_cache_stride_order``) allocates per layer

- NHD: ``(2, num_blocks, block_size, num_kv_heads, head_size)``, the default;
- HND: ``(2, num_blocks, num_kv_heads, block_size, head_size)``, the physical order when
  ``VLLM_KV_CACHE_LAYOUT=HND`` (stride order ``(0, 1, 3, 2, 4)``).

Only the order of the dimensions matters here, not the strides, as long as each head's
``head_size`` values are contiguous; so other backends need only a view, no copy:

- FlashInfer (``vllm/v1/attention/backends/flashinfer.py``) puts the block first,
  ``(num_blocks, 2, block_size | num_kv_heads, ...)``: pass ``cache.transpose(0, 1)``;
- the newest vLLM hands every layer a 4-D ``(num_blocks, num_kv_heads, block_size,
  2 * head_size)`` view, K and V side by side in the last dimension
  (``vllm/v1/kv_cache_interface.py``, ``compute_layer_kv_cache_shape_bytes``): pass
  ``cache.unflatten(-1, (2, head_size)).permute(3, 0, 2, 1, 4)`` as NHD.

Token ``i`` of a chunk lives at ``slot_mapping[i] = block_id * block_size + offset``. The chunk
buffer is ``[layer][K/V][token][head][dim]`` in the cache's dtype; any contiguous tensor of
exactly that many bytes will do (a uint8 page of a staging buffer, say). The copies are one
``index_select``/``index_copy_`` per layer over rows of ``num_kv_heads * head_size`` values
(where a token's heads are adjacent) or of ``head_size`` values: this is the reference path, and
the CPU stand-in for ``triton_layout``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

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
    return views


def token_chunk_nbytes(layers: Sequence[torch.Tensor], num_tokens: int, layout: KVLayout) -> int:
    """Bytes of a chunk of ``num_tokens`` tokens of every layer."""
    if num_tokens < 1:
        raise ValueError(f"a chunk holds at least one token, got {num_tokens}")
    sample = nhd_views(layers, layout)[0]
    _, _, _, num_heads, head_size = sample.shape
    return len(layers) * 2 * num_tokens * num_heads * head_size * sample.element_size()


def gather_tokens(
    layers: Sequence[torch.Tensor], slot_mapping: torch.Tensor, out: torch.Tensor, layout: KVLayout
) -> None:
    """Copy the tokens at ``slot_mapping`` of every layer into ``out``,
    ordered [layer][K/V][token][head][dim]."""
    views = nhd_views(layers, layout)
    chunk = typed_chunk(out, views, check_slot_mapping(slot_mapping, views[0], unique=False))
    rows, width = _rows(views[0], slot_mapping)
    for index, view in enumerate(views):
        torch.index_select(_table(view, width), 0, rows, out=chunk[index].view(-1, width))


def scatter_tokens(
    chunk: torch.Tensor,
    layers: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    layout: KVLayout,
) -> None:
    """The inverse of :func:`gather_tokens`: write ``chunk`` into the slots ``slot_mapping``."""
    views = nhd_views(layers, layout)
    typed = typed_chunk(chunk, views, check_slot_mapping(slot_mapping, views[0], unique=True))
    rows, width = _rows(views[0], slot_mapping)
    for index, view in enumerate(views):
        _table(view, width).index_copy_(0, rows, typed[index].view(-1, width))


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
    """``chunk`` seen as ``(layers, 2, num_tokens, num_kv_heads, head_size)`` in the cache's
    dtype; it must be contiguous, on the cache's device, and exactly that many bytes."""
    sample = views[0]
    shape = (len(views), 2, num_tokens, sample.shape[3], sample.shape[4])
    expected = (
        2 * len(views) * num_tokens * sample.shape[3] * sample.shape[4] * sample.element_size()
    )
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


def _rows(view: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Rows of :func:`_table` holding the slots, in chunk order [K/V][token](head), and the
    row width (see :func:`_row_width`)."""
    _, _, block_size, num_heads, head_size = view.shape
    stride_kv, stride_block, stride_token, stride_head, _ = view.stride()
    width = _row_width(view)
    slots = slot_mapping.to(torch.int64)
    token = (slots // block_size) * stride_block + (slots % block_size) * stride_token
    kv = torch.arange(2, device=view.device) * stride_kv
    offsets = kv[:, None] + token[None, :]
    if width == head_size:
        heads = torch.arange(num_heads, device=view.device) * stride_head
        offsets = offsets[..., None] + heads
    return (offsets // width).reshape(-1), width


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


def _table(view: torch.Tensor, width: int) -> torch.Tensor:
    """The memory ``view`` spans as rows of ``width`` values: the strides checked in
    :func:`_row_width` make every row of a slot start on a row boundary."""
    span = 1 + sum(
        (size - 1) * stride for size, stride in zip(view.shape, view.stride(), strict=True)
    )
    return view.as_strided((span // width, width), (width, 1), view.storage_offset())


def _signature(view: torch.Tensor) -> tuple[object, ...]:
    return view.shape, view.stride(), view.dtype, view.device


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {tensor.dtype} strides {tensor.stride()} on {tensor.device}"
