"""The test lanes, and the guard that keeps the fast one fast.

A test marked ``vllm`` starts real vLLM servers; one marked ``processes`` starts any other OS
process (a child Python, a CLI, NIXL peers in processes of their own, network namespaces, Ray).
A test with neither is in the fast lane (``make check``): while it sets up and runs, every way
to start a process fails it, naming the marker it lacks, so a mis-marked test shows up there
instead of silently slowing the lane down.
"""

from __future__ import annotations

import contextlib
import multiprocessing.util
import os
import subprocess
from collections.abc import Callable, Iterator
from typing import NoReturn

import pytest

LANE_MARKERS = ("vllm", "processes")

# Every door to a new process: subprocess (asyncio's too) and multiprocessing's spawn context
# start theirs through the first two; fork and forkserver contexts, and C-level callers of
# system(), through the os functions.
_PROCESS_STARTERS: tuple[tuple[object, str], ...] = (
    (subprocess.Popen, "_execute_child"),
    (multiprocessing.util, "spawnv_passfds"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
)


def in_fast_lane(item: pytest.Item) -> bool:
    return not any(item.get_closest_marker(name) for name in LANE_MARKERS)


@contextlib.contextmanager
def processes_refused(test_id: str) -> Iterator[list[str]]:
    """Within the block, starting a process fails; yields the refusals, so that one swallowed
    by the code under test (a thread, a broad ``except``) still fails the test afterwards."""
    refusals: list[str] = []

    def refuse(starter: str) -> Callable[..., NoReturn]:
        def refused(*args: object, **kwargs: object) -> NoReturn:
            refusals.append(
                f"{test_id} started a process ({starter}) but is in the fast lane: mark it "
                "`processes` (or `vllm` if it starts vLLM), see tests/lanes.py"
            )
            pytest.fail(refusals[-1], pytrace=True)

        return refused

    with pytest.MonkeyPatch.context() as patch:
        for owner, name in _PROCESS_STARTERS:
            if hasattr(owner, name):
                patch.setattr(owner, name, refuse(name))
        yield refusals


def lane_rank(item: pytest.Item) -> int:
    """0 for vLLM, 1 for other processes, 2 for the fast lane (tests/workers.py runs them in
    this order)."""
    for rank, name in enumerate(LANE_MARKERS):
        if item.get_closest_marker(name):
            return rank
    return len(LANE_MARKERS)
