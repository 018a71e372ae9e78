"""The checksum a producer sends with each chunk and a consumer checks before using it.

xxh3-64 over the chunk's bytes: 12-28 GB/s on these machines, far above a transfer, and it
catches a chunk written into the wrong page or torn by a write that landed twice.
"""

from __future__ import annotations

import torch
import xxhash


def checksum(data: torch.Tensor) -> int:
    """xxh3-64 of a contiguous CPU tensor's bytes."""
    return xxhash.xxh3_64_intdigest(memoryview(data.numpy()).cast("B"))
