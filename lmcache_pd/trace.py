"""Per-request trace records as JSON lines, appended by the processes a request goes through.

The proxy, the producer's and the consumer's connector each append one line per request step
(keyed by the DisaggSpec ``req_id``, with wall-clock times so that processes on other hosts line
up), so a benchmark can show where each request's time went. Off unless a path is configured.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any


class TraceFile:
    """Appends one JSON object per line; safe to share between threads of one process. Each
    record is a single ``write`` of a line under an ``O_APPEND`` file, so lines of several
    processes sharing the file do not interleave."""

    def __init__(self, path: str | Path | None) -> None:
        self._path = Path(path) if path else None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._path is not None

    def write(self, record: dict[str, Any]) -> None:
        if self._path is None:
            return
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock, self._path.open("a") as out:
            out.write(line)


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a trace file (none if it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]
