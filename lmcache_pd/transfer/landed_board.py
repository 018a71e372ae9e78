"""A small file per consumer rank where its process posts how many chunks have landed for each
request no decode has claimed yet; decode's scheduler reads it to load a request whose KV is all
there before the step that computes its last token (a synchronous load), not in a step of its own.

Why a file: the scheduler runs in vLLM's engine-core process and must decide while it schedules,
without waiting on anyone. The consumer's process posts when chunks land, so what the scheduler
reads is as fresh as the landing itself; a report carried back through the worker's step output
arrives a step or two late on a busy core (measured: 4 to 6 of 13 requests in time). A post
replaces the file whole (``os.replace``), so a reader sees one post or the next, never half of
one; the consumer posts only when what the board says changed, and only requests with chunks
landed, at most ``MAX_BOARD_ENTRIES`` of them (``ChunkStore.unclaimed_landed``), so the file stays
small whatever its peers send. A missing or unreadable board, or a request left off it, reads as
"nothing landed": the load is then asynchronous, as it would be without the board. The board is
a hint, never trusted for bytes: the load itself checks where each chunk landed, and its
checksum.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import msgspec

logger = logging.getLogger(__name__)

_decode = msgspec.msgpack.Decoder(dict[str, int])


def board_path(directory: Path, instance_id: str, rank: int) -> Path:
    """The board of one rank of one vLLM instance (its scheduler and workers share the id), in
    ``directory``: vLLM's own folder for its IPC sockets (``VLLM_RPC_BASE_PATH``), which our
    launcher makes per instance and removes with it, so that a board outlives no instance, even
    one that was killed."""
    return directory / f"lmcache-pd-landed-{instance_id}-rank{rank}"


def post(path: Path, landed: dict[str, int]) -> None:
    """Replace the board with ``landed`` (chunks landed per unclaimed request)."""
    scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        scratch.write_bytes(msgspec.msgpack.encode(landed))
        os.replace(scratch, path)
    except OSError as exc:  # the loads stay correct, only asynchronous
        logger.warning("cannot post landed chunks to %s: %s", path, exc)


def read(path: Path) -> dict[str, int]:
    """The last post, or nothing if there is none (or it cannot be read)."""
    try:
        return _decode.decode(path.read_bytes())
    except (OSError, msgspec.DecodeError):
        return {}


def remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
