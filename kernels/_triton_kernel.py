"""The Triton kernel behind ``triton_layout``; it imports Triton, so only that module imports it.

No ``from __future__ import annotations`` here: Triton reads the ``tl.constexpr`` annotations.
"""

import triton
import triton.language as tl

# A plan row: one chunk of a launch (int64 each). Triton reads globals only as constexprs.
PLAN_CHUNK = tl.constexpr(0)  # the chunk's first value, counted from chunk_ptr
PLAN_BLOCK = tl.constexpr(
    1
)  # the index in the block table of the block holding the first token copied
PLAN_FIRST = tl.constexpr(2)  # where in that block the first token copied is
PLAN_TOKENS = tl.constexpr(3)  # tokens copied
PLAN_SKIP = tl.constexpr(
    4
)  # the chunk's tokens before the first copied (a load past decode's own hit)
PLAN_ROW = tl.constexpr(5)


@triton.jit
def copy_kv_kernel(
    cache_ptr,  # the lowest layer's first value, as integers of the cache's width
    layer_offsets,  # int64[num_layers]: each layer's first value, counted from cache_ptr
    chunk_ptr,  # the lowest chunk's first value, same integers; a chunk: [K/V][layer][token][...]
    plan_ptr,  # int64[chunks, PLAN_ROW]: what each chunk of the launch copies (above)
    block_ptr,  # int64: the request's block table
    stride_block,  # value strides of every layer's (2, blocks, block size, heads, dim) view
    stride_token,
    stride_head,
    stride_kv,
    NUM_LAYERS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_POW2: tl.constexpr,  # tl.arange needs powers of two; the mask trims them
    HEAD_SIZE_POW2: tl.constexpr,
    TILE: tl.constexpr,  # tokens per program
    ALIGN: tl.constexpr,  # every layer and chunk starts a multiple of this many values in
    TO_CACHE: tl.constexpr,  # scatter (chunk -> cache) when true, else gather
):
    """One program per (TILE tokens, layer, chunk): K and V of every head of those tokens, both
    loads issued before either store. A launch covers every chunk of a load, each described by
    a plan row, and tokens are found as vLLM finds them, through the request's block table: per
    load the host sends a plan and a block table, not a slot per token, and launches once. Each
    head's values are one contiguous run on both sides, and the offsets' divisibility is known
    (strides specialised on 16, layer and chunk starts asserted aligned), so loads and stores
    are as wide as the hardware allows. Values move as integers of their own width: every bit
    pattern survives."""
    layer = tl.program_id(1)
    row = plan_ptr + tl.program_id(2).to(tl.int64) * PLAN_ROW
    num_tokens = tl.load(row + PLAN_TOKENS)
    tokens = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
    live = tokens < num_tokens
    skip = tl.load(row + PLAN_SKIP)
    chunk_start = tl.multiple_of(tl.load(row + PLAN_CHUNK), ALIGN)
    position = tl.load(row + PLAN_FIRST) + tokens
    table = block_ptr + tl.load(row + PLAN_BLOCK)
    blocks = tl.load(table + position // BLOCK_SIZE, mask=live, other=0)
    layer_base = tl.multiple_of(tl.load(layer_offsets + layer), ALIGN)
    token_base = layer_base + blocks * stride_block + (position % BLOCK_SIZE) * stride_token
    heads = tl.arange(0, HEADS_POW2)
    dims = tl.arange(0, HEAD_SIZE_POW2)
    cache_k = token_base[:, None, None] + (heads * stride_head)[None, :, None] + dims[None, None, :]
    width = NUM_HEADS * HEAD_SIZE
    chunk_tokens = skip + num_tokens
    chunk_token = layer * chunk_tokens + skip + tokens
    chunk_k = chunk_start + (chunk_token * width)[:, None, None]
    chunk_k += (heads * HEAD_SIZE)[None, :, None] + dims[None, None, :]
    v_shift = NUM_LAYERS * chunk_tokens * width
    mask = live[:, None, None]
    if HEADS_POW2 != NUM_HEADS:
        mask = mask & (heads < NUM_HEADS)[None, :, None]
    if HEAD_SIZE_POW2 != HEAD_SIZE:
        mask = mask & (dims < HEAD_SIZE)[None, None, :]
    if TO_CACHE:
        k = tl.load(chunk_ptr + chunk_k, mask=mask)
        v = tl.load(chunk_ptr + chunk_k + v_shift, mask=mask)
        tl.store(cache_ptr + cache_k, k, mask=mask)
        tl.store(cache_ptr + cache_k + stride_kv, v, mask=mask)
    else:
        k = tl.load(cache_ptr + cache_k, mask=mask)
        v = tl.load(cache_ptr + cache_k + stride_kv, mask=mask)
        tl.store(chunk_ptr + chunk_k, k, mask=mask)
        tl.store(chunk_ptr + chunk_k + v_shift, v, mask=mask)
