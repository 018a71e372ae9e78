"""An in-process stand-in for ``NixlChannel``, for testing the layers above the transport.

Fake channels meet through a ``FakeFabric`` that the test creates and passes to each (no global
registry). A write copies real bytes between the registered buffers of one process when it is
first polled as done, then queues its notification for the target, as NIXL does. Knobs make it
misbehave: stay PROC for N polls or while ``stalled``, fail on post or poll, or lose
notifications.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmcache_pd.errors import TransferError
from lmcache_pd.transfer.channel import PeerName, RegisteredBuffer, Segment, XferState


@dataclass
class FakeFabric:
    """Joins fake channels by agent name and carries their notifications."""

    channels: dict[str, FakeChannel] = field(default_factory=dict)
    inboxes: defaultdict[str, list[tuple[PeerName, bytes]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    lock: threading.Lock = field(default_factory=threading.Lock)
    _names: itertools.count = field(default_factory=itertools.count)


@dataclass
class _FakeXfer:
    source: str
    peer: PeerName
    segments: list[Segment]
    notif: bytes
    polls_left: int
    state: XferState = XferState.PROC


class FakeChannel:
    """Same interface as ``NixlChannel``; see the module docstring for the knobs."""

    def __init__(
        self,
        fabric: FakeFabric,
        role: str,
        *,
        polls_before_done: int = 0,
        stalled: bool = False,
        fail_post: bool = False,
        fail_poll: bool = False,
        drop_notifications: bool = False,
    ) -> None:
        self.agent_name = f"fake-{role}-{next(fabric._names)}"
        self.polls_before_done = polls_before_done
        self.stalled = stalled
        self.fail_post = fail_post
        self.fail_poll = fail_poll
        self.drop_notifications = drop_notifications
        self.writes_posted = 0
        self.peers: set[PeerName] = set()
        self._fabric = fabric
        self._buffer: RegisteredBuffer | None = None
        fabric.channels[self.agent_name] = self

    def register(self, buffer: torch.Tensor) -> RegisteredBuffer:
        self._buffer = RegisteredBuffer("DRAM", 0, buffer.data_ptr(), buffer.numel())
        return self._buffer

    def local_metadata(self) -> bytes:
        return self.agent_name.encode()

    def add_peer(self, metadata: bytes) -> PeerName:
        name = metadata.decode()
        if name not in self._fabric.channels:
            raise TransferError(f"no fake agent {name}")
        self.peers.add(name)
        return name

    def remove_peer(self, peer: PeerName) -> None:
        self.peers.discard(peer)

    def post_write(
        self, peer: PeerName, segments: Sequence[Segment], remote: RegisteredBuffer, notif: bytes
    ) -> _FakeXfer:
        if not segments:
            raise ValueError(f"a WRITE to {peer} needs at least one segment")
        if self.fail_post or peer not in self._fabric.channels:
            raise TransferError(f"fake post to {peer} failed")
        self.writes_posted += 1
        return _FakeXfer(self.agent_name, peer, list(segments), notif, self.polls_before_done)

    def poll(self, handle: _FakeXfer) -> XferState:
        if handle.state is not XferState.PROC:
            return handle.state
        if self.fail_poll:
            handle.state = XferState.ERR
        elif self.stalled:
            pass
        elif handle.polls_left > 0:
            handle.polls_left -= 1
        else:
            self._complete(handle)
        return handle.state

    def release(self, handle: _FakeXfer) -> bool:
        """A released transfer that never completed never lands (NIXL cancels it)."""
        if handle.state is XferState.PROC:
            handle.state = XferState.ERR
        return True

    def notifications(self) -> list[tuple[PeerName, bytes]]:
        with self._fabric.lock:
            return self._fabric.inboxes.pop(self.agent_name, [])

    def close(self) -> None:
        self._fabric.channels.pop(self.agent_name, None)

    def _complete(self, handle: _FakeXfer) -> None:
        target = self._fabric.channels.get(handle.peer)
        if target is None or target._buffer is None:
            handle.state = XferState.ERR
            return
        low, high = target._buffer.base_addr, target._buffer.base_addr + target._buffer.nbytes
        for local_addr, remote_addr, nbytes in handle.segments:
            if not low <= remote_addr <= remote_addr + nbytes <= high:
                handle.state = XferState.ERR
                return
            ctypes.memmove(remote_addr, local_addr, nbytes)
        if handle.notif and not self.drop_notifications:
            with self._fabric.lock:
                self._fabric.inboxes[handle.peer].append((handle.source, handle.notif))
        handle.state = XferState.DONE
