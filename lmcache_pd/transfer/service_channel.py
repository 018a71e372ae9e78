"""The worker's end of the socketpair to its consumer process: frames that never block the
thread that writes them, which is vLLM's model thread.

A blocking write stalls its thread once the socket's buffer is full, and the process on the
other end fills it whenever it does not read: stopped, not scheduled, or itself blocked writing
an answer larger than the buffer that the worker, blocked too, never reads (a deadlock). So
frames go into an outbox of at most ``MAX_OUTBOX_BYTES`` and out as the socket takes them, and
every write and every wait first reads what the process has answered. A frame the outbox has no
room for is refused (``send`` says so): the caller fails or retries what it was for. Frames use
``multiprocessing.connection``'s own framing (a 4-byte big-endian length, or -1 and 8 bytes), so
the process reads them with a plain ``Connection``.
"""

from __future__ import annotations

import collections
import select
import socket
import struct
import time

# A claim names at most MAX_CHUNKS_PER_REQUEST keys (~260 KiB): room for several at once.
MAX_OUTBOX_BYTES = 4 << 20
# What the process may send in one frame (a progress answer's landed chunks and counters).
MAX_FRAME_BYTES = 64 << 20
_SHORT = struct.Struct("!i")
_LONG = struct.Struct("!Q")
_READ_BYTES = 1 << 20


class ServiceChannel:
    """Non-blocking frames over a connected socket; one owner thread."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._outbox = bytearray()
        self._inbox = bytearray()
        self._frames: collections.deque[bytes] = collections.deque()
        self._closed = False

    def send(self, payload: bytes) -> bool:
        """Queue one frame and write what the socket takes now; False, and nothing queued,
        where the outbox has no room for it. Raises ``OSError`` or ``EOFError`` for a socket
        the process closed."""
        self._read()  # its answers first: it may be blocked writing one
        frame = _frame(payload)
        if len(self._outbox) + len(frame) > MAX_OUTBOX_BYTES:
            self._write()
            if len(self._outbox) + len(frame) > MAX_OUTBOX_BYTES:
                return False
        self._outbox += frame
        self._write()
        return True

    def poll(self, timeout_s: float) -> bool:
        """Whether a frame has come, waiting at most ``timeout_s`` (writing the outbox out
        meanwhile). Raises ``EOFError`` once the process closed its end and every frame it sent
        was read."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._write()
            self._read()
            if self._frames:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            writing = [self._sock] if self._outbox else []
            select.select([self._sock], writing, [], left)

    def recv(self) -> bytes:
        """The next frame (``poll`` said one has come)."""
        return self._frames.popleft()

    def close(self) -> None:
        self._sock.close()

    def _write(self) -> None:
        while self._outbox:
            try:
                sent = self._sock.send(self._outbox)
            except BlockingIOError:
                return
            del self._outbox[:sent]

    def _read(self) -> None:
        """Move what has come into frames; ``EOFError`` at the end of the process's stream."""
        while not self._closed:
            try:
                data = self._sock.recv(_READ_BYTES)
            except BlockingIOError:
                break
            if not data:
                self._closed = True
                break
            self._inbox += data
        self._split()
        if self._closed and not self._frames:
            raise EOFError("the consumer process closed its end")

    def _split(self) -> None:
        inbox = self._inbox
        while len(inbox) >= _SHORT.size:
            (size,) = _SHORT.unpack_from(inbox)
            head = _SHORT.size
            if size == -1:
                if len(inbox) < head + _LONG.size:
                    return
                (size,) = _LONG.unpack_from(inbox, head)
                head += _LONG.size
            if not 0 <= size <= MAX_FRAME_BYTES:
                raise OSError(f"a frame of {size} bytes from the consumer process")
            if len(inbox) < head + size:
                return
            self._frames.append(bytes(inbox[head : head + size]))
            del inbox[: head + size]


def _frame(payload: bytes) -> bytes:
    if len(payload) < 2**31 - 1:
        return _SHORT.pack(len(payload)) + payload
    return _SHORT.pack(-1) + _LONG.pack(len(payload)) + payload
