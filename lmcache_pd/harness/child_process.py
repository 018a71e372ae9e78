"""A Python child process driven over its stdin/stdout with JSON lines, one object each way.

The base of ``ConsumerProcess`` and ``ProducerProcess``: tests, benchmarks and the demo put a
consumer or a producer in a real separate process (its own NIXL agent, address space and, with
``wrap``, its own network namespace) and still ask it what happened. Control never crosses the
network and carries no pickle.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcache_pd.errors import IntegrityError, PeerTimeout
from lmcache_pd.protocol import PROCESS_EXIT_TIMEOUT_S

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0
COMMAND_TIMEOUT_S = 30.0
EXIT_GRACE_S = 2.0


class ChildProcess:
    """Starts ``python -m MODULE ARGS...`` (after ``wrap``, e.g. ``ip netns exec NS``), waits
    for its first line (returned as ``info``), then answers ``call``s."""

    def __init__(
        self,
        module: str,
        args: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        wrap: Sequence[str] = (),
    ) -> None:
        # ``ip netns exec`` replaces itself with the command: the pid is the child's own.
        command = [*wrap, sys.executable, "-m", module, *args]
        log = open(log_path, "a") if log_path else None  # noqa: SIM115 (the child owns it)
        try:
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env={**os.environ, **(env or {})},
                text=True,
            )
        finally:
            if log is not None:
                log.close()
        try:
            self.info = self._read(READY_TIMEOUT_S)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self._process.pid

    def call(self, command: str, timeout_s: float = COMMAND_TIMEOUT_S, **args: Any) -> Any:
        """Run one command in the child and return its result (raises what the child raised)."""
        self.send(command, **args)
        return self.result(timeout_s)

    def send(self, command: str, **args: Any) -> None:
        """Start one command; ``result`` reads its answer (the caller may act meanwhile)."""
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps({"command": command, **args}) + "\n")
        self._process.stdin.flush()

    def result(self, timeout_s: float = COMMAND_TIMEOUT_S) -> Any:
        reply = self._read(timeout_s)
        if "error" in reply:
            kind, detail = reply["error"]
            raise (IntegrityError if kind == "IntegrityError" else RuntimeError)(detail)
        return reply["result"]

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
        self._process.wait(PROCESS_EXIT_TIMEOUT_S)

    def stop(self) -> None:
        """Ask the child to exit; kill it if it does not."""
        if self._process.poll() is None:
            try:
                self.call("stop", timeout_s=PROCESS_EXIT_TIMEOUT_S)
                self._process.wait(PROCESS_EXIT_TIMEOUT_S)
            except (PeerTimeout, OSError, RuntimeError, subprocess.TimeoutExpired):
                logger.warning("child process %d did not stop, killing it", self.pid)
        self.kill()

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _read(self, timeout_s: float) -> dict[str, Any]:
        assert self._process.stdout is not None
        ready, _, _ = select.select([self._process.stdout], [], [], timeout_s)
        line = self._process.stdout.readline() if ready else ""
        if not line:
            if ready:  # end of file: the child is exiting; its status follows at once
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._process.wait(EXIT_GRACE_S)
            code = self._process.poll()
            if code is not None:
                raise PeerTimeout(f"child process {self.pid} exited with status {code}")
            raise PeerTimeout(f"child process {self.pid} silent for {timeout_s} s")
        return json.loads(line)


class CommandLoop:
    """The child's side. Made first thing, before any library can print: replies get the real
    stdout, and anything else written there (NIXL logs to stdout) goes to stderr instead."""

    def __init__(self) -> None:
        self._replies = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)

    def reply(self, message: dict[str, Any]) -> None:
        self._replies.write(json.dumps(message) + "\n")
        self._replies.flush()

    def serve(self, handlers: dict[str, Any], ready: dict[str, Any] | None = None) -> None:
        """Say ready (with ``ready``), then answer one line per command until ``stop``."""
        self.reply({"pid": os.getpid(), "ready": True, **(ready or {})})
        for line in sys.stdin:
            request = json.loads(line)
            command = request.pop("command")
            if command == "stop":
                self.reply({"result": None})
                return
            try:
                self.reply({"result": handlers[command](**request)})
            except Exception as exc:  # reported to the parent, which raises it there
                self.reply({"error": [type(exc).__name__, str(exc)]})
