"""The worker's channel to its consumer process never blocks its thread: a process that reads
nothing fills only a bounded outbox, and one blocked writing a large answer is read while the
worker writes (with blocking writes on both sides, the two wait on each other forever)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest

from lmcache_pd.transfer.service_channel import MAX_OUTBOX_BYTES, ServiceChannel

ANSWER_BYTES = 1 << 20
CLAIM_BYTES = 4096
CLAIMS = 400  # 1.6 MB: past both sockets' buffers


def answering_peer(theirs: socket.socket, got: list[int]) -> threading.Thread:
    """The process's side: read one question, write a 1 MiB answer (blocking until it is
    read), then read all else."""

    def serve() -> None:
        connection = Connection(theirs.detach())
        try:
            connection.recv_bytes()
            connection.send_bytes(b"a" * ANSWER_BYTES)
        except OSError:  # the control's end: its socket shut down under the write
            return
        while True:
            try:
                got.append(len(connection.recv_bytes()))
            except (EOFError, OSError):
                return

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_large_answer_crossing_a_burst_of_claims_does_not_deadlock() -> None:
    ours, theirs = socket.socketpair()
    got: list[int] = []
    peer = answering_peer(theirs, got)
    channel = ServiceChannel(ours)
    started = time.monotonic()
    assert channel.send(b"progress?")
    sent = sum(channel.send(b"c" * CLAIM_BYTES) for _ in range(CLAIMS))
    assert time.monotonic() - started < 2.0  # never blocked
    assert channel.poll(5.0) and len(channel.recv()) == ANSWER_BYTES
    assert sent == CLAIMS  # the answer read, the peer read on: the outbox emptied
    deadline = time.monotonic() + 5
    while len(got) < CLAIMS and time.monotonic() < deadline:
        channel.poll(0.05)  # writes the outbox out as the peer reads
    assert len(got) == CLAIMS
    channel.close()
    peer.join(5)


def test_control_blocking_writes_on_both_sides_wait_on_each_other() -> None:
    ours, theirs = socket.socketpair()
    peer = answering_peer(theirs, [])
    worker = Connection(os.dup(ours.fileno()))

    def burst() -> None:
        with contextlib.suppress(OSError):
            worker.send_bytes(b"progress?")
            for _ in range(CLAIMS):
                worker.send_bytes(b"c" * CLAIM_BYTES)

    thread = threading.Thread(target=burst, daemon=True)
    thread.start()
    thread.join(2.0)
    assert thread.is_alive()  # deadlocked: each waits for the other to read
    ours.shutdown(socket.SHUT_RDWR)  # ends both: the peer's write fails, so does the burst's
    thread.join(5)
    peer.join(5)
    assert not thread.is_alive() and not peer.is_alive()
    worker.close()
    ours.close()


def test_a_peer_that_reads_nothing_fills_only_the_outbox() -> None:
    ours, theirs = socket.socketpair()
    channel = ServiceChannel(ours)
    started = time.monotonic()
    refused = sum(
        not channel.send(b"c" * CLAIM_BYTES) for _ in range(2 * MAX_OUTBOX_BYTES // CLAIM_BYTES)
    )
    assert refused > 0 and time.monotonic() - started < 2.0
    assert not channel.poll(0.05)
    theirs.close()
    with pytest.raises((EOFError, OSError)):
        channel.poll(1.0)
        channel.send(b"x")
    channel.close()
