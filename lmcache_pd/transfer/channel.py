"""The one owner of a process's NIXL agent: register, handshake, batched WRITE, poll, notifications.

Nothing else in lmcache-pd imports NIXL. NIXL is not thread-safe: a ``NixlChannel`` is used by one
thread at a time (its owner serialises calls). Every wait here has a deadline, because with UCX's
error-handling mode "none" a cut link is never reported: only our own clock notices.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import logging
import os
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from lmcache_pd.backoff import SpinThenBackoff
from lmcache_pd.config import PDConfig
from lmcache_pd.errors import TransferError, WriteTimeout

logger = logging.getLogger(__name__)

PeerName = str
# One piece of a WRITE: (local address, remote address, bytes).
Segment = tuple[int, int, int]
# UCX backends are created one at a time on a host (ai-dynamo/nixl#1668: two agents creating
# theirs at the same moment can hang in createBackend). One creation takes ~0.4-0.7 s here; past
# this wait we go ahead anyway, and say so.
BACKEND_LOCK_PATH = os.path.join(tempfile.gettempdir(), "lmcache-pd-ucx-backend.lock")
BACKEND_LOCK_TIMEOUT_S = 30.0


# NIXL's memory type of a buffer on each torch device type: host memory (DRAM) or a GPU's (VRAM,
# which UCX moves with its CUDA transports).
MEM_TYPES = {"cpu": "DRAM", "cuda": "VRAM"}


class XferState(enum.Enum):
    """NIXL's "PROC" / "DONE" / "ERR" strings, as one enum."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"


# NIXL's state strings, looked up on every poll (a dict, several times quicker than the call).
_STATE_OF = {state.value: state for state in XferState}


@dataclass(frozen=True, slots=True)
class RegisteredBuffer:
    """Where a channel's registered buffer lives, as a peer needs to know it."""

    mem_type: str
    device_id: int
    base_addr: int
    nbytes: int


class XferHandle(Protocol):
    """An opaque posted transfer; only the channel that made it understands it."""


class Channel(Protocol):
    """What the producer and consumer need from a transport (NIXL, or the in-tree fake)."""

    agent_name: str

    def register(self, buffer: torch.Tensor) -> RegisteredBuffer: ...
    def local_metadata(self) -> bytes: ...
    def add_peer(self, metadata: bytes) -> PeerName: ...
    def remove_peer(self, peer: PeerName) -> None: ...
    def post_write(
        self, peer: PeerName, segments: Sequence[Segment], remote: RegisteredBuffer, notif: bytes
    ) -> XferHandle: ...
    def poll(self, handle: XferHandle) -> XferState: ...
    def release(self, handle: XferHandle) -> bool: ...
    def notifications(self) -> list[tuple[PeerName, bytes]]: ...
    def close(self) -> None: ...


def wait_for_transfer(channel: Channel, handle: XferHandle, deadline: float, what: str) -> None:
    """Poll ``handle`` until DONE; raise ``TransferError`` on ERR and ``WriteTimeout`` at
    ``deadline`` (a ``time.monotonic()`` value). Spins first, then backs off."""
    pace = SpinThenBackoff()
    while True:
        state = channel.poll(handle)
        if state is XferState.DONE:
            return
        if state is XferState.ERR:
            raise TransferError(f"{what}: transfer failed")
        now = time.monotonic()
        if now >= deadline:
            raise WriteTimeout(f"{what}: transfer not done after {now - pace.started:.3f} s")
        pace.pause()


def unique_agent_name(role: str) -> str:
    """Agent names must differ across every process that may ever meet."""
    return f"lmcache-pd-{role}-{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def _environment(name: str, value: str | None) -> Iterator[None]:
    """Set ``name`` while UCX reads its environment (at backend creation), then put it back, so
    that one channel's choice does not leak into later channels or child processes."""
    if value is None:
        yield
        return
    previous = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if previous is None:
            del os.environ[name]
        else:
            os.environ[name] = previous


@contextlib.contextmanager
def _one_backend_at_a_time(path: str = BACKEND_LOCK_PATH) -> Iterator[None]:
    """Hold a host-wide file lock (every process and thread of ours on this host) while a NIXL
    agent and its backends are made; the UCX_TLS change made meanwhile is serialised with it."""
    deadline = time.monotonic() + BACKEND_LOCK_TIMEOUT_S
    with open(path, "a") as lock_file:
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning(
                        "UCX backend lock %s still held after %.0f s; creating ours anyway",
                        path,
                        BACKEND_LOCK_TIMEOUT_S,
                    )
                    yield
                    return
                time.sleep(0.01)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _nixl_error_types() -> tuple[type[BaseException], ...]:
    from nixl import _bindings

    return tuple(
        value
        for name, value in vars(_bindings).items()
        if name.startswith("nixl") and name.endswith("Error") and isinstance(value, type)
    )


