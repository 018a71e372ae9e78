"""The checksum a producer sends with each chunk and a consumer checks before using it.

XXH3-64 over the chunk's bytes, seed 0: a 64-bit non-cryptographic hash that passes SMHasher, so
a chunk written into the wrong page, torn, landed twice, or with any one bit flipped, fails it;
it is not meant to stop an attacker. The connector takes it while copying, not in a pass of its
own: the producer's gather from vLLM's cache into staging returns it, and the consumer's scatter
into decode's cache checks it (``CpuKVCache.gather/scatter(hashed=True)``, ``kernels/xxh3.h``).
That pass over each chunk on each side cost a third of a push's throughput. :func:`checksum`, the
same code without a copy, serves callers that hold the bytes already (tests, the transfer demo,
a chunk pushed from outside staging).

Why keep XXH3-64 rather than a cheaper fused hash of our own: the copy is bound by memory, not by
the hash (the hashed copy measured at memcpy's speed, ``benchmarks/kernels.py``), and the hash is
the one ``WriteDone`` always carried: producers and consumers of earlier builds still agree, and
nothing on the wire or in the KV profile changes. (A different hash would have to be named in
the profile, so that a peer with the other one is refused at handshake, not failed chunk by chunk.)
"""

from __future__ import annotations

import torch

from lmcache_pd.kernels.cpu_blocks import xxh3_64_of


def checksum(data: torch.Tensor) -> int:
    """XXH3-64 of a contiguous CPU tensor's bytes."""
    return xxh3_64_of(data)
