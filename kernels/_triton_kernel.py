"""The Triton kernel behind ``triton_layout``; it imports Triton, so only that module imports it.

No ``from __future__ import annotations`` here: Triton reads the ``tl.constexpr`` annotations.
"""

import triton
import triton.language as tl


@triton.jit
def copy_tokens_kernel(
    layer_ptrs,  # int64[num_layers]: the address of each layer's cache
    chunk_ptr,  # the chunk as integers of the cache's width: [K/V][layer][token][head][dim]
    slot_ptr,  # int64[num_tokens]: block_id * block_size + offset of each token copied
    num_layers,
    chunk_tokens,  # tokens the chunk holds; the copy covers tokens skip .. skip + num_tokens
    skip,
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
    """One program per (token, K/V * num_layers + layer): all heads of one token of one layer's
    K or V. Values move as integers of their own width, so every bit pattern survives."""
    token = tl.program_id(0).to(tl.int64)
    kv_layer = tl.program_id(1).to(tl.int64)
    kv = kv_layer // num_layers
    layer = kv_layer % num_layers
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
    chunk_token = kv_layer * chunk_tokens + skip + token
    chunk_offsets = (chunk_token * NUM_HEADS + heads) * HEAD_SIZE + dims
    if TO_CACHE:
        values = tl.load(chunk_ptr + chunk_offsets, mask=mask)
        tl.store(cache_ptr + cache_offsets, values, mask=mask)
    else:
        values = tl.load(cache_ptr + cache_offsets, mask=mask)
        tl.store(chunk_ptr + chunk_offsets, values, mask=mask)