class NixlChannel:
    """A NIXL agent with one UCX backend and one registered buffer."""

    def __init__(
        self,
        *,
        role: str,
        backends: list[str],
        ucx_error_handling_mode: str,
        progress_thread: bool,
        ucx_tls: str | None = None,
    ) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self._errors = _nixl_error_types()
        self.agent_name = unique_agent_name(role)
        with (
            _one_backend_at_a_time(),
            _environment("UCX_TLS", ucx_tls),
            self._mapped("create agent"),
        ):
            self._agent = nixl_agent(
                self.agent_name,
                nixl_agent_config(enable_prog_thread=progress_thread, backends=[]),
            )
            for backend in backends:
                params = {"ucx_error_handling_mode": ucx_error_handling_mode}
                self._agent.create_backend(backend, params if backend == "UCX" else {})
        self._registered: object | None = None
        self._buffer: RegisteredBuffer | None = None
        self._peers: set[PeerName] = set()
        self._closed = False

    @classmethod
    def from_config(cls, config: PDConfig, *, role: str) -> NixlChannel:
        """The channel that ``config``'s NIXL settings describe."""
        return cls(
            role=role,
            backends=config.nixl_backends,
            ucx_error_handling_mode=config.ucx_error_handling_mode,
            progress_thread=config.nixl_progress_thread,
            ucx_tls=config.ucx_tls,
        )

    def _mapped(self, action: str, subject: str = "") -> _NixlFailures:
        """Turn NIXL's exceptions into ``TransferError`` at this boundary."""
        return _NixlFailures(self._errors, action, subject)

    def register(self, buffer: torch.Tensor) -> RegisteredBuffer:
        """Register the one buffer this channel reads from or is written into."""
        if self._buffer is not None:
            raise RuntimeError(f"{self.agent_name} already has a registered buffer")
        if buffer.device.type not in MEM_TYPES or not buffer.is_contiguous():
            raise ValueError(
                f"only contiguous CPU or CUDA buffers are registered, got one on {buffer.device}"
            )
        mem_type = MEM_TYPES[buffer.device.type]
        with self._mapped("register memory"):
            self._registered = self._agent.register_memory(buffer)  # NIXL reads its type
        self._buffer = RegisteredBuffer(
            mem_type=mem_type,
            device_id=buffer.device.index or 0,
            base_addr=buffer.data_ptr(),
            nbytes=buffer.numel() * buffer.element_size(),
        )
        return self._buffer

    def local_metadata(self) -> bytes:
        with self._mapped("get metadata"):
            return self._agent.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> PeerName:
        with self._mapped("add remote agent"):
            peer = self._agent.add_remote_agent(metadata)
        name = peer.decode() if isinstance(peer, bytes) else str(peer)
        self._peers.add(name)
        return name

    def remove_peer(self, peer: PeerName) -> None:
        if peer in self._peers:
            self._peers.discard(peer)
            with self._mapped("remove remote agent"):
                self._agent.remove_remote_agent(peer)

    def post_write(
        self, peer: PeerName, segments: Sequence[Segment], remote: RegisteredBuffer, notif: bytes
    ) -> XferHandle:
        """One WRITE of one or more segments, whose notification ``notif`` reaches the peer
        after all of its data. Descriptors are made from lists: for the few segments of a
        push, several times quicker than from numpy arrays."""
        if self._buffer is None:
            raise RuntimeError("register a buffer before writing")
        if not segments:
            raise ValueError(f"a WRITE to {peer} needs at least one segment")
        device, far_device = self._buffer.device_id, remote.device_id
        local = [(address, nbytes, device) for address, _, nbytes in segments]
        far = [(address, nbytes, far_device) for _, address, nbytes in segments]
        with self._mapped("post write to", peer):
            handle = self._agent.initialize_xfer(
                "WRITE",
                self._agent.get_xfer_descs(local, self._buffer.mem_type),
                self._agent.get_xfer_descs(far, remote.mem_type),
                peer,
                notif,
            )
            try:
                state = self._agent.transfer(handle)
            except self._errors:
                handle.release()
                raise
        if state == "ERR":
            handle.release()
            raise TransferError(f"NIXL refused to post a write to {peer}")
        return handle

    def poll(self, handle: XferHandle) -> XferState:
        with self._mapped("check transfer state"):
            return _STATE_OF[self._agent.check_xfer_state(handle)]

    def release(self, handle: XferHandle) -> bool:
        """Release a handle, cancelling it if still in flight. False if NIXL refused (the
        transfer may then still write), which is logged."""
        try:
            handle.release()
        except self._errors as exc:
            logger.warning("%s: could not release a transfer handle: %s", self.agent_name, exc)
            return False
        return True

    def notifications(self) -> list[tuple[PeerName, bytes]]:
        with self._mapped("get notifications"):
            new = self._agent.get_new_notifs()
        return [(peer, message) for peer, messages in new.items() for message in messages]

    def close(self) -> None:
        """Forget peers, deregister the buffer; idempotent."""
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers):
            with contextlib.suppress(TransferError):
                self.remove_peer(peer)
        if self._registered is not None:
            with contextlib.suppress(*self._errors):
                self._agent.deregister_memory(self._registered)
            self._registered = None

    def __enter__(self) -> NixlChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _NixlFailures:
    """A context that raises ``TransferError`` for a NIXL exception, naming the action: a
    class, not a generator, as it wraps every write and poll (a generator's context took ~6x
    as long here, which a one-chunk push pays a few times)."""

    __slots__ = ("_action", "_errors", "_subject")

    def __init__(self, errors: tuple[type[BaseException], ...], action: str, subject: str) -> None:
        self._errors = errors
        self._action = action
        self._subject = subject

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, _: object
    ) -> bool:
        if kind is not None and issubclass(kind, self._errors):
            action = f"{self._action} {self._subject}" if self._subject else self._action
            raise TransferError(f"NIXL {action} failed: {kind.__name__}: {exc}") from exc
        return False
