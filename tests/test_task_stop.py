"""A task is stopped within a deadline even where a cancellation is swallowed
(``proxy/task_stop.py``), and the proxy's waits do not swallow one (``asyncio.timeout``, where
Python 3.11's ``asyncio.wait_for`` does: the control)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time

import pytest

from lmcache_pd.proxy.task_stop import stop_task


async def swallows_one_cancellation(forever: asyncio.Event) -> None:
    # As asyncio.wait_for does on 3.11 when what it awaited had just completed.
    with contextlib.suppress(asyncio.CancelledError):
        await forever.wait()
    await forever.wait()


def test_a_task_that_swallows_a_cancellation_is_stopped_by_cancelling_again() -> None:
    async def run() -> tuple[bool, bool, float]:
        forever = asyncio.Event()
        control = asyncio.create_task(swallows_one_cancellation(forever))
        await asyncio.sleep(0)
        control.cancel()  # one cancellation and a wait: still running
        await asyncio.wait({control}, timeout=0.3)
        after_one = control.done()
        task = asyncio.create_task(swallows_one_cancellation(forever))
        await asyncio.sleep(0)
        started = time.monotonic()
        stopped = await stop_task(task, "a test task")
        waited = time.monotonic() - started
        await stop_task(control, "the control task")
        return after_one, stopped and task.cancelled(), waited

    after_one, stopped, waited = asyncio.run(run())
    assert not after_one
    assert stopped and waited < 1.0


def test_a_task_that_does_not_end_is_left_at_the_deadline_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def run() -> tuple[bool, float, bool]:
        released = asyncio.Event()

        async def stubborn() -> None:  # ignores cancellations until released
            while not released.is_set():
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    continue

        task = asyncio.create_task(stubborn())
        await asyncio.sleep(0)
        started = time.monotonic()
        stopped = await stop_task(task, "the stubborn task", timeout_s=0.5)
        waited = time.monotonic() - started
        released.set()
        return stopped, waited, await stop_task(task, "the released task")

    stopped, waited, then = asyncio.run(run())
    assert not stopped and 0.5 <= waited < 1.0 and then
    assert "the stubborn task still running 0.5 s after it was cancelled" in caplog.text


async def waits_for(done: asyncio.Future[int], with_timeout: bool) -> int:
    if with_timeout:
        async with asyncio.timeout(2):
            return await done
    return await asyncio.wait_for(done, 2)


@pytest.mark.parametrize("with_timeout", [True, False], ids=["asyncio.timeout", "wait_for"])
def test_a_cancellation_in_the_turn_the_awaited_completes(with_timeout: bool) -> None:
    """What the proxy waits with raises the cancellation; 3.11's wait_for returns instead."""

    async def run() -> asyncio.Task[int]:
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(waits_for(done, with_timeout))
        await asyncio.sleep(0)
        done.set_result(1)
        task.cancel()
        await asyncio.wait({task}, timeout=1)
        return task

    task = asyncio.run(run())
    swallowed = not task.cancelled()
    if with_timeout:
        assert not swallowed
    elif sys.version_info < (3, 12):
        assert swallowed and task.result() == 1
