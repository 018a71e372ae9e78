"""The consumer rank in a process of its own, beside the vLLM worker that loads from it.

Why a process: the consumer must answer producers (alloc round trips, NIXL notifications) within
milliseconds, and inside vLLM's worker it cannot always. A forward pass or a busy-wait in native
code holds the worker's GIL, and no thread of ours runs meanwhile, unpinned or not (measured: 5
to 78 s of silence in 2P1D on 2 cores, 35 to 55 s on both decode ranks of TP 2, the watchdog
thread silent too). A process of its own is scheduled by the kernel like any other.

The receive buffer is a memfd both processes map (or, with ``buffer_device: cuda``, GPU memory the
service allocates on the worker's device and the worker opens by CUDA IPC: ``cuda_ipc.py``; the
process that registers memory with NIXL owns it, so UCX never has to re-export an imported
mapping): the service registers it with NIXL and lands chunks in it; the worker scatters from it,
and reads only pages its request holds (they keep their bytes until it releases them). Control is
msgpack over a socketpair, never blocking the worker (``service_channel.py``: a bounded outbox;
a message it has no room for fails what it was for): ``claim`` and ``release`` are one-way, and
the worker's one question per engine step, ``Progress``, asks how far every pending load got and
gets the consumer's counters with the answer. The worker waits for that answer only briefly
(``REPLY_WAIT_S``) and otherwise reads it at its next step, so a service that is slow to be
scheduled delays loads by a step, never vLLM's model thread. The one question the worker waits
for is ``LoadNow``, for a request whose KV had all landed when vLLM scheduled it (as the service
posted on its ``landed_board``): it is loaded before the step's forward pass, and the wait has a
deadline.

The service exits when its worker does: on end of file from the socketpair, or when its parent
process changes (checked every ``PARENT_CHECK_S``), or on SIGTERM, which the launcher sends the
instance's whole process group; each way closes the consumer, so nothing of it is left behind.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypeVar

import msgspec
import torch

from lmcache_pd.affinity import unpin_this_thread
from lmcache_pd.compat import KVProfile
from lmcache_pd.config import PDConfig
from lmcache_pd.errors import AllocationError, PDError, PeerTimeout, RequestDropped
from lmcache_pd.kernels.gpu_memory import ensure_room
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.protocol import PROCESS_EXIT_TIMEOUT_S, ChunkSpec
from lmcache_pd.transfer import cuda_ipc
from lmcache_pd.transfer.consumer import Consumer
from lmcache_pd.transfer.cuda_ipc import CudaBufferHandle
from lmcache_pd.transfer.receive_buffer import LandedChunk, landed_view, receive_buffer_bytes
from lmcache_pd.transfer.service_channel import ServiceChannel
from lmcache_pd.transfer.service_logging import queued_logging

logger = logging.getLogger(__name__)

Reply = TypeVar("Reply")

# The service imports torch and NIXL and faults its whole buffer in before it answers.
READY_TIMEOUT_S = 120.0
# How long a step waits for the answer to its progress question before leaving it to the next.
REPLY_WAIT_S = 0.001
PARENT_CHECK_S = 1.0
LOG_FORMAT = "%(asctime)s consumer-service[%(process)d] %(levelname)s %(name)s: %(message)s"


class Setup(msgspec.Struct, frozen=True):
    """What the service needs to build its consumer: the worker's first message."""

    config: PDConfig
    keyer: dict[str, str | int]
    profile: KVProfile | None
    # With buffer_device cuda: the GPU (index) to allocate the receive buffer on (the memfd is
    # then unused).
    cuda_device: int | None = None
    # Where to post chunks landed per unclaimed request (``landed_board.py``); None: nowhere.
    board: str | None = None


class Ready(msgspec.Struct, frozen=True):
    pid: int
    # With buffer_device cuda: the receive buffer the service allocated, for the worker to open.
    cuda_buffer: CudaBufferHandle | None = None


class Claim(msgspec.Struct, frozen=True, tag=True, array_like=True):
    req_id: str
    not_needed: list[bytes]


