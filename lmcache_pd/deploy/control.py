"""The control socket of a running one-host ``serve``: how ``lmcache-pd restart`` asks it to roll
instances.

``serve`` owns its instances (they are its child processes), so the command talks to it: a Unix
socket at ``WORKDIR/control/serve.sock``, in a folder only its user may enter (0700) and itself
0600, and each caller's user checked (``SO_PEERCRED``) on top. One request a connection, one JSON
line (``RestartRequest``); the answer is a line per step (``Progress``), then ``Done``. Every
read and write has a deadline; a request is bounded in size and decoded by one typed decoder.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec

from lmcache_pd.errors import PDError

logger = logging.getLogger(__name__)

# Version history: 1, the first.
CONTROL_VERSION = 1
CONTROL_FOLDER = "control"
SOCKET_NAME = "serve.sock"
MAX_REQUEST_BYTES = 4096
REQUEST_READ_TIMEOUT_S = 5.0
REPLY_WRITE_TIMEOUT_S = 5.0
ACCEPT_POLL_S = 0.5  # how soon the serving thread sees that it should stop
JOIN_TIMEOUT_S = 10.0


class ControlError(PDError):
    """No serve answers for that work folder, or it answered with an error."""


class RestartRequest(msgspec.Struct, frozen=True, tag=True):
    # A pool ("prefill", "decode"), an instance ("decode-0"), or None: every instance.
    target: str | None
    version: int = CONTROL_VERSION


class Progress(msgspec.Struct, frozen=True, tag=True):
    line: str


class Done(msgspec.Struct, frozen=True, tag=True):
    ok: bool
    message: str


Reply = Progress | Done
_request_decoder = msgspec.json.Decoder(RestartRequest)
_reply_decoder = msgspec.json.Decoder(Reply)

# Rolls ``target``, calling ``report`` per step; raises ``PDError`` with what went wrong.
Handler = Callable[[str | None, Callable[[str], None]], None]


def socket_path(workdir: Path) -> Path:
    return workdir / CONTROL_FOLDER / SOCKET_NAME


class ControlServer:
    """Answers ``RestartRequest``s on ``socket_path(workdir)`` with ``handler``, one at a time,
    on a thread of its own; ``close`` stops it and removes the socket."""

    def __init__(self, workdir: Path, handler: Handler) -> None:
        self.path = socket_path(workdir)
        self._handler = handler
        self._stop = threading.Event()
        folder = self.path.parent
        folder.mkdir(mode=0o700, exist_ok=True)
        folder.chmod(0o700)  # mkdir's mode is masked, and an old folder may have other modes
        self.path.unlink(missing_ok=True)  # left by a serve that was killed
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._socket.bind(str(self.path))
            self.path.chmod(0o600)
            self._socket.listen(4)
            self._socket.settimeout(ACCEPT_POLL_S)
        except OSError:
            self._socket.close()
            raise
        self._thread = threading.Thread(target=self._serve, name="serve-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(JOIN_TIMEOUT_S)
        self._socket.close()
        self.path.unlink(missing_ok=True)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                logger.error("control socket: %s; `lmcache-pd restart` no longer answered", exc)
                return
            with connection:
                self._answer(connection)

    def _answer(self, connection: socket.socket) -> None:
        if not _same_user(connection):
            logger.warning("control socket: a caller of another user was refused")
            return
        connection.settimeout(REQUEST_READ_TIMEOUT_S)
        try:
            request = _request_decoder.decode(_read_line(connection))
        except (OSError, ControlError, msgspec.DecodeError) as exc:
            _send(connection, Done(False, f"bad request: {exc}"))
            return
        if request.version != CONTROL_VERSION:
            _send(
                connection,
                Done(
                    False,
                    f"control version {request.version}, serve speaks "
                    f"{CONTROL_VERSION}: use the lmcache-pd serve runs",
                ),
            )
            return
        logger.info("control socket: restart %s", request.target or "everything")
        connection.settimeout(REPLY_WRITE_TIMEOUT_S)

        def report(line: str) -> None:
            logger.info("restart: %s", line)
            with contextlib.suppress(OSError):  # the caller left: the roll goes on
                _send(connection, Progress(line))

        try:
            self._handler(request.target, report)
        except PDError as exc:
            _send(connection, Done(False, str(exc)))
            return
        _send(connection, Done(True, "done"))


def request_restart(workdir: Path, target: str | None, timeout_s: float) -> Iterator[str]:
    """Ask the ``serve`` of ``workdir`` to roll ``target``; yields its progress lines as they
    come. ``ControlError`` if no serve answers there, it refused, or ``timeout_s`` passed."""
    path = socket_path(workdir)
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(REQUEST_READ_TIMEOUT_S)
        try:
            connection.connect(str(path))
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise ControlError(
                f"no lmcache-pd serve is running for {workdir} (nothing answers on {path}: "
                f"{exc.strerror}); the engine `local` only"
            ) from None
        connection.sendall(msgspec.json.encode(RestartRequest(target)) + b"\n")
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ControlError(f"no answer within {timeout_s:.0f} s; serve may go on")
            connection.settimeout(left)
            try:
                reply = _reply_decoder.decode(_read_line(connection, None))
            except (OSError, msgspec.DecodeError) as exc:
                raise ControlError(f"serve stopped answering: {exc!r}") from None
            if isinstance(reply, Done):
                if not reply.ok:
                    raise ControlError(reply.message)
                return
            yield reply.line


def _read_line(connection: socket.socket, limit: int | None = MAX_REQUEST_BYTES) -> bytes:
    """One line, without its newline; ``ControlError`` past ``limit`` bytes or at EOF."""
    line = bytearray()
    while not line.endswith(b"\n"):
        if limit is not None and len(line) > limit:
            raise ControlError(f"a line over {limit} bytes")
        chunk = connection.recv(1)
        if not chunk:
            raise ControlError("the connection closed mid-line")
        line += chunk
    return bytes(line[:-1])


def _send(connection: socket.socket, reply: Reply) -> None:
    connection.sendall(msgspec.json.encode(reply) + b"\n")


def _same_user(connection: socket.socket) -> bool:
    """Whether the caller runs as this process's user (Linux; elsewhere the folder's mode is
    the only check)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return True
    credentials = connection.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", credentials)
    return uid == os.getuid()
