"""Checksums of landed chunks taken off vLLM's model thread.

Why: a cache that cannot hash a chunk in the pass that scatters it (the token layouts' torch
path, and every GPU cache: the CUDA copy has no fused digest) needs a pass of its own over each
chunk's bytes in the receive buffer. On the model thread that pass stalled every running decode
for it: ~1 GiB for an 8k-token prompt of an 8B model, 50-100 ms of XXH3. Here each chunk is
hashed on a small pool of threads (the hash releases the GIL) while the model thread goes on;
the load polls its digests each step and scatters once all have come and matched.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lmcache_pd.kernels.integrity import checksum

# Threads hashing landed chunks: a core's worth of hashing runs at memory speed; two keep up
# with a consumer's landings without crowding vLLM's own threads.
CHECK_THREADS = 2


class ChunkChecks:
    """The pool that hashes landed chunks; owned by the consumer worker (model thread)."""

    def __init__(self, threads: int = CHECK_THREADS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="lmcache-pd-checksum")

    def digest(self, data: torch.Tensor) -> Future[int]:
        """XXH3-64 of ``data`` (a landed chunk's bytes), on the pool."""
        return self._pool.submit(checksum, data)

    def close(self) -> None:
        """Drop queued hashes; those running end with their chunk (bytes nobody waits for)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
