"""Chunks that lie end to end in host memory, crossed to the GPU as one copy.

A load's chunks sit in the receive buffer's pages, often one after another (the consumer hands
a request's pages out in order). Each ``copy_`` from host memory costs the model thread a launch
of its own (torch's and the driver's few microseconds) and the copy engine a transfer it runs
best large, so a run of adjacent chunks goes as one copy into the GPU scratch the load is
staged in, which holds the chunks end to end as well.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch


class HostRun(NamedTuple):
    """Chunks ``first .. last`` (exclusive) of a load, one view ``data`` over all their bytes."""

    data: torch.Tensor
    first: int
    last: int


def adjacent_runs(sources: Sequence[torch.Tensor]) -> list[HostRun]:
    """``sources`` (contiguous byte tensors, in the load's order) as runs of chunks that follow
    each other in one storage, each run one view; a chunk elsewhere is a run of its own."""
    runs: list[HostRun] = []
    start, size = 0, 0
    for index, data in enumerate(sources):
        if index and not _follows(sources[index - 1], data):
            runs.append(HostRun(_spanning(sources[start], size), start, index))
            start, size = index, 0
        size += data.numel()
    if sources:
        runs.append(HostRun(_spanning(sources[start], size), start, len(sources)))
    return runs


def stage(sources: Sequence[torch.Tensor], scratch: torch.Tensor) -> list[torch.Tensor]:
    """Queue the copy of ``sources`` end to end into ``scratch`` (their total size), a copy per
    run (``adjacent_runs``), without blocking; returns each chunk's bytes in ``scratch``."""
    sizes = [data.numel() for data in sources]
    staged = list(scratch.split(sizes))
    offsets = [0, *itertools.accumulate(sizes)]
    for run in adjacent_runs(sources):
        scratch[offsets[run.first] : offsets[run.last]].copy_(run.data, non_blocking=True)
    return staged


def _follows(before: torch.Tensor, after: torch.Tensor) -> bool:
    return (
        before.device == after.device
        and before.untyped_storage().data_ptr() == after.untyped_storage().data_ptr()
        and before.data_ptr() + before.numel() == after.data_ptr()
    )


def _spanning(first: torch.Tensor, size: int) -> torch.Tensor:
    """``size`` bytes of ``first``'s storage from where ``first`` begins."""
    return first if size == first.numel() else first.as_strided((size,), (1,))
