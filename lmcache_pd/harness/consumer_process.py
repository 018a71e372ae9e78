"""A consumer rank in a child OS process, driven over its stdin/stdout with JSON lines.

Tests, the benchmark and the demo use it to put the consumer in a real separate process (its own
NIXL agent, its own address space) while still asking it what landed. Control never crosses the
network and carries no pickle: one JSON object per line each way; chunk keys travel as hex.

Commands: ``stats``, ``lookup`` (tokens), ``checksums`` (keys -> xxh3 of landed bytes or null,
verified against the producer's checksum), ``corrupt`` (flip one byte of a landed chunk, for
negative controls), ``release`` (req_id), ``stop``.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lmcache_pd.config import load_config
from lmcache_pd.errors import PeerTimeout
from lmcache_pd.harness.child_process import ChildProcess, CommandLoop

logger = logging.getLogger(__name__)


class ConsumerProcess(ChildProcess):
    """Starts ``python -m lmcache_pd.harness.consumer_process CONFIG`` and talks to it."""

    def __init__(
        self,
        config_path: str | Path,
        *,
        env: dict[str, str] | None = None,
        model_name: str = "demo",
        kv_dtype: str = "float32",
        log_path: str | Path | None = None,
        wrap: Sequence[str] = (),
    ) -> None:
        """``wrap`` runs it inside another command, e.g. ``ip netns exec NS``."""
        super().__init__(
            "lmcache_pd.harness.consumer_process",
            [str(config_path), model_name, kv_dtype],
            env=env,
            log_path=log_path,
            wrap=wrap,
        )

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

    def __enter__(self) -> ConsumerProcess:
        return self


def _serve_commands(config_path: str, model_name: str, kv_dtype: str) -> None:
    loop = CommandLoop()
    from lmcache_pd.kernels.integrity import checksum
    from lmcache_pd.keys import ChunkKeyer
    from lmcache_pd.transfer.consumer import Consumer

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
        loop.serve(handlers)


if __name__ == "__main__":
    logging.basicConfig(
        level=load_config(sys.argv[1]).log_level,
        stream=sys.stderr,
        format="%(asctime)s consumer[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    try:
        _serve_commands(*sys.argv[1:4])
    except BaseException:
        # Out at once, skipping the interpreter's shutdown: after a failed start (its ports
        # taken) one was seen to print its error in 4 s, then not end for over a minute on a
        # loaded host, and the parent waits for it to end.
        logging.getLogger(__name__).exception("the consumer process failed")
        logging.shutdown()
        os._exit(1)
