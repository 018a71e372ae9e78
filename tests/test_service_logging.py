"""The consumer service's logging: lines are queued by the thread that logs and written by a
thread of their own, and a full queue drops (and counts) rather than waits. Fast lane."""

from __future__ import annotations

import logging
import threading

import pytest

from lmcache_pd.transfer import service_logging
from lmcache_pd.transfer.service_logging import queued_logging

logger = logging.getLogger("tests.service_logging")


def test_lines_are_written_by_the_log_thread_not_the_caller(
    capsys: pytest.CaptureFixture[str],
) -> None:
    writers: list[str] = []
    with queued_logging(logging.INFO, "%(levelname)s %(name)s: %(message)s") as listener:
        writer = listener.handlers[0]
        handle = writer.handle
        writer.handle = lambda record: (
            writers.append(threading.current_thread().name) or handle(record)
        )
        listener.start()
        logger.info("landed %d chunks", 3)
        logger.debug("not at this level")
        try:
            raise ValueError("boom")
        except ValueError:
            logger.exception("a bad turn")
    err = capsys.readouterr().err
    assert "INFO tests.service_logging: landed 3 chunks" in err
    assert "not at this level" not in err
    assert "a bad turn" in err and "ValueError: boom" in err  # the traceback goes with it
    assert writers and threading.current_thread().name not in writers


def test_a_full_queue_drops_lines_and_says_how_many(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service_logging, "MAX_QUEUED_RECORDS", 2)
    with queued_logging(logging.INFO, "%(message)s"):  # the writer never started: nothing drains
        for index in range(5):
            logger.warning("line %d", index)
    err = capsys.readouterr().err.splitlines()
    assert err == ["line 0", "line 1", "3 log records dropped (the log writer lagged)"]
