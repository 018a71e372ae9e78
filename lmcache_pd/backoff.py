"""Spin, then back off: how every poll of ours waits for work that only progresses when polled.

A CPU NIXL transfer makes progress only inside our polls, and a GPU copy finishes within
microseconds, so a waiter first spins, then sleeps in growing steps. The caller owns the
deadline; this only paces the loop.
"""

from __future__ import annotations

import time

# Busy-poll this long before backing off: a CPU transfer makes progress only inside our polls.
SPIN_BEFORE_BACKOFF_S = 0.002
FIRST_BACKOFF_S = 0.00005
MAX_BACKOFF_S = 0.0005


class SpinThenBackoff:
    """Paces one wait: ``pause()`` returns at once for the first ``SPIN_BEFORE_BACKOFF_S``, then
    sleeps ``FIRST_BACKOFF_S`` doubling up to ``MAX_BACKOFF_S``."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self._sleep_s = 0.0

    def pause(self) -> None:
        if time.monotonic() - self.started > SPIN_BEFORE_BACKOFF_S:
            self._sleep_s = min(MAX_BACKOFF_S, self._sleep_s * 2 or FIRST_BACKOFF_S)
            time.sleep(self._sleep_s)
