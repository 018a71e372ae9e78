"""The consumer rank in its own process: it serves producers while the process that loads from
it cannot run Python, and it ends with that process.

Real NIXL between real processes: the producer is a ``ProducerProcess``; the consumer's worker
side is this test process, whose GIL a pure-Python loop holds (``sys.setswitchinterval`` keeps
any other thread from taking it), as a forward pass or a native busy-wait in vLLM's worker does.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_pd.config import load_config
from lmcache_pd.errors import PeerTimeout
from lmcache_pd.harness.producer_process import ProducerProcess
from lmcache_pd.kernels.integrity import checksum
from lmcache_pd.transfer.consumer import Consumer
from lmcache_pd.transfer.consumer_service import ConsumerService, ConsumerServiceBusy, LoadQuery
from lmcache_pd.transfer.receive_buffer import LandedChunk
from tests.helpers import CHUNK_SIZE, consumer_fields, make_keyer, wait_for, write_config

pytestmark = pytest.mark.processes
HOLD_GIL_S = 3.0
# The producer gives up on an unanswered handshake or allocation after this: well inside
# HOLD_GIL_S.
ANSWER_TIMEOUT_S = 1.0
TOKENS = 3 * CHUNK_SIZE


@pytest.fixture(scope="module")
def producer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProducerProcess]:
    directory = tmp_path_factory.mktemp("producer")
    fields = consumer_fields(
        kv_role="kv_producer",
        alloc_timeout_s=ANSWER_TIMEOUT_S,
        handshake_timeout_s=ANSWER_TIMEOUT_S,
    )
    with ProducerProcess(
        write_config(directory, "producer", **fields), log_path=directory / "producer.log"
    ) as process:
        yield process


def hold_the_gil(seconds: float) -> None:
    """Run Python on this thread only, for ``seconds``: no other thread of this process runs."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 5)
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            pass
    finally:
        sys.setswitchinterval(interval)


def push_while_holding_the_gil(producer: ProducerProcess, fields: dict, req_id: str) -> dict:
    """Start a push to the consumer at ``fields``' ports, hold this process's GIL while it
    runs, and return how it went."""
    producer.send(
        "push",
        req_id=req_id,
        host="127.0.0.1",
        init_port=fields["init_port"],
        alloc_port=fields["alloc_port"],
        tokens=TOKENS,
        seed=7,
    )
    hold_the_gil(HOLD_GIL_S)
    return producer.result()


def test_the_consumer_process_serves_pushes_while_its_worker_holds_the_gil(
    producer: ProducerProcess,
) -> None:
    fields = consumer_fields()
    service = ConsumerService(load_config(None, environ={}, **fields), make_keyer())
    try:
        outcome = push_while_holding_the_gil(producer, fields, "held")
        assert outcome["ok"], outcome
        assert outcome["seconds"] < HOLD_GIL_S / 2  # done while this process could not run
        keys = [bytes.fromhex(key) for key in outcome["keys"]]
        landed: list[LandedChunk] = []

        def all_located() -> bool:
            reply = service.progress([LoadQuery("held", 0, keys)])
            if reply is not None:
                landed[:] = reply.loads[0].landed
            return len(landed) == len(keys)

        wait_for(all_located, what="the landed chunks located")
        # read from the memory both processes map, checked against the producer's checksums
        assert [landed_checksum(service, chunk) for chunk in landed] == outcome["checksums"]
    finally:
        service.close()


def landed_checksum(service: ConsumerService, chunk: LandedChunk) -> int:
    return checksum(service.chunk(chunk))


def test_control_a_consumer_inside_the_worker_stalls_with_it(producer: ProducerProcess) -> None:
    """Negative control: the same push to a consumer whose thread shares the held GIL fails."""
    fields = consumer_fields()
    with Consumer(load_config(None, environ={}, **fields), make_keyer()):
        outcome = push_while_holding_the_gil(producer, fields, "stalled")
    assert not outcome["ok"], outcome["seconds"]
    # no answer to its handshake (or, had that been done, to its allocation) in time
    assert outcome["error"] in {"PeerUnreachable", "PeerTimeout"}, outcome["detail"]


