"""What every benchmark's JSON records about the run: machine, versions, command, date."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import sys
from typing import Any


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith("model name")]
    except OSError:
        return platform.processor()
    return lines[0].split(":", 1)[1].strip() if lines else platform.processor()


def run_environment(packages: tuple[str, ...], command: str | None) -> dict[str, Any]:
    """The document's header: where and with what it ran, and the command that reproduces it."""
    return {
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "processor": _cpu_model(),
            "cpu_count": os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        },
        "versions": {
            "python": platform.python_version(),
            **{name: importlib.metadata.version(name) for name in packages},
        },
        "command": command if command is not None else shlex.join([sys.executable, *sys.argv]),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
