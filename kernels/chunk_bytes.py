"""A chunk handed to a cache to scatter: its bytes and the request's tokens it holds.

A module of its own because both ``paged_kv`` (every cache's interface) and ``cuda_kv`` (the GPU
cache, which ``paged_kv`` imports only for a cache on a GPU) name it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ChunkBytes(NamedTuple):
    """A chunk to scatter: its bytes, and the request's tokens ``start .. end`` it holds."""

    data: torch.Tensor
    start: int
    end: int
