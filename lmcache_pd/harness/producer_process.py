"""A producer rank in a child OS process, driven over its stdin/stdout with JSON lines.

Its twin is ``consumer_process``: tests and ``benchmarks/transfer.py --netns`` run it in one
network namespace and the consumer in another, so that the handshake, the transport choice and
every push cross two network stacks as they would between hosts. Chunks are random bytes made
from a seed; a push answers with the keys and checksums it sent, for the caller to compare with
what the consumer holds.

Commands: ``connect`` and ``push`` (answer ``{"ok": false, "error": TYPE, "detail": ...}`` on
a ``PDError``, with the seconds it took either way), ``counts`` (handshake counters since the
last reset), ``reset`` (a fresh producer with some settings changed: cheaper than a new
process, which spends seconds importing torch), ``stop``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmcache_pd.config import load_config
from lmcache_pd.harness.child_process import ChildProcess, CommandLoop

logger = logging.getLogger(__name__)

BYTES_PER_TOKEN = 512


class ProducerProcess(ChildProcess):
    """Starts ``python -m lmcache_pd.harness.producer_process CONFIG`` and talks to it."""

    def __init__(
        self,
        config_path: str | Path,
        *,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
        wrap: Sequence[str] = (),
    ) -> None:
        """``wrap`` runs it inside another command, e.g. ``ip netns exec NS``."""
        super().__init__(
            "lmcache_pd.harness.producer_process",
            [str(config_path)],
            env=env,
            log_path=log_path,
            wrap=wrap,
        )

    def __enter__(self) -> ProducerProcess:
        return self


def _serve_commands(config_path: str) -> None:
    loop = CommandLoop()
    import torch

    from lmcache_pd.errors import PDError
    from lmcache_pd.kernels.integrity import checksum
    from lmcache_pd.keys import ChunkKeyer
    from lmcache_pd.protocol import DisaggSpec
    from lmcache_pd.transfer.producer import Producer
    from lmcache_pd.transport import describe

    config = load_config(config_path)
    producers: list[Producer] = [Producer(config, count=lambda name, n: count(name, n))]
    keyer = ChunkKeyer(
        model_name="demo",
        world_size=1,
        worker_id=0,
        kv_dtype="float32",
        chunk_size=config.chunk_size,
    )
    counts: dict[str, int] = {}

    def count(name: str, n: int) -> None:
        counts[name] = counts.get(name, 0) + n

    def timed(action) -> dict[str, Any]:
        started = time.monotonic()
        try:
            outcome = {"ok": True, **action()}
        except PDError as exc:
            outcome = {"ok": False, "error": type(exc).__name__, "detail": str(exc)}
        return {**outcome, "seconds": time.monotonic() - started}

    def spec(req_id: str, host: str, init_port: int, alloc_port: int) -> DisaggSpec:
        return DisaggSpec(req_id, host, init_port, alloc_port)

    def reset(settings: dict[str, Any]) -> None:
        producers.pop().close()
        counts.clear()
        producers.append(Producer(load_config(config_path, **settings), count=count))

    def connect(host: str, init_port: int, alloc_port: int) -> dict[str, Any]:
        def action() -> dict[str, Any]:
            peer = producers[-1].connect(spec("connect", host, init_port, alloc_port))
            return {"transport": describe(peer.ucx_tls), "peer": peer.name}

        return timed(action)

    def push(
        req_id: str, host: str, init_port: int, alloc_port: int, tokens: int, seed: int
    ) -> dict[str, Any]:
        generator = torch.Generator().manual_seed(seed)
        keys = keyer.chunk_keys(list(range(seed, seed + tokens)))
        chunks = [
            (k.key, torch.randn(k.end - k.start, BYTES_PER_TOKEN // 4, generator=generator))
            for k in keys
        ]

        def action() -> dict[str, Any]:
            result = producers[-1].push(spec(req_id, host, init_port, alloc_port), chunks)
            return {"chunks_sent": result.chunks_sent, "bytes_sent": result.bytes_sent}

        sent = {
            "keys": [key.hex() for key, _ in chunks],
            "checksums": [checksum(t.view(-1).view(torch.uint8)) for _, t in chunks],
        }
        return {**sent, **timed(action)}

    try:
        handlers = {"connect": connect, "push": push, "counts": lambda: counts, "reset": reset}
        loop.serve(handlers)
    finally:
        producers.pop().close()


if __name__ == "__main__":
    logging.basicConfig(
        level=load_config(sys.argv[1]).log_level,
        stream=sys.stderr,
        format="%(asctime)s producer[%(process)d] %(levelname)s %(name)s: %(message)s",
    )
    _serve_commands(sys.argv[1])
