"""A consumer rank in a child OS process, driven over its stdin/stdout with JSON lines.

Tests, the benchmark and the demo use it to put the consumer in a real separate process (its own
NIXL agent, its own address space) while still asking it what landed. Control never crosses the
network and carries no pickle: one JSON object per line each way; chunk keys travel as hex.

Commands: ``stats``, ``lookup`` (tokens), ``checksums`` (keys -> xxh3 of landed bytes or null,
verified against the producer's checksum), ``corrupt`` (flip one byte of a landed chunk, for
negative controls), ``release`` (req_id), ``stop``.
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
import time
from pathlib import Path
from typing import Any

from lmcache_pd.config import load_config
from lmcache_pd.errors import IntegrityError, PeerTimeout

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0
COMMAND_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
EXIT_GRACE_S = 2.0


class ConsumerProcess:
    """Starts ``python -m lmcache_pd.consumer_process CONFIG`` and talks to it."""

    def __init__(
        self,
        config_path: str | Path,
        *,
        env: dict[str, str] | None = None,
        model_name: str = "demo",
        kv_dtype: str = "float32",
        log_path: str | Path | None = None,
    ) -> None:
        command = [
            sys.executable,
            "-m",
            "lmcache_pd.consumer_process",
            str(config_path),
            model_name,
            kv_dtype,
        ]
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
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps({"command": command, **args}) + "\n")
        self._process.stdin.flush()
        reply = self._read(timeout_s)
        if "error" in reply:
            kind, detail = reply["error"]
            raise (IntegrityError if kind == "IntegrityError" else RuntimeError)(detail)
        return reply["result"]

    def stats(self) -> dict[str, int]:
        return self.call("stats")

    def wait_until(self, predicate, timeout_s: float, what: str) -> dict[str, int]:
        """Poll ``stats`` until ``predicate(stats)`` holds; ``PeerTimeout`` at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if predicate(stats):
                return stats
            if time.monotonic() > deadline:
                raise PeerTimeout(f"consumer never reached: {what}; stats {stats}")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGKILL)
        self._process.wait(STOP_TIMEOUT_S)

    def stop(self) -> None:
        """Ask the child to close its consumer and exit; kill it if it does not."""
        if self._process.poll() is None:
            try:
                self.call("stop", timeout_s=STOP_TIMEOUT_S)
                self._process.wait(STOP_TIMEOUT_S)
            except (PeerTimeout, OSError, RuntimeError, subprocess.TimeoutExpired):
                logger.warning("consumer process %d did not stop, killing it", self.pid)
        self.kill()

    def __enter__(self) -> ConsumerProcess:
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
                raise PeerTimeout(f"consumer process {self.pid} exited with status {code}")
            raise PeerTimeout(f"consumer process {self.pid} silent for {timeout_s} s")
        return json.loads(line)


def _serve_commands(config_path: str, model_name: str, kv_dtype: str) -> None:
    # Replies get the real stdout; anything a library prints goes to stderr instead.
    replies = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    from lmcache_pd.consumer import Consumer
    from lmcache_pd.integrity import checksum
    from lmcache_pd.keys import ChunkKeyer

    config = load_config(config_path)
    keyer = ChunkKeyer(
        model_name=model_name,
        world_size=1,
        worker_id=0,
        kv_dtype=kv_dtype,
        chunk_size=config.chunk_size,
    )

    def checksums(keys: list[str]) -> list[int | None]:
        result: list[int | None] = []
        for key in keys:
            try:
                result.append(checksum(consumer.get_chunk(bytes.fromhex(key))))
            except KeyError:
                result.append(None)
        return result

    def corrupt(key: str, offset: int) -> None:
        # Reach past get_chunk's verification: the point is to change bytes after the write.
        landed = consumer._store.landed(bytes.fromhex(key))
        if landed is None:
            raise KeyError(key)
        consumer._buffer[landed.page * config.page_bytes + offset] ^= 0xFF

    with Consumer(config, keyer) as consumer:
        handlers = {
            "stats": lambda: consumer.stats_snapshot(),
            "lookup": lambda tokens: consumer.lookup(tokens),
            "checksums": checksums,
            "corrupt": corrupt,
            "release": lambda req_id: consumer.release(req_id),
        }
        reply({"pid": os.getpid(), "ready": True})
        for line in sys.stdin:
            request = json.loads(line)
            command = request.pop("command")
            if command == "stop":
                reply({"result": None})
                break
            try:
                reply({"result": handlers[command](**request)})
            except Exception as exc:  # reported to the parent, which raises it there
                reply({"error": [type(exc).__name__, str(exc)]})


if __name__ == "__main__":
    logging.basicConfig(
        level=load_config(sys.argv[1]).log_level,
        stream=sys.stderr,
        format="%(asctime)s consumer[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    _serve_commands(*sys.argv[1:4])
