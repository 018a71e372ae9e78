"""Helpers several benchmarks share: free ports, timing a step against its ceiling run by run
and its GB/s, the log format, and writing the JSON document."""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def free_ports(count: int) -> list[int]:
    """Ports the kernel just handed out: fixed ports collide with tests running alongside."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]


def wall_seconds(step: Callable[[], None]) -> float:
    """Seconds of one ``step`` by the wall clock."""
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def interleaved_samples(
    kernel: Callable[[], None],
    ceiling: Callable[[], None],
    runs: int,
    *,
    warmup_runs: int,
    seconds: Callable[[Callable[[], None]], float] = wall_seconds,
) -> tuple[list[float], list[float]]:
    """Seconds of ``kernel`` and ``ceiling`` (each timed by ``seconds``), interleaved run by run
    after ``warmup_runs`` untimed runs, so that both see the machine in the same phase."""
    samples: tuple[list[float], list[float]] = ([], [])
    for run in range(-warmup_runs, runs):
        for step, times in zip((kernel, ceiling), samples, strict=True):
            elapsed = seconds(step)
            if run >= 0:
                times.append(elapsed)
    return samples


def throughput(nbytes: int, samples: tuple[list[float], list[float]]) -> dict[str, Any]:
    """A record's timing fields: the medians of ``interleaved_samples`` as GB/s of ``nbytes``,
    the kernel's over the ceiling's (``memcpy``), and the samples themselves."""
    kernel_s, ceiling_s = (statistics.median(times) for times in samples)
    gbps, memcpy_gbps = nbytes / kernel_s / 1e9, nbytes / ceiling_s / 1e9
    return {
        "bytes": nbytes,
        "seconds": kernel_s,
        "gbps": gbps,
        "memcpy_gbps": memcpy_gbps,
        "ratio_vs_memcpy": gbps / memcpy_gbps,
        "samples_s": {"kernel": samples[0], "memcpy": samples[1]},
    }


def write_json(output: Path, document: Any) -> None:
    """``document`` as indented JSON at ``output``, its folder made if missing."""
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")


# The checkout the benchmarks run from.
REPO_ROOT = Path(__file__).resolve().parents[1]


def git_commit() -> str | None:
    """The repository's commit, if this runs from a git checkout (read only)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if done.returncode == 0:
            return done.stdout.strip()
    return None
