"""Token-level gather/scatter on GPU with one Triton launch for all layers.

Same layouts, chunk format (``KV_2LTD``) and checks as ``token_layout``, whose torch path is the
reference: where that path makes one ``index_select`` over rows, this makes one launch over a
grid of (token, K/V * num_layers + layer), each program copying all heads of one token. Layers
are reached through a device table of their addresses, so they need not live in one buffer, but
they must share shape and strides (vLLM allocates them alike). Values move as integers of their
own width: no float conversion can touch a bit.

:class:`TritonTokenKV` checks the layers and puts their addresses on the device once, and its
calls trust slot mappings already on the device that the caller checked on the host: checking
there (a min, a max) would wait for the GPU, and the connector copies on a stream of its own
precisely so that its thread never waits for the model's work. The free functions check
everything on every call.

Triton is optional: it comes with CUDA builds of torch and is useless on CPU. This module imports
without it; using it without Triton raises ``ImportError`` saying so. With ``TRITON_INTERPRET=1``
(set before Triton is imported) the kernel also runs, slowly, on CPU tensors in Triton's
interpreter: that is how it is tested on machines without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType

import torch

from .token_layout import KVLayout, check_slot_mapping, nhd_views, typed_chunk

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
    layers: Sequence[torch.Tensor], slot_mapping: torch.Tensor, out: torch.Tensor, layout: KVLayout
) -> None:
    """:func:`lmcache_pd.kernels.token_layout.gather_tokens` for CUDA tensors, in one launch."""
    cache = TritonTokenKV(layers, layout)
    check_slot_mapping(slot_mapping, cache.views[0], unique=False)
    cache.gather(slot_mapping.to(torch.int64), out)


def scatter_tokens_triton(
    chunk: torch.Tensor,
    layers: Sequence[torch.Tensor],
    slot_mapping: torch.Tensor,
    layout: KVLayout,
) -> None:
    """:func:`lmcache_pd.kernels.token_layout.scatter_tokens` for CUDA tensors, in one launch."""
    cache = TritonTokenKV(layers, layout)
    check_slot_mapping(slot_mapping, cache.views[0], unique=True)
    cache.scatter(chunk, slot_mapping.to(torch.int64))


class TritonTokenKV:
    """A CUDA token-layout cache for the Triton kernel, its layers checked once."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout) -> None:
        self._kernels = _kernel_module()
        self.views = nhd_views(layers, layout)
        sample = self.views[0]
        if sample.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the Triton path moves CUDA tensors, the cache is on {sample.device}")
        self._integer = _INTEGERS[sample.element_size()]
        # Made once: a host-to-device copy per call would wait for the stream it runs on.
        self._layer_ptrs = torch.tensor(
            [view.data_ptr() for view in self.views], dtype=torch.int64, device=sample.device
        )

    def gather(self, slots: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the tokens at ``slots`` (int64, on the cache's device, checked by the caller)
        into ``out``, on the current stream."""
        self._launch(slots, out, skip=0, to_cache=False)

    def scatter(self, chunk: torch.Tensor, slots: torch.Tensor, skip: int = 0) -> None:
        """Write the chunk's tokens from ``skip`` on into ``slots`` (int64, on the cache's
        device, distinct, checked by the caller), on the current stream."""
        self._launch(slots, chunk, skip=skip, to_cache=True)

    def _launch(
        self, slots: torch.Tensor, chunk: torch.Tensor, *, skip: int, to_cache: bool
    ) -> None:
        if slots.dtype != torch.int64 or slots.dim() != 1 or slots.device != chunk.device:
            raise ValueError(f"slots must be 1-D int64 on {chunk.device}, got {slots.dtype}")
        num_tokens = slots.numel()
        typed = typed_chunk(chunk, self.views, skip + num_tokens).view(self._integer)
        sample = self.views[0]
        _, _, block_size, num_heads, head_size = sample.shape
        stride_kv, stride_block, stride_token, stride_head, _ = sample.stride()
        grid = (num_tokens, 2 * len(self.views))
        self._kernels.copy_tokens_kernel[grid](
            self._layer_ptrs,
            typed,
            slots,
            len(self.views),
            skip + num_tokens,
            skip,
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
