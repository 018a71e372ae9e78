"""Two network stacks on one machine: a pair of network namespaces joined by a veth pair.

Two processes in different network namespaces share a kernel, memory and PIDs, but not an
interface, an address or a loopback: to UCX they look like two hosts (or two pods on one node),
which is where transports that work inside one stack silently fail (see README, "Two hosts").
Tests and ``benchmarks/transfer.py --netns`` run a producer in one namespace and a consumer in the
other through this module. Needs root and ``ip`` (iproute2); ``unavailable()`` says why not.

Every name carries this process's id and a random suffix, so runs side by side never meet, and
everything made is deleted on exit, in reverse order, even after a failure half-way.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import secrets
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from lmcache_pd.errors import ConfigError

logger = logging.getLogger(__name__)

IP_TIMEOUT_S = 10.0
NETNS_DIR = "/var/run/netns"
CLONE_NEWNET = 0x40000000
T = TypeVar("T")
# Interface names are at most 15 characters (IFNAMSIZ 16 with the NUL).
MAX_IFNAME_CHARS = 15


@dataclass(frozen=True, slots=True)
class Side:
    """One end: its namespace, its veth device and that device's address."""

    netns: str
    device: str
    address: str

    @property
    def wrap(self) -> list[str]:
        """What runs a command inside this namespace, put before its argv."""
        return ["ip", "netns", "exec", self.netns]

    def call(self, function: Callable[[], T], timeout_s: float) -> T:
        """``function()`` on a new thread of this process moved into this namespace (a
        network namespace belongs to a thread, and threads it starts inherit it): its sockets,
        and those of servers it starts on threads, live there. The caller's thread stays
        where it is. Raises what ``function`` raised; ``TimeoutError`` past ``timeout_s``."""
        outcome: list = []

        def run() -> None:
            try:
                _enter(self.netns)
                outcome.append((True, function()))
            except BaseException as exc:  # handed to the caller
                outcome.append((False, exc))

        thread = threading.Thread(target=run, name=f"in-{self.netns}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if not outcome:
            raise TimeoutError(f"call in network namespace {self.netns} ran past {timeout_s} s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value


@dataclass(frozen=True, slots=True)
class VethPair:
    """Two namespaces, ``left`` and ``right``, joined by one veth link."""

    left: Side
    right: Side

    def set_link(self, up: bool) -> None:
        """Cut (``up=False``) or restore the link, as a pulled cable would: both ends go down."""
        state = "up" if up else "down"
        for side in (self.left, self.right):
            _ip("-n", side.netns, "link", "set", "dev", side.device, state)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``), or None if they can."""
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    return None


def _ip(*args: str) -> None:
    try:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=IP_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        detail = exc.stderr.decode(errors="replace").strip()
        raise ConfigError(f"ip {' '.join(args)} failed: {detail}") from exc
    except subprocess.TimeoutExpired as exc:
        raise ConfigError(f"ip {' '.join(args)} did not finish in {IP_TIMEOUT_S} s") from exc


@contextlib.contextmanager
def veth_pair(tag: str = "lmpd") -> Iterator[VethPair]:
    """Make two namespaces and a veth pair with an address on each end; delete all on exit.

    The addresses are in a random 10.x.y.0/24 of their own: they exist only inside the two new
    namespaces, so they collide with nothing on the host's own stack.
    """
    reason = unavailable()
    if reason is not None:
        raise ConfigError(f"cannot make network namespaces: {reason}")
    suffix = f"{os.getpid()}{secrets.token_hex(2)}"
    subnet = f"10.{secrets.randbelow(250) + 2}.{secrets.randbelow(250) + 2}"
    left = Side(f"{tag}-{suffix}-a", f"v{suffix}a"[:MAX_IFNAME_CHARS], f"{subnet}.1")
    right = Side(f"{tag}-{suffix}-b", f"v{suffix}b"[:MAX_IFNAME_CHARS], f"{subnet}.2")
    with contextlib.ExitStack() as undo:
        for side in (left, right):
            _ip("netns", "add", side.netns)
            undo.callback(_delete_netns, side.netns)
        # Made in the left namespace: deleting the namespaces deletes the pair too.
        _ip("-n", left.netns, "link", "add", left.device, "type", "veth", "peer", "name",
            right.device, "netns", right.netns)  # fmt: skip
        for side in (left, right):
            _ip("-n", side.netns, "addr", "add", f"{side.address}/24", "dev", side.device)
            _ip("-n", side.netns, "link", "set", "dev", side.device, "up")
            _ip("-n", side.netns, "link", "set", "dev", "lo", "up")
        logger.info(
            "network namespaces %s (%s) and %s (%s) joined by a veth pair",
            left.netns,
            left.address,
            right.netns,
            right.address,
        )
        yield VethPair(left, right)


def _enter(name: str) -> None:
    """Move the calling thread into network namespace ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns into {name}: {os.strerror(error)}")
    finally:
        os.close(fd)


def _delete_netns(name: str) -> None:
    try:
        _ip("netns", "delete", name)
    except ConfigError as exc:
        logger.warning("could not delete network namespace %s: %s", name, exc)
