"""A fixed-size shared-memory board per consumer rank where its process posts how many chunks
have landed for each request no decode has claimed yet; decode's scheduler reads it to load a
request whose KV is all there before the step that computes its last token (a synchronous load),
not in a step of its own.

Why shared memory the scheduler reads: the scheduler runs in vLLM's engine-core process and
must decide while it schedules, without waiting on anyone. The consumer's process posts when
chunks land, so what the scheduler reads is as fresh as the landing itself; a report carried
back through the worker's step output arrives a step or two late on a busy core (measured: 4 to
6 of 13 requests in time).

Why not a file rewritten per post (the board until now: write a scratch file, ``os.replace`` it
over the board): the post runs on the consumer's serving loop, which must answer every producer
within milliseconds, and a file system call can block for seconds on a busy host. Measured: in 3
of 19 fresh starts of 2P1D with 4 concurrent requests sharing a prefix, every request took
~6.8 s instead of 0.4-1.5 s; in the one whose logs were read, the loop had not turned for 2.1 s,
its thread inside ``os.replace`` (the folder on a disk-backed /tmp while three instances started
and wrote logs), and prefill's AllocRequest and its KVAbandoned got no answer within their 5 s.
Now the consumer makes the board once, at start (``BoardWriter``: a file of ``BOARD_BYTES``,
mapped and every page faulted in, renamed into place whole), and a post is memory writes only,
no system call. The launcher puts the folder on /dev/shm too (``vllm_server.py``), so the
board's pages are never written back to a disk.

The layout (little-endian): ``generation`` (u64), ``length`` (u32, of the payload), ``crc`` (u32,
CRC-32 of the payload), ``flags`` (u32: ``CLOSED``), then the payload, msgpack of
``dict[str, int]``. A seqlock: the writer makes the generation odd, writes payload, length and
CRC, then makes it even again; a reader takes the generation, the payload, then the generation
again, and keeps the payload only if both were the same even number and its CRC matches, trying
``READ_TRIES`` times at most (no wait between tries: the scheduler must not wait). Memory order:
CPython writes each slice of the map with one ``memcpy`` in program order; on x86 (TSO) stores
reach other cores in that order and loads are not reordered with loads, so the seqlock alone is
exact. On ARM the hardware may reorder them (no barrier is issued from Python); the CRC then
catches a torn read that the generation did not; a read that slipped through both could only
make a load asynchronous, or synchronous too early (it then finds a chunk missing and the prompt
is recomputed): never a wrong answer (below).

The board holds at most ``MAX_BOARD_ENTRIES`` requests, those held longest first
(``ChunkStore.unclaimed_landed``), and is sized for as many of the longest request ids the
protocol allows; a post that would not fit keeps the leading entries that do. A missing board,
one not made yet, a torn or unreadable read, or a request left off, reads as "nothing landed":
the load is then asynchronous, as it would be without the board. The board is a hint, never
trusted for bytes: the load itself checks where each chunk landed, and its checksum.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import zlib
from pathlib import Path

import msgspec

from lmcache_pd.protocol import MAX_BOARD_ENTRIES, MAX_REQ_ID_CHARS

logger = logging.getLogger(__name__)

_GENERATION = struct.Struct("<Q")
# generation, payload length, CRC-32 of the payload, flags
_HEADER = struct.Struct("<QIII")
PAYLOAD_AT = 24  # the header, padded to 8 bytes
CLOSED = 1  # flags: the consumer closed this board (a reader maps the path afresh next time)
# The largest msgpack map header (map 32), then per entry the longest key (str 16 header and 4
# UTF-8 bytes per character of the longest request id) and the largest count (uint 64).
_MAX_MAP_HEADER = 5
_MAX_ENTRY_BYTES = 3 + 4 * MAX_REQ_ID_CHARS + 9
PAYLOAD_BYTES = _MAX_MAP_HEADER + MAX_BOARD_ENTRIES * _MAX_ENTRY_BYTES
BOARD_BYTES = -(-(PAYLOAD_AT + PAYLOAD_BYTES) // mmap.PAGESIZE) * mmap.PAGESIZE
# A post takes microseconds; a reader that finds it mid-way this many times in a row (its writer
# descheduled mid-post) reads "nothing landed" rather than waiting.
READ_TRIES = 8

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(dict[str, int]).decode

# A post's version: its generation and its payload's CRC-32 (a board made afresh restarts its
# generation; the CRC tells its posts from the old board's).
Version = tuple[int, int]


def board_path(directory: Path, instance_id: str, rank: int) -> Path:
    """The board of one rank of one vLLM instance (its scheduler and workers share the id), in
    ``directory``: vLLM's own folder for its IPC sockets (``VLLM_RPC_BASE_PATH``), which our
    launcher makes per instance on /dev/shm and removes with it, so that a board outlives no
    instance, even one that was killed."""
    return directory / f"lmcache-pd-landed-{instance_id}-rank{rank}"


class BoardWriter:
    """The consumer's side: made once at start (file system calls), then ``post`` writes memory
    only. One thread posts (the consumer's service thread); ``close`` when it has stopped."""

    def __init__(self, path: Path, size: int = BOARD_BYTES) -> None:
        """Make the board at ``path``, ``size`` bytes (header included), replacing any there.
        Raises ``OSError`` if it cannot be made."""
        if size <= PAYLOAD_AT:
            raise ValueError(f"a board needs more than {PAYLOAD_AT} bytes, got {size}")
        self.path = path
        self.capacity = size - PAYLOAD_AT
        self.truncated_posts = 0
        self._generation = 0
        # Made under another name, then renamed: a reader never maps a board not yet sized.
        scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(scratch, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, size)
            self._map: mmap.mmap | None = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        try:
            # Every page faulted in now, so that no post waits for the kernel to find memory.
            self._map[:] = bytes(size)
            os.rename(scratch, path)
        except BaseException:
            self._map.close()
            with contextlib.suppress(OSError):
                scratch.unlink()
            raise

    def post(self, landed: dict[str, int]) -> None:
        """Replace what the board says with ``landed`` (chunks landed per unclaimed request, in
        the order they were held); memory writes only."""
        self.post_payload(self._fit(landed))

    def post_payload(self, payload: bytes) -> None:
        """Replace what the board says with ``payload``, which must fit ``capacity`` (a board
        of another content: ``landed_keys.py``); memory writes only."""
        if len(payload) > self.capacity:
            raise ValueError(f"a post of {len(payload)} bytes on a board of {self.capacity}")
        if self._map is not None:
            self._write(payload, 0)

    def close(self) -> None:
        """Mark the board closed (a reader that mapped it reads nothing from then on), unmap it
        and remove its file; idempotent."""
        if self._map is None:
            return
        self._write(b"", CLOSED)
        self._map.close()
        self._map = None
        with contextlib.suppress(OSError):
            self.path.unlink()

    def _write(self, payload: bytes, flags: int) -> None:
        board = self._map
        assert board is not None
        # The seqlock: odd generation, payload and its header, even generation (module doc).
        _GENERATION.pack_into(board, 0, self._generation + 1)
        board[PAYLOAD_AT : PAYLOAD_AT + len(payload)] = payload
        _HEADER.pack_into(board, 0, self._generation + 1, len(payload), zlib.crc32(payload), flags)
        self._generation += 2
        _GENERATION.pack_into(board, 0, self._generation)

    def _fit(self, landed: dict[str, int]) -> bytes:
        """``landed`` encoded, or as many of its leading entries as fit."""
        payload = _encode(landed)
        if len(payload) <= self.capacity:
            return payload
        room, kept = self.capacity - _MAX_MAP_HEADER, 0
        for req_id, count in landed.items():
            room -= len(_encode(req_id)) + len(_encode(count))
            if room < 0:
                break
            kept += 1
        if self.truncated_posts == 0:
            logger.warning(
                "landed board %s: %d requests do not fit in %d bytes; the last %d read as "
                "nothing landed (said once)",
                self.path,
                len(landed),
                self.capacity,
                len(landed) - kept,
            )
        self.truncated_posts += 1
        return _encode(dict(list(landed.items())[:kept]))


class BoardReader:
    """Decode's scheduler's side: maps the board once its file exists, then each ``read`` is
    memory reads only. Nothing is ever waited for.

    The scheduler reads on every scheduling attempt of every waiting request, and a board is up
    to ~1 MiB: a post is copied, CRC-checked and decoded once, and while the header still names
    it (``posted``: its generation and CRC, no payload read) each read is the same dict."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._map: mmap.mmap | None = None
        self._last: tuple[Version, dict[str, int]] | None = None  # the last post decoded

    def read(self) -> dict[str, int]:
        """The last post (the caller must not change it); nothing if there is no board (yet),
        the consumer closed it, or no whole post was seen in ``READ_TRIES`` tries."""
        last = self._last
        if last is not None and self.posted() == last[0]:
            return last[1]
        post = self.read_payload()
        if post is None:
            return {}
        try:
            landed = _decode(post[1])
        except msgspec.DecodeError:
            landed = {}
        self._last = (post[0], landed)
        return landed

    def posted(self) -> Version | None:
        """The version of the post the header names, from the header alone (no payload copied,
        no CRC computed): equal to a version read before only while that post stands. None if
        there is no board (yet), a post is under way, or the consumer closed it."""
        board = self._map if self._map is not None else self._open()
        if board is None:
            return None
        generation, _, crc, flags = _HEADER.unpack_from(board, 0)
        return None if generation & 1 or flags & CLOSED else (generation, crc)

    def read_payload(self) -> tuple[Version, bytes] | None:
        """The last post as its version (generation and CRC: a board made afresh restarts its
        generation) and its bytes, empty once the consumer closed the board; None if there is
        no board (yet) or no whole post was seen in ``READ_TRIES`` tries."""
        board = self._map if self._map is not None else self._open()
        if board is None:
            return None
        for _ in range(READ_TRIES):
            generation, length, crc, flags = _HEADER.unpack_from(board, 0)
            if generation & 1 or length > len(board) - PAYLOAD_AT:
                continue  # mid-post
            payload = board[PAYLOAD_AT : PAYLOAD_AT + length]
            if _GENERATION.unpack_from(board, 0)[0] != generation or zlib.crc32(payload) != crc:
                continue  # a post began meanwhile
            if flags & CLOSED:
                self.close()  # its consumer is gone: the path may hold a new board next time
                return (generation, crc), b""
            return (generation, crc), payload
        return None

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def _open(self) -> mmap.mmap | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            if os.fstat(fd).st_size <= PAYLOAD_AT:
                return None
            self._map = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        return self._map


def read(path: Path) -> dict[str, int]:
    """One read of the board at ``path`` (maps and unmaps it: for tests and tools; the
    scheduler keeps a ``BoardReader``)."""
    reader = BoardReader(path)
    try:
        return reader.read()
    finally:
        reader.close()
