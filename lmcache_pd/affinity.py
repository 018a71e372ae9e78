"""Where lmcache-pd's own threads run: not on the core vLLM pinned its inference to.

vLLM on CPU binds its worker's main thread to ``VLLM_CPU_OMP_THREADS_BIND`` (OpenMP's
``OMP_PROC_BIND``), and a thread inherits the affinity of the thread that starts it: our service,
sender and watchdog threads would queue behind a forward pass on that one core, and a consumer
that cannot answer for seconds fails every push to it (seen: 30 s stalls with 2P1D on 2 cores).
vLLM's own auto-binding keeps a core free for the connector in PD mode; ours asks for it: each of
our threads calls ``unpin_this_thread`` first.
"""

from __future__ import annotations

import logging
import os
import re

from lmcache_pd.errors import ConfigError

logger = logging.getLogger(__name__)

CPU_LIST = re.compile(r"[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*")


def parse_cpus(text: str, setting: str = "thread_cpus") -> set[int]:
    """``"0-3,6"`` -> ``{0, 1, 2, 3, 6}``; raises ``ConfigError`` naming ``setting`` and what
    is wrong."""
    if not CPU_LIST.fullmatch(text):
        raise ConfigError(f"{setting} {text!r}: not a CPU list like '0-3,6'")
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus:
        raise ConfigError(f"{setting} {text!r} names no CPU (a range runs low to high)")
    return cpus


def unpin_this_thread(cpus: str | None, name: str) -> None:
    """Let the calling thread run on ``cpus`` (a CPU list), or on every CPU of the machine if
    None. Linux only; elsewhere, or if the system refuses, the thread keeps its affinity."""
    if not hasattr(os, "sched_setaffinity"):
        return
    wanted = parse_cpus(cpus) if cpus else set(range(os.cpu_count() or 1))
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, wanted)  # 0: this thread
    except OSError as exc:
        logger.warning("%s: cannot run on CPUs %s (%s); it stays where it was", name, wanted, exc)
        return
    logger.info(
        "%s runs on CPUs %s (it started on %s)",
        name,
        sorted(os.sched_getaffinity(0)),
        sorted(before),
    )