class Release(msgspec.Struct, frozen=True, tag=True, array_like=True):
    req_id: str
    # Its pushed chunks leave the cache too (``Consumer.release``).
    uncache: bool = False


class LoadQuery(msgspec.Struct, frozen=True, array_like=True):
    """A pending load: its request, how many of its chunks the worker has located already, and
    the keys of the rest."""

    req_id: str
    start: int
    keys: list[bytes]


class Progress(msgspec.Struct, frozen=True, tag=True, array_like=True):
    loads: list[LoadQuery]


class LoadNow(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Claim ``req_id`` (as ``Claim``) and say where ``keys`` landed, at once."""

    req_id: str
    not_needed: list[bytes]
    keys: list[bytes]
    # Decode serves the request alone: its keys are chunks landed for earlier requests, which
    # it takes a hold of (``Consumer.adopt``) instead of claiming a hold a push made.
    adopt: bool = False


class Keep(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Pages for chunks decode computed itself (``Consumer.keep_room``), held for ``req_id``."""

    req_id: str
    chunks: list[ChunkSpec]


class Kept(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """The chunks of ``Keep`` ``req_id`` are written in their pages (``Consumer.kept``)."""

    req_id: str
    alloc_id: int
    checksums: list[int] | None


class Stop(msgspec.Struct, frozen=True, tag=True, array_like=True):
    pass


Command = Claim | Release | Progress | LoadNow | Keep | Kept | Stop


class LoadState(msgspec.Struct, frozen=True, array_like=True):
    """How far one queried load got: why it was let go, or where its next chunks landed."""

    req_id: str
    start: int
    dropped: str | None
    landed: list[LandedChunk]


class ProgressReply(msgspec.Struct, frozen=True, tag=True, array_like=True):
    loads: list[LoadState]
    stats: dict[str, int]


class LoadNowReply(msgspec.Struct, frozen=True, tag=True, array_like=True):
    state: LoadState


class KeepReply(msgspec.Struct, frozen=True, tag=True, array_like=True):
    """Where to write each chunk of a ``Keep`` (None: here already), or why there is no room."""

    req_id: str
    alloc_id: int
    pages: list[int | None]
    refused: str | None = None


Answer = ProgressReply | LoadNowReply | KeepReply


class ConsumerServiceDown(PDError):
    """The consumer's process is gone: no KV will land for this decode instance."""


class ConsumerServiceBusy(PeerTimeout):
    """The consumer rank's process reads nothing now and the message could not be queued: what
    it was for fails (a load is recomputed), nothing waits."""


class ConsumerService:
    """Starts the consumer rank's process and talks to it; the worker's only way to it."""

    def __init__(
        self,
        config: PDConfig,
        keyer: ChunkKeyer,
        profile: KVProfile | None = None,
        device: torch.device | None = None,
        board: Path | None = None,
    ) -> None:
        """``config``: the rank's own (``PDConfig.for_rank``), with its page size. ``device``:
        a GPU to hold the receive buffer (``buffer_device: cuda``; the process allocates it
        there and shares it with this one by CUDA IPC), else it is a memfd both map.
        ``board``: where the process posts landed chunks for decode's scheduler."""
        self.page_bytes = config.page_bytes
        self.stats: dict[str, int] = {}
        # Messages refused because the process read nothing (``ConsumerServiceBusy``).
        self.refused = 0
        self._awaiting = False
        # The answer to the last progress question, read while waiting for a LoadNowReply.
        self._answered: ProgressReply | None = None
        self._down: str | None = None
        size = receive_buffer_bytes(config)
        memory = os.memfd_create("lmcache-pd-receive-buffer", os.MFD_CLOEXEC)
        on_gpu = device is not None and device.type == "cuda"
        cuda_device = None
        try:
            if on_gpu:
                cuda_device = torch.device(device).index
                if cuda_device is None:
                    cuda_device = torch.cuda.current_device()
                ensure_room(torch.device("cuda", cuda_device), size, "the GPU receive buffer")
            else:
                os.ftruncate(memory, size)
                self.buffer = _map(memory, size)
            ours, theirs = socket.socketpair()
            with theirs:
                self._process = subprocess.Popen(
                    [sys.executable, "-m", __name__, str(memory), str(theirs.fileno())],
                    pass_fds=(memory, theirs.fileno()),
                    stdin=subprocess.DEVNULL,
                )
            self._channel = ServiceChannel(ours)
            try:
                self._send(
                    Setup(
                        config,
                        keyer.params,
                        profile,
                        cuda_device,
                        None if board is None else str(board),
                    )
                )
                ready = self._receive(READY_TIMEOUT_S, Ready, "start")
                if on_gpu:
                    if ready.cuda_buffer is None:
                        raise ConsumerServiceDown("the service shared no GPU receive buffer")
                    # Theirs: valid while the process runs; close() stops it only after the
                    # worker's copies out of it are done.
                    self.buffer = cuda_ipc.open_shared(ready.cuda_buffer)
            except BaseException:
                self._kill()
                raise
        finally:
            os.close(memory)
        logger.info("consumer service process %d started for this rank", ready.pid)

    @property
    def pid(self) -> int:
        return self._process.pid

    def claim(self, req_id: str, not_needed: frozenset[bytes]) -> None:
        """A decode will wait for ``req_id``'s KV (see ``Consumer.claim``)."""
        self._send(Claim(req_id, sorted(not_needed)))

    def release(self, req_id: str, uncache: bool = False) -> None:
        """The request is done with its chunks (see ``Consumer.release``)."""
        self._send(Release(req_id, uncache))

    def progress(self, loads: Sequence[LoadQuery]) -> ProgressReply | None:
        """The answer to the last progress question, asking ``loads`` if none is out; None if
        it has not come yet, or could not be asked (ask again next step). Raises
        ``ConsumerServiceDown``."""
        if self._answered is None:
            if not self._awaiting:
                try:
                    self._send(Progress(list(loads)))
                except ConsumerServiceBusy:
                    return None  # asked again next step
                self._awaiting = True
            wait_s = REPLY_WAIT_S if loads else 0.0
            while self._answered is None and self._answer_ready(wait_s):
                self._take(self._receive(0, Answer, "progress"))
        reply, self._answered = self._answered, None
        return reply

    def load_now(
        self,
        req_id: str,
        not_needed: frozenset[bytes],
        keys: list[bytes],
        timeout_s: float,
        *,
        adopt: bool = False,
    ) -> LoadState:
        """Claim ``req_id`` (or with ``adopt``, hold the chunks landed for earlier requests)
        and say where ``keys`` landed, within ``timeout_s``. Raises ``PeerTimeout`` past it (a
        late answer is dropped then) or ``ConsumerServiceDown``."""
        self._send(LoadNow(req_id, sorted(not_needed), keys, adopt))
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self._receive(max(0.0, deadline - time.monotonic()), Answer, "load now")
            if isinstance(answer, LoadNowReply) and answer.state.req_id == req_id:
                return answer.state
            self._take(answer)

    def keep_room(self, req_id: str, chunks: list[ChunkSpec], timeout_s: float) -> KeepReply:
        """Pages for chunks decode computed itself, within ``timeout_s`` (``Keep``). Raises
        ``PeerTimeout`` past it (a late answer is dropped, its pages lapse unwritten) or
        ``ConsumerServiceDown``."""
        self._send(Keep(req_id, chunks))
        deadline = time.monotonic() + timeout_s
        while True:
            answer = self._receive(max(0.0, deadline - time.monotonic()), Answer, "keep")
            if isinstance(answer, KeepReply) and answer.req_id == req_id:
                return answer
            self._take(answer)

    def kept(self, req_id: str, alloc_id: int, checksums: list[int] | None) -> None:
        """The chunks of ``keep_room`` are written (``Kept``)."""
        self._send(Kept(req_id, alloc_id, checksums))

    def _answer_ready(self, wait_s: float) -> bool:
        if self._down is not None:
            return True
        try:
            return self._channel.poll(wait_s)
        except (EOFError, OSError):
            return True  # ``_receive`` says how it went down

    def _take(self, answer: Answer) -> None:
        """Keep a progress answer for ``progress``; a LoadNow or Keep answer that comes after
        its wait ended is dropped (that load failed, or those chunks were not kept, by then)."""
        if isinstance(answer, ProgressReply):
            self._answered, self._awaiting = answer, False
            self.stats = answer.stats

    def chunk(self, landed: LandedChunk) -> torch.Tensor:
        """A landed chunk's bytes, unchecked: the worker checks them in the pass that scatters
        them (``receive_buffer.check_landed``)."""
        return landed_view(self.buffer, self.page_bytes, landed)

    def close(self) -> None:
        """Ask the process to stop, kill it if it does not; idempotent."""
        if self._process.poll() is None:
            with contextlib.suppress(ConsumerServiceDown):
                self._send(Stop())
            try:
                self._process.wait(PROCESS_EXIT_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                logger.warning("consumer service %d did not stop, killing it", self.pid)
        self._kill()
        self._channel.close()

    def _kill(self) -> None:
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait(PROCESS_EXIT_TIMEOUT_S)

    def _send(self, message: msgspec.Struct) -> None:
        """Queue ``message``; never blocks. Raises ``ConsumerServiceBusy`` where the outbox has
        no room (the process reads nothing: stopped, or not scheduled), ``ConsumerServiceDown``
        where the process is gone."""
        if self._down is None:
            try:
                if self._channel.send(msgspec.msgpack.encode(message)):
                    return
            except (EOFError, OSError) as exc:
                self._went_down(f"cannot reach it: {exc or 'end of file'}")
            else:
                self.refused += 1
                raise ConsumerServiceBusy(
                    f"consumer service {self.pid} reads nothing: {type(message).__name__} not sent"
                )
        raise ConsumerServiceDown(f"consumer service {self.pid} is down: {self._down}")

    def _receive(self, timeout_s: float, kind: type[Reply], what: str) -> Reply:
        if self._down is None:
            try:
                if not self._channel.poll(timeout_s):
                    raise PeerTimeout(f"consumer service {self.pid}: no answer to {what}")
                return msgspec.msgpack.decode(self._channel.recv(), type=kind)
            except (EOFError, OSError) as exc:
                self._went_down(f"its connection ended ({exc or 'end of file'})")
            except msgspec.DecodeError as exc:  # a bug of ours: the channel cannot be trusted
                self._went_down(f"its answer to {what} is not one: {exc}")
        raise ConsumerServiceDown(f"consumer service {self.pid} is down: {self._down}")

    def _went_down(self, why: str) -> None:
        code = self._process.poll()
        self._down = why if code is None else f"{why}; it exited with status {code}"
        logger.error("consumer service %d is down: %s", self.pid, self._down)


def _map(memory: int, size: int) -> torch.Tensor:
    """The memfd's bytes, shared (writes by either process are seen by the other)."""
    return torch.from_file(f"/proc/self/fd/{memory}", shared=True, size=size, dtype=torch.uint8)


def _serve(memory: int, connection: Connection) -> None:
    """The service process: one consumer, answering its worker until told to stop or orphaned."""
    parent = os.getppid()
    setup = msgspec.msgpack.decode(connection.recv_bytes(), type=Setup)
    # Its log lines are written by a thread of their own (``service_logging.py``), never by the
    # serving loop that logs them.
    with queued_logging(setup.config.log_level, LOG_FORMAT) as log_writer:
        # It starts on the one core vLLM pinned its worker to; threads started after this
        # (the log writer's, the consumer's) run anywhere it may.
        unpin_this_thread(setup.config.thread_cpus, "consumer service process")
        log_writer.start()
        _serve_consumer(memory, connection, setup, parent)


def _serve_consumer(memory: int, connection: Connection, setup: Setup, parent: int) -> None:
    shared = None
    if setup.cuda_device is not None:
        # This process's CUDA work goes to the worker's GPU, not GPU 0, whatever its rank.
        torch.cuda.set_device(setup.cuda_device)
        buffer = torch.zeros(
            receive_buffer_bytes(setup.config), dtype=torch.uint8, device=setup.cuda_device
        )
        shared = cuda_ipc.share(buffer)
    else:
        buffer = _map(memory, receive_buffer_bytes(setup.config))
    os.close(memory)
    commands = msgspec.msgpack.Decoder(Command)
    signal.signal(signal.SIGTERM, _unwind)
    board = None if setup.board is None else Path(setup.board)
    with Consumer(
        setup.config, ChunkKeyer(**setup.keyer), profile=setup.profile, buffer=buffer, board=board
    ) as consumer:
        # What start-up made (torch, NIXL, the consumer: ~170,000 objects) out of the cyclic
        # collector's sight: a full collection, which can come on any allocation of the
        # serving loop, then walks only what serving made (measured with these imports: 60 ms
        # a full collection before, ~0 after).
        gc.freeze()
        connection.send_bytes(msgspec.msgpack.encode(Ready(os.getpid(), shared)))
        while True:
            if not connection.poll(PARENT_CHECK_S):
                if os.getppid() != parent:
                    logger.warning("the worker that started this consumer is gone; stopping")
                    return
                continue
            try:
                command = commands.decode(connection.recv_bytes())
            except (EOFError, OSError):
                logger.info("the worker closed its connection; stopping")
                return
            if isinstance(command, Stop):
                return
            _answer(consumer, connection, command)


def _unwind(signum: int, _: object) -> None:
    """SIGTERM unwinds the service like a Stop: the ``with`` closes its consumer (its sockets,
    NIXL agent and landed board) instead of the process vanishing with them."""
    logger.info("signal %d: stopping", signum)
    raise SystemExit(0)


def _answer(consumer: Consumer, connection: Connection, command: Command) -> None:
    """Carry out one command; a question is answered even if carrying it out failed (with no
    loads, or the load let go), since the worker waits for the answer."""
    loads: list[LoadState] = []
    if isinstance(command, Keep):
        connection.send_bytes(msgspec.msgpack.encode(_keep_room(consumer, command)))
        return
    try:
        if isinstance(command, Claim):
            consumer.claim(command.req_id, frozenset(command.not_needed))
        elif isinstance(command, Release):
            consumer.release(command.req_id, uncache=command.uncache)
        elif isinstance(command, Kept):
            consumer.kept(command.req_id, command.alloc_id, command.checksums)
        elif isinstance(command, LoadNow):
            if command.adopt:
                dropped = consumer.adopt(command.req_id, command.keys)
            else:
                dropped = consumer.claim(command.req_id, frozenset(command.not_needed))
            landed: list[LandedChunk] = []
            if dropped is None:
                dropped, landed = consumer.load_progress(command.req_id, command.keys)
            loads.append(LoadState(command.req_id, 0, dropped, landed))
        else:
            for query in command.loads:
                dropped, landed = consumer.load_progress(query.req_id, query.keys)
                loads.append(LoadState(query.req_id, query.start, dropped, landed))
    except Exception:  # the service must outlive any one bad command
        consumer.count_internal_error()
        logger.exception("consumer service: %s failed, serving on", type(command).__name__)
        loads = []
    if isinstance(command, Progress):
        reply = ProgressReply(loads, consumer.stats_snapshot())
        connection.send_bytes(msgspec.msgpack.encode(reply))
    elif isinstance(command, LoadNow):
        state = loads[0] if loads else LoadState(command.req_id, 0, "internal error", [])
        connection.send_bytes(msgspec.msgpack.encode(LoadNowReply(state)))


def _keep_room(consumer: Consumer, command: Keep) -> KeepReply:
    """The answer to a ``Keep``: pages, or why none (no room now: decode keeps nothing)."""
    try:
        allocation = consumer.keep_room(command.req_id, command.chunks)
    except (AllocationError, RequestDropped) as exc:
        return KeepReply(command.req_id, 0, [], str(exc))
    except Exception:  # the service must outlive any one bad command
        consumer.count_internal_error()
        logger.exception("consumer service: Keep failed, serving on")
        return KeepReply(command.req_id, 0, [], "internal error")
    return KeepReply(command.req_id, allocation.alloc_id, allocation.pages)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), Connection(int(sys.argv[2])))
