"""Paged-KV gather/scatter between vLLM's cache and chunk buffers (torch on CPU, Triton on GPU)."""
