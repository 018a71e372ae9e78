"""The Triton kernel behind ``triton_layout``; it imports Triton, so only that module imports it.

No ``from __future__ import annotations`` here: Triton reads the ``tl.constexpr`` annotations.
"""

import triton
import triton.language as tl


@triton.jit
def copy_tokens_kernel(
    layer_ptrs,  # int64[num_layers]: the address of each layer's cache
    chunk_ptr,  # the chunk, in the cache's dtype: [layer][K/V][token][head][dim]
    slot_ptr,  # int64[num_tokens]: block_id * block_size + offset of each token
    num_tokens,
    block_size,
    stride_kv,  # element strides of every layer's (2, blocks, block_size, heads, dim) view
    stride_block,
    stride_token,
    stride_head,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_POW2: tl.constexpr,  # tl.arange needs powers of two; the mask trims them
    HEAD_SIZE_POW2: tl.constexpr,
    TO_CACHE: tl.constexpr,  # scatter (chunk -> cache) when true, else gather
):
    """One program per (token, layer * 2 + K/V): all heads of one token of one layer's K or V."""
    token = tl.program_id(0).to(tl.int64)
    layer_kv = tl.program_id(1).to(tl.int64)
    layer = layer_kv // 2
    kv = layer_kv % 2
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block = slot // block_size
    offset = slot % block_size
    cache_ptr = tl.load(layer_ptrs + layer).to(tl.pointer_type(chunk_ptr.dtype.element_ty))

    heads = tl.arange(0, HEADS_POW2)[:, None].to(tl.int64)
    dims = tl.arange(0, HEAD_SIZE_POW2)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_SIZE)
    cache_offsets = (
        kv * stride_kv + block * stride_block + offset * stride_token + heads * stride_head + dims
    )
    chunk_offsets = ((layer_kv * num_tokens + token) * NUM_HEADS + heads) * HEAD_SIZE + dims
    if TO_CACHE:
        values = tl.load(chunk_ptr + chunk_offsets, mask=mask)
        tl.store(cache_ptr + cache_offsets, values, mask=mask)
    else:
        values = tl.load(cache_ptr + cache_offsets, mask=mask)
        tl.store(chunk_ptr + chunk_offsets, values, mask=mask)
