"""Logging for the consumer's service process that never writes from the thread that logs.

Why: the service's stderr is its vLLM instance's log file, which the instance's other processes
write too. A ``write`` to a file can wait (the inode's lock held by another writer, dirty-page
throttling, a journal commit on a busy disk), and Python's handler holds its lock meanwhile, so a
log line on the serving loop (a refusal, a lapsed lease, the watchdog's report) could stall it as
the old landed board's ``os.replace`` did. Here a record is formatted and put on a bounded queue
(memory only; one past ``MAX_QUEUED_RECORDS`` is dropped and counted rather than waited for), and
a thread of its own writes them out.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import sys
from collections.abc import Iterator
from logging.handlers import QueueHandler, QueueListener

# Records waiting for the writer thread; past this, new ones are dropped (counted).
MAX_QUEUED_RECORDS = 10_000
# How long stopping waits for the writer to write what is queued (its thread is a daemon: a
# writer stuck in a write does not keep the process from exiting).
FLUSH_TIMEOUT_S = 2.0


class DroppingQueueHandler(QueueHandler):
    """A ``QueueHandler`` that never waits: a record that finds the queue full is dropped."""

    def __init__(self, records: queue.Queue[logging.LogRecord]) -> None:
        super().__init__(records)
        self.dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1  # under the handler's lock (``Handler.handle`` holds it)


class LogWriter(QueueListener):
    """The thread that writes queued records; ``stop`` waits for it ``FLUSH_TIMEOUT_S`` at most
    (``QueueListener.stop`` waits without end, and fails on a full queue)."""

    @property
    def started(self) -> bool:
        return self._thread is not None

    def stop(self) -> None:
        if self._thread is None:
            return
        with contextlib.suppress(queue.Full):
            self.queue.put(self._sentinel, timeout=FLUSH_TIMEOUT_S)
        self._thread.join(FLUSH_TIMEOUT_S)
        self._thread = None


@contextlib.contextmanager
def queued_logging(level: str | int, fmt: str) -> Iterator[LogWriter]:
    """Within the block, the root logger at ``level`` puts records on a queue that the
    returned listener writes to stderr once started (``listener.start()``: start it where its
    thread should run, e.g. after the process's CPU affinity is set). On exit, what is queued is
    written, then how many records were dropped, if any."""
    records: queue.Queue[logging.LogRecord] = queue.Queue(MAX_QUEUED_RECORDS)
    handler = DroppingQueueHandler(records)
    writer = logging.StreamHandler(sys.stderr)
    writer.setFormatter(logging.Formatter(fmt))
    listener = LogWriter(records, writer)
    root = logging.getLogger()
    previous_level = root.level
    root.addHandler(handler)
    root.setLevel(level)
    try:
        yield listener
    finally:
        root.removeHandler(handler)
        root.setLevel(previous_level)
        if listener.started:  # its thread writes what is queued, then stops
            listener.stop()
        else:  # never started: write what is queued here
            while not records.empty():
                writer.handle(records.get_nowait())
        if handler.dropped:
            writer.handle(
                logging.makeLogRecord(
                    {
                        "name": __name__,
                        "levelno": logging.WARNING,
                        "levelname": "WARNING",
                        "msg": f"{handler.dropped} log records dropped (the log writer lagged)",
                    }
                )
            )
        writer.flush()