SERVICE_OWNER = """
import sys, time
from pathlib import Path
from lmcache_pd.config import load_config
from lmcache_pd.transfer.consumer_service import ConsumerService
from lmcache_pd.kernels.integrity import checksum
from lmcache_pd.keys import ChunkKeyer
keyer = ChunkKeyer(model_name="m", world_size=1, worker_id=0, kv_dtype="float32", chunk_size=256)
board = Path(sys.argv[3])
service = ConsumerService(load_config(sys.argv[1]), keyer, board=board)  # made at its start
with open(sys.argv[2], "w") as out:
    out.write(str(service.pid))
time.sleep(600)
"""


def start_service_owner(directory: Path, fields: dict) -> tuple[subprocess.Popen, int, Path]:
    """A process that starts a consumer service (in its own process group, as a vLLM instance
    is), the service's pid, and its landed board."""
    config = write_config(directory, "consumer", **fields)
    pid_file, board = directory / "service.pid", directory / "landed-board"
    owner = subprocess.Popen(
        [sys.executable, "-c", SERVICE_OWNER, str(config), str(pid_file), str(board)],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(pid_file.exists, timeout_s=60.0, what="the service to start")
        wait_for(lambda: pid_file.read_text() != "", what="its pid")
    except BaseException:
        stop_group(owner)
        raise
    assert board.exists()
    return owner, int(pid_file.read_text()), board


def stop_group(owner: subprocess.Popen) -> None:
    if owner.poll() is None:
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(10)


def test_the_consumer_process_ends_with_its_worker_and_frees_its_ports(tmp_path: Path) -> None:
    fields = consumer_fields()
    owner, service_pid, board = start_service_owner(tmp_path, fields)
    try:
        os.kill(service_pid, 0)  # it runs
        owner.send_signal(signal.SIGKILL)  # as a crash ends a decode instance's worker
        owner.wait(10)
        wait_for(lambda: not alive(service_pid), timeout_s=5.0, what="the service to end")
    finally:
        stop_group(owner)
    assert not board.exists()
    # its ports can be bound again by the instance that replaces it
    with Consumer(load_config(None, environ={}, **fields), make_keyer()) as again:
        assert again.used_pages == 0


def test_the_consumer_process_stopped_with_its_instance_removes_its_board(tmp_path: Path) -> None:
    """The launcher stops a vLLM instance by SIGTERM to its whole process group, the service
    included: it must leave nothing behind (boards were found left by the hundred in /tmp)."""
    owner, service_pid, board = start_service_owner(tmp_path, consumer_fields())
    try:
        os.killpg(owner.pid, signal.SIGTERM)
        wait_for(lambda: not alive(service_pid), timeout_s=10.0, what="the service to end")
    finally:
        stop_group(owner)
    assert not board.exists()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie left to its new parent counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_a_stopped_consumer_process_never_blocks_its_worker() -> None:
    """SIGSTOP the process, then claims of 200 keys each in a loop from a thread: they once
    blocked it as soon as the socket's buffer was full (still blocked after 5 s); now the ones
    past the outbox are refused at once (``ConsumerServiceBusy``: what they were for fails), a
    progress question goes unanswered without a wait past its own, and a synchronous load
    fails by its deadline. Continued, the process reads its backlog and answers again."""
    service = ConsumerService(load_config(None, environ={}, **consumer_fields()), make_keyer())
    refused: list[str] = []

    def claims() -> None:
        keys = frozenset(os.urandom(16) for _ in range(200))
        for index in range(2000):
            try:
                service.claim(f"stopped-{index}", keys)
            except ConsumerServiceBusy:
                refused.append(f"stopped-{index}")

    try:
        os.kill(service.pid, signal.SIGSTOP)
        thread = threading.Thread(target=claims, daemon=True)
        thread.start()
        thread.join(5.0)
        assert not thread.is_alive()
        assert refused and service.refused == len(refused)
        started = time.monotonic()
        assert service.progress([LoadQuery("x", 0, [b"k" * 16])]) is None
        with pytest.raises(PeerTimeout):
            service.load_now("now", frozenset(), [b"k" * 16], 0.3)
        assert time.monotonic() - started < 1.0
    finally:
        os.kill(service.pid, signal.SIGCONT)
    try:
        wait_for(lambda: service.progress([]) is not None, 30, "answers again once continued")
    finally:
        service.close()
