"""A watchdog for a service loop: says where a loop that stopped turning is stuck.

A consumer's service thread answers every producer; when it stops (inside a native call, waiting
for a lock or the GIL), every push to that decode instance times out and nothing in the logs says
why. The loop calls ``beat()`` each turn; a thread of the watchdog's own notices a beat older
than ``stall_s``, and logs once per stall the stack of every thread of the process (the stuck
one's innermost Python frame names the call it is in), then how long the stall lasted.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

from lmcache_pd.affinity import unpin_this_thread

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 0.5
# How long closing waits for the watchdog's thread, which wakes every CHECK_EVERY_S.
WATCHDOG_JOIN_TIMEOUT_S = 2.0


class Watchdog:
    """Watches one loop's beats; ``on_stall`` is called once per stall (e.g. a counter)."""

    def __init__(
        self, name: str, stall_s: float, on_stall: Callable[[], None], cpus: str | None = None
    ) -> None:
        """``cpus``: where the watchdog's thread may run (``affinity.unpin_this_thread``)."""
        self._name = name
        self._cpus = cpus
        self._stall_s = stall_s
        self._on_stall = on_stall
        self._last_beat = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"{name}-watchdog", daemon=True)
        self._thread.start()

    def beat(self) -> None:
        """The loop made a turn (a float store: cheap enough for every turn)."""
        self._last_beat = time.monotonic()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(WATCHDOG_JOIN_TIMEOUT_S)

    def _watch(self) -> None:
        unpin_this_thread(self._cpus, f"{self._name} watchdog")
        stalled_since: float | None = None
        while not self._stop.wait(CHECK_EVERY_S):
            beat = self._last_beat
            silent_s = time.monotonic() - beat
            if silent_s < self._stall_s:
                if stalled_since is not None:
                    logger.warning(
                        "%s turns again after a stall of %.1f s", self._name, beat - stalled_since
                    )
                    stalled_since = None
                continue
            if stalled_since is None:
                stalled_since = beat
                # Stacks first: on_stall may wait for what the stuck thread holds.
                logger.warning(
                    "%s has not turned for %.1f s; threads of this process:\n%s",
                    self._name,
                    silent_s,
                    _all_stacks(),
                )
                self._on_stall()


def _all_stacks() -> str:
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        stack = "".join(traceback.format_stack(frame, limit=12))
        parts.append(f"--- thread {names.get(ident, ident)}:\n{stack}")
    return "\n".join(parts)
