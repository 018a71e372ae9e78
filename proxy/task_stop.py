"""Stopping an asyncio task within a deadline, whatever it is awaiting.

Python 3.11's ``asyncio.wait_for`` returns its result instead of raising when its task is
cancelled in the same turn of the loop as the awaited thing completes (CPython gh-86296, fixed in
3.12): the cancelled task runs on, and a stop that awaits it waits forever. Likely what hung a
test once in the whole suite: the index's close waited with no timer left on the loop, as for a
KV event feed cancelled while its replay answered (not reproduced). The proxy waits with
``asyncio.timeout`` instead, which does not swallow a cancellation; ``stop_task`` guards every
stop of a task of its own anyway.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 5.0
# A cancellation can be swallowed: it is sent again this often until the task ends.
CANCEL_EVERY_S = 0.1


async def stop_task(task: asyncio.Task[Any], what: str, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """Cancel ``task`` until it ends, or ``timeout_s`` passes (logged, the task left running);
    whether it ended. An exception it ended with is logged, not raised: it is being stopped."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done():
        remaining = deadline - loop.time()
        if remaining <= 0:
            logger.error("%s still running %.1f s after it was cancelled; left so", what, timeout_s)
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=min(CANCEL_EVERY_S, remaining))
    if not task.cancelled() and (exc := task.exception()) is not None:
        logger.warning("%s had ended with %r", what, exc)
    return True
