"""Which UCX transports a producer uses for one consumer, and the identity that decides it.

Measured (README, "Two hosts"): between two processes that share a kernel and a network
namespace, UCX's own choice (cross-memory attach for the data, SysV shared memory for NIXL's
notifications) is several times faster than TCP; between two network namespaces on one kernel,
that same choice leaves every write "PROC" and its notification never arrives, while a producer
restricted to TCP works against a consumer on UCX's own choice. So the consumer keeps its one
agent on the configured transports, and the producer, which has an agent per consumer anyway,
picks per peer: ``ucx_tls`` for a peer on its own stack, ``ucx_tls_remote`` (TCP) for any other.
The handshake then proves the choice with a self-test (``handshake.py``).

"Same stack" is the kernel's boot id plus the inodes of the network, IPC and PID namespaces.
Host names are no identity (containers and pods often share one, or all say "localhost"); the
boot id tells kernels apart (it is fresh each boot, even in a cloned VM); the namespaces are the
ones UCX's shared-memory transports depend on: the network namespace (the failure measured
here), IPC (SysV segments live in it) and PID (cross-memory attach names the peer by PID).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")
NAMESPACES = ("net", "ipc", "pid")
# The transports a handshake falls back to when the self-test of its first choice fails:
# measured to work between network namespaces, in either UCX error mode.
FALLBACK_UCX_TLS = "tcp"


def stack_identity() -> str:
    """This process's kernel and namespaces, e.g. ``"<boot id>/net:4026531840/ipc:.../pid:..."``;
    two processes with equal identities can use shared-memory transports between them."""
    try:
        boot_id = BOOT_ID_PATH.read_text().strip()
    except OSError:
        boot_id = f"host-{os.uname().nodename}"
    parts = [boot_id]
    for name in NAMESPACES:
        try:
            parts.append(f"{name}:{os.stat(f'/proc/self/ns/{name}').st_ino}")
        except OSError:
            parts.append(f"{name}:?")
    return "/".join(parts)


def describe(ucx_tls: str | None) -> str:
    """A transport setting as logs and errors name it."""
    return ucx_tls or "UCX's own choice"


@dataclass(frozen=True, slots=True)
class TransportChoice:
    """The UCX_TLS settings to try for one peer, in order, and why the first was chosen."""

    attempts: tuple[str | None, ...]
    same_stack: bool

    @property
    def first(self) -> str | None:
        return self.attempts[0]


def choose(
    ours: str,
    theirs: str,
    *,
    local_tls: str | None,
    remote_tls: str | None,
    fallback: bool,
    device_memory: bool = False,
) -> TransportChoice:
    """Local transports for a peer with our identity, remote ones for any other; then, if
    ``fallback``, TCP when that differs from the first choice. With ``device_memory`` (pages
    in GPU memory: ``buffer_device: cuda``), every list of transports also names UCX's
    ``cuda_copy``, without which UCX cannot move CUDA memory at all (over TCP it stages through
    host memory); a self-test of plain TCP would fail and every request be recomputed."""
    same = ours == theirs
    first = local_tls if same else remote_tls
    attempts: tuple[str | None, ...] = (first,)
    if fallback and first != FALLBACK_UCX_TLS:
        attempts += (FALLBACK_UCX_TLS,)
    if device_memory:
        attempts = tuple(_with_cuda_copy(tls) for tls in attempts)
    return TransportChoice(attempts, same)


def _with_cuda_copy(tls: str | None) -> str | None:
    """``tls`` able to move CUDA memory: as it is when UCX chooses (None, "all") or it names a
    CUDA transport already, else with ``cuda_copy`` added."""
    if tls is None or tls == "all" or "cuda" in tls:
        return tls
    return f"{tls},cuda_copy"
