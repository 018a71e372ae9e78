"""Paged-KV gather/scatter between vLLM's cache and chunk buffers (torch on CPU, Triton on GPU)."""

from .cpu_blocks import (
    CpuKVCache,
    blocks_for_tokens,
    chunk_nbytes,
    gather_blocks,
    scatter_blocks,
    validate_chunk_size,
)
from .token_layout import (
    KVLayout,
    TokenKVCache,
    gather_tokens,
    nhd_views,
    scatter_tokens,
    token_chunk_nbytes,
)
from .triton_layout import (
    TritonTokenKV,
    gather_tokens_triton,
    scatter_tokens_triton,
    triton_available,
)

__all__ = [
    "CpuKVCache",
    "KVLayout",
    "TokenKVCache",
    "TritonTokenKV",
    "blocks_for_tokens",
    "chunk_nbytes",
    "gather_blocks",
    "gather_tokens",
    "gather_tokens_triton",
    "nhd_views",
    "scatter_blocks",
    "scatter_tokens",
    "scatter_tokens_triton",
    "token_chunk_nbytes",
    "triton_available",
    "validate_chunk_size",
]
