"""Token-level gather/scatter on GPU with one Triton launch for all layers.

Same layouts, chunk format and checks as ``token_layout`` (whose torch path is the reference):
where that path makes one ``index_select`` per layer, this makes one launch over a grid of
(token, layer * 2 + K/V), each program copying all heads of one token. Layers are reached through
a device table of their addresses, so they need not live in one buffer, but they must share shape
and strides (vLLM allocates them alike).

Triton is optional: it comes with CUDA builds of torch and is useless on CPU. This module imports
without it; calling a function without it raises ``ImportError`` saying so. With
``TRITON_INTERPRET=1`` (set before Triton is imported) the kernel also runs, slowly, on CPU
tensors in Triton's interpreter: that is how it is tested on machines without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType

import torch

from .token_layout import KVLayout, check_slot_mapping, nhd_views, typed_chunk


def triton_available() -> bool:
    """Whether the Triton path can run here: Triton imports and a CUDA device is present."""
    try:
        _kernel_module()
    except ImportError:
        return False
    return torch.cuda.is_available()


def gather_tokens_triton(
    layers: Sequence[torch.Tensor], slot_mapping: torch.Tensor, out: torch.Tensor, layout: KVLayout
) -> None:
    """:func:`lmcache_pd.kernels.token_layout.gather_tokens` for CUDA tensors, in one launch."""
    _launch(layers, slot_mapping, out, layout, to_cache=False)


def scatter_tokens_triton(
    chunk: torch.Tensor,
    layers: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    layout: KVLayout,
) -> None:
    """:func:`lmcache_pd.kernels.token_layout.scatter_tokens` for CUDA tensors, in one launch."""
    _launch(layers, slot_mapping, chunk, layout, to_cache=True)


def _launch(
    layers: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    chunk: torch.Tensor,
    layout: KVLayout,
    *,
    to_cache: bool,
) -> None:
    kernels = _kernel_module()
    views = nhd_views(layers, layout)
    sample = views[0]
    if sample.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the Triton path moves CUDA tensors, the cache is on {sample.device}")
    num_tokens = check_slot_mapping(slot_mapping, sample, unique=to_cache)
    typed = typed_chunk(chunk, views, num_tokens)
    _, _, block_size, num_heads, head_size = sample.shape
    stride_kv, stride_block, stride_token, stride_head, _ = sample.stride()
    # One small host-to-device copy per call: the layers are whatever the caller passes now.
    layer_ptrs = torch.tensor(
        [v.data_ptr() for v in views], dtype=torch.int64, device=sample.device
    )
    grid = (num_tokens, 2 * len(views))
    kernels.copy_tokens_kernel[grid](
        layer_ptrs,
        typed,
        slot_mapping.to(torch.int64),
        num_tokens,
        block_size,
        stride_kv,
        stride_block,
        stride_token,
        stride_head,
        NUM_HEADS=num_heads,
        HEAD_SIZE=head_size,
        HEADS_POW2=_next_pow2(num_heads),
        HEAD_SIZE_POW2=_next_pow2(head_size),
        TO_CACHE=to_cache,
    )


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
