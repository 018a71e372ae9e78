"""What one endless request body costs a vLLM instance behind the proxy: its API server's resident
memory while a client streams a chunked body that never ends, to a path open without the key
(``POST /health``) and to an authorized ``POST /v1/completions``.

Why: issue 55 point 2. The instance guard (``lmcache_pd/deploy/instance_guard.py``) once read
the whole body of every request it let through, open paths included, before vLLM saw it; an
endless chunked ``POST /health`` grew the API server until the kernel killed it. Now it refuses
a body on an open path unread (413) and reads at most ``MAX_BODY_BYTES`` of an authorized one.
The ceiling is the server idle: growth is measured against its RSS just before each request.

One vLLM of the tiny model with the guard on; for each door, a raw socket sends 1 MiB chunks
until the server answers or closes, or ``--mib`` have gone, while a thread samples the API
server's RSS (the process vLLM's command runs, not its engine core) every 50 ms.

Reproduce (table on stdout, JSON in benchmarks/results/guard_memory.json)::

    .venv/bin/python -m benchmarks.guard_memory
    .venv/bin/python -m benchmarks.guard_memory --mib 2048
"""

from __future__ import annotations

import logging
import secrets
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import psutil
import typer
from rich.console import Console
from rich.table import Table

from benchmarks.common import LOG_FORMAT, free_ports, git_commit, write_json
from lmcache_pd.deploy.vllm_server import VLLMServer
from lmcache_pd.harness.model_maker import ensure_model
from lmcache_pd.request_body import MAX_BODY_BYTES

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "guard_memory.json"
MODEL_DIR = Path(__file__).resolve().parents[1] / ".cache" / "tiny-llama"
MIB = 1 << 20
CHUNK = b"100000\r\n" + b"x" * MIB + b"\r\n"  # one chunk of 1 MiB (its size in hex)
SAMPLE_S = 0.05
ANSWER_WAIT_S = 10.0


@dataclass(frozen=True, slots=True)
class Door:
    name: str
    path: str
    authorized: bool


DOORS = (
    Door("open /health", "/health", False),
    Door("keyed /v1/completions", "/v1/completions", True),
)


class RssSampler:
    """The highest resident size of one process while the sampler is entered, read every
    ``SAMPLE_S``."""

    def __init__(self, pid: int) -> None:
        self._process = psutil.Process(pid)
        self._stop = threading.Event()
        self.peak = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(SAMPLE_S)


def endless_post(port: int, door: Door, key: str, mib: int) -> dict[str, Any]:
    """Send ``door`` a chunked body up to ``mib`` MiB long (never its last chunk); return how
    much went out before the server answered or closed, and its status line."""
    head = f"POST {door.path} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
    head += "Content-Type: application/json\r\n"
    if door.authorized:
        head += f"Authorization: Bearer {key}\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WAIT_S) as conn:
        conn.sendall(f"{head}\r\n".encode())
        try:
            for _ in range(mib):
                conn.sendall(CHUNK)
                sent += 1
        except OSError:  # the server answered and closed while we sent
            pass
        if sent == mib:
            conn.shutdown(socket.SHUT_WR)
        try:
            answer = conn.recv(4096).split(b"\r\n", 1)[0].decode(errors="replace")
        except OSError as exc:
            answer = f"no answer ({exc.__class__.__name__})"
    return {"sent_mib": sent, "answer": answer or "closed"}


def measure(mib: int) -> list[dict[str, Any]]:
    """Start the instance and send each door one endless body; its RSS before and at peak."""
    key = secrets.token_hex(16)
    (port,) = free_ports(1)
    with tempfile.TemporaryDirectory(prefix="guard-memory-") as folder:
        server = VLLMServer(ensure_model(MODEL_DIR), port, Path(folder) / "vllm.log", api_key=key)
        try:
            rows = []
            for door in DOORS:
                before = psutil.Process(server.pid).memory_info().rss
                with RssSampler(server.pid) as sampler:
                    outcome = endless_post(port, door, key, mib)
                    time.sleep(1.0)  # whatever the server still holds shows in the samples
                rows.append(
                    {
                        "door": door.name,
                        **outcome,
                        "rss_before_mib": round(before / MIB, 1),
                        "rss_growth_mib": round((sampler.peak - before) / MIB, 1),
                    }
                )
            return rows
        finally:
            server.stop()


def main(
    mib: Annotated[int, typer.Option(help="the most MiB of body sent per door")] = 1024,
    output: Annotated[Path, typer.Option(help="where the JSON goes")] = DEFAULT_OUTPUT,
) -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    rows = measure(mib)
    table = Table(title=f"API server RSS under one endless body (cap {MAX_BODY_BYTES // MIB} MiB)")
    for column in ("door", "sent MiB", "answer", "RSS before MiB", "growth MiB"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["door"],
            str(row["sent_mib"]),
            row["answer"],
            str(row["rss_before_mib"]),
            str(row["rss_growth_mib"]),
        )
    Console().print(table)
    write_json(output, {"commit": git_commit(), "mib": mib, "rows": rows})


if __name__ == "__main__":
    typer.run(main)
