"""A load's host chunks that lie end to end cross to the GPU in one copy (``host_runs.py``):
the runs found, and the staged bytes equal to a copy per chunk. On CPU tensors here (the copy
is ``Tensor.copy_`` either way); ``test_gpu_layouts.py`` scatters through it on a GPU."""

from __future__ import annotations

import torch

from lmcache_pd.kernels.host_runs import adjacent_runs, stage

PAGE = 64


def pages(count: int) -> list[torch.Tensor]:
    """``count`` pages of one buffer, each a view, with bytes of their own."""
    buffer = torch.randint(0, 256, (count * PAGE,), dtype=torch.uint8)
    return list(buffer.split(PAGE))


def test_pages_in_order_are_one_run_and_a_gap_or_a_step_back_starts_another() -> None:
    page = pages(8)
    sources = [page[0], page[1], page[2], page[5], page[6], page[3], torch.zeros(PAGE).byte()]
    runs = adjacent_runs(sources)
    assert [(run.first, run.last) for run in runs] == [(0, 3), (3, 5), (5, 6), (6, 7)]
    for run in runs:
        assert torch.equal(run.data, torch.cat(sources[run.first : run.last]))


def test_a_tensor_of_another_buffer_right_after_in_memory_is_not_joined() -> None:
    """Two storages whose bytes are adjacent (two tensors over halves of one host buffer): a
    view across them would reach past the first's storage."""
    memory = memoryview(bytearray(2 * PAGE))
    first = torch.frombuffer(memory[:PAGE], dtype=torch.uint8)
    second = torch.frombuffer(memory[PAGE:], dtype=torch.uint8)
    assert first.data_ptr() + PAGE == second.data_ptr()  # adjacent, as the case needs
    assert len(adjacent_runs([first, second])) == 2
    assert adjacent_runs([]) == []


def test_staged_bytes_equal_a_copy_per_chunk_and_chunks_of_other_sizes() -> None:
    page = pages(6)
    partial = page[4][:17]  # a last chunk shorter than a page, then one elsewhere
    sources = [page[1], page[2], page[3], partial, page[0]]
    scratch = torch.full((sum(s.numel() for s in sources),), 7, dtype=torch.uint8)
    staged = stage(sources, scratch)
    assert [s.numel() for s in staged] == [s.numel() for s in sources]
    assert torch.equal(scratch, torch.cat(sources))
    for got, want in zip(staged, sources, strict=True):
        assert got.data_ptr() != want.data_ptr() and torch.equal(got, want)
