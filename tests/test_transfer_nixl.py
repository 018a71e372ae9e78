"""Real NIXL between real OS processes: a consumer child process, the producer in the test.

Every test leaves the consumer's used pages at zero (checked after each test), and every fault
is checked for its bound in time, its counter and a log line naming the request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_pd import protocol
from lmcache_pd.errors import (
    AllocationError,
    BufferFull,
    ConfigError,
    IntegrityError,
    PeerTimeout,
    TransferError,
)
from lmcache_pd.harness.consumer_process import ConsumerProcess
from lmcache_pd.kernels.integrity import checksum
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.transfer.peer_state import PeerState
from lmcache_pd.transfer.producer import Producer
from lmcache_pd.transfer.reservations import RESERVE_BATCH
from tests.helpers import (
    BYTES_PER_TOKEN,
    CHUNK_SIZE,
    consumer_fields,
    make_chunks,
    make_keyer,
    producer_config,
    spec_for,
    write_config,
)

pytestmark = pytest.mark.processes
NUM_PAGES = 32
REPLY_TIMEOUT_MS = 2000


class Consumer:
    """A consumer child process with its config and log file."""

    def __init__(self, tmp: Path, **overrides: object) -> None:
        self.fields = consumer_fields(num_pages=NUM_PAGES, **overrides)
        self.log = tmp / "consumer.log"
        self.process = ConsumerProcess(
            write_config(tmp, "consumer", **self.fields), log_path=self.log
        )

    def spec(self, req_id: str) -> protocol.DisaggSpec:
        return spec_for(self.fields, req_id)

    def logged(self, text: str) -> bool:
        return text in self.log.read_text()


@pytest.fixture(scope="module")
def consumer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Consumer]:
    node = Consumer(tmp_path_factory.mktemp("consumer"), alloc_lease_s=2.0, transfer_timeout_s=1.0)
    with node.process:
        yield node


@pytest.fixture(scope="module")
def producer() -> Iterator[Producer]:
    # Asking first for every push: pages reserved ahead would be left unwritten for the lease.
    config = producer_config(num_pages=NUM_PAGES + 8, reserved_pages=0)
    with Producer(config) as producer:
        yield producer


@pytest.fixture(autouse=True)
def pages_return_to_zero(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "consumer" in request.fixturenames:
        node: Consumer = request.getfixturevalue("consumer")
        node.process.wait_until(lambda s: s["used_pages"] == 0, 10, "used pages back to zero")


def local_checksums(chunks: list[tuple[bytes, torch.Tensor]]) -> list[int]:
    return [checksum(tensor.view(-1).view(torch.uint8)) for _, tensor in chunks]


def wait_landed(node: Consumer, tokens: list[int]) -> None:
    deadline = time.monotonic() + 5
    while node.process.call("lookup", tokens=tokens) != len(tokens):
        assert time.monotonic() < deadline, "chunks did not land"
        time.sleep(0.005)


@pytest.mark.parametrize(
    "length", [1, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 5 * CHUNK_SIZE + 17]
)
def test_chunks_land_bit_exact_in_another_process(
    consumer: Consumer, producer: Producer, keyer: ChunkKeyer, length: int
) -> None:
    tokens = list(range(length))
    chunks = make_chunks(keyer.chunk_keys(tokens), seed=length)
    result = producer.push(consumer.spec(f"r-len-{length}"), chunks)
    assert result.chunks_sent == len(chunks) == -(-length // CHUNK_SIZE)
    assert result.bytes_sent == sum(t.numel() * 4 for _, t in chunks)
    wait_landed(consumer, tokens)
    landed = consumer.process.call("checksums", keys=[key.hex() for key, _ in chunks])
    assert landed == local_checksums(chunks)
    consumer.process.call("release", req_id=f"r-len-{length}")


@pytest.mark.parametrize("cache_share", [1.0, 0.0], ids=["cache", "no_cache"])
def test_a_prefix_pushed_once_is_not_written_again_while_cached(
    tmp_path: Path, producer: Producer, keyer: ChunkKeyer, cache_share: float
) -> None:
    node = Consumer(tmp_path, cache_share=cache_share)
    with node.process:
        first = list(range(3 * CHUNK_SIZE))
        chunks = make_chunks(keyer.chunk_keys(first), seed=5)
        producer.push(node.spec("a"), chunks)
        wait_landed(node, first)
        node.process.call("release", req_id="a")
        stats = node.process.stats()
        assert (stats["used_pages"], stats["cached_pages"]) == (0, 3 if cache_share else 0)
        # lookup (the longest prefix held here) counts cached chunks
        assert node.process.call("lookup", tokens=first) == (len(first) if cache_share else 0)
        # A later prompt shares the first two chunks and differs in the third.
        second = first[: 2 * CHUNK_SIZE] + list(range(9000, 9000 + CHUNK_SIZE))
        chunks_b = chunks[:2] + make_chunks(keyer.chunk_keys(second), seed=6)[2:]
        result = producer.push(node.spec("b"), chunks_b)
        assert (result.chunks_sent, result.chunks_skipped) == ((1, 2) if cache_share else (3, 0))
        wait_landed(node, second)
        landed = node.process.call("checksums", keys=[key.hex() for key, _ in chunks_b])
        assert landed == local_checksums(chunks_b)  # the kept chunks are the bytes sent first
        node.process.call("release", req_id="b")
        stats = node.process.stats()
        assert stats["cache_hits"] == (2 if cache_share else 0)


@pytest.mark.parametrize(
    "change", [None, "prompt", "model_name", "kv_dtype"], ids=["same", "prompt", "model", "dtype"]
)
def test_a_cached_chunk_serves_only_the_prefix_model_and_dtype_that_made_it(
    tmp_path: Path, producer: Producer, change: str | None
) -> None:
    """A chunk kept after its request is answered "already held" only to a push of the exact
    same prefix, model and dtype; any other is written anew (and so never loaded in its place)."""
    fields = {"model_name": "demo", "world_size": 1, "worker_id": 0, "kv_dtype": "float32"}
    first_keyer = ChunkKeyer(**fields, chunk_size=CHUNK_SIZE)
    tokens = list(range(2 * CHUNK_SIZE))
    node = Consumer(tmp_path, cache_share=1.0)
    with node.process:
        producer.push(node.spec("a"), make_chunks(first_keyer.chunk_keys(tokens), seed=1))
        wait_landed(node, tokens)
        node.process.call("release", req_id="a")
        assert node.process.stats()["cached_pages"] == 2
        other = dict(fields)
        if change in ("model_name", "kv_dtype"):
            other[change] = "other"
        keys = ChunkKeyer(**other, chunk_size=CHUNK_SIZE).chunk_keys(
            [7, *tokens[1:]] if change == "prompt" else tokens
        )
        result = producer.push(node.spec("b"), make_chunks(keys, seed=2))
        assert (result.chunks_sent, result.chunks_skipped) == ((0, 2) if change is None else (2, 0))
        node.process.call("release", req_id="b")


def test_chunk_altered_after_the_write_is_caught(
    consumer: Consumer, producer: Producer, keyer: ChunkKeyer
) -> None:
    tokens = list(range(3 * CHUNK_SIZE))
    chunks = make_chunks(keyer.chunk_keys(tokens), seed=99)
    producer.push(consumer.spec("r-altered"), chunks)
    wait_landed(consumer, tokens)
    keys = [key.hex() for key, _ in chunks]
    assert consumer.process.call("checksums", keys=keys) == local_checksums(chunks)  # control
    consumer.process.call("corrupt", key=keys[1], offset=12345)
    with pytest.raises(IntegrityError):
        consumer.process.call("checksums", keys=[keys[1]])
    assert consumer.process.stats()["integrity_failures"] == 1
    consumer.process.call("release", req_id="r-altered")


def test_chunks_already_held_are_not_sent_again(
    consumer: Consumer, producer: Producer, keyer: ChunkKeyer
) -> None:
    prefix = list(range(2 * CHUNK_SIZE))
    first = prefix + list(range(5000, 5100))
    second = prefix + list(range(7000, 7300))
    before = consumer.process.stats()
    a = producer.push(consumer.spec("r-first"), make_chunks(keyer.chunk_keys(first), seed=1))
    wait_landed(consumer, first)
    b = producer.push(consumer.spec("r-second"), make_chunks(keyer.chunk_keys(second), seed=1))
    assert (a.chunks_sent, a.chunks_skipped) == (3, 0)
    assert (b.chunks_sent, b.chunks_skipped) == (2, 2)
    assert b.bytes_sent == 300 * BYTES_PER_TOKEN  # only the 300 tokens after the prefix
    wait_landed(consumer, second)
    after = consumer.process.stats()
    assert after["chunks_already_held"] - before["chunks_already_held"] == 2
    assert after["bytes_landed"] - before["bytes_landed"] == a.bytes_sent + b.bytes_sent
    for req_id in ("r-first", "r-second"):
        consumer.process.call("release", req_id=req_id)


def test_the_consumer_is_asked_for_pages_while_the_chunks_are_filled(
    consumer: Consumer, producer: Producer, keyer: ChunkKeyer
) -> None:
    """``fill`` runs after the AllocRequest went out: the consumer has it while the chunks are
    still being copied (the round trip overlaps the copy). A fill that fails writes nothing:
    its pages go back at once, not at their lease, the peer is kept, and the next push on the
    same socket lands (the answer to the withdrawn request is not read as the next one's)."""
    tokens = list(range(11_000, 11_000 + 2 * CHUNK_SIZE))
    chunks = make_chunks(keyer.chunk_keys(tokens), seed=11)
    before = consumer.process.stats()

    def fill() -> list[int]:
        # Fails the test unless the consumer has the request before the chunks are "copied".
        consumer.process.wait_until(
            lambda s: s["alloc_requests"] > before["alloc_requests"], 2, "the AllocRequest"
        )
        return local_checksums(chunks)

    result = producer.push(consumer.spec("r-fill-overlap"), chunks, fill=fill)
    assert result.chunks_sent == 2
    wait_landed(consumer, tokens)
    landed = consumer.process.call("checksums", keys=[key.hex() for key, _ in chunks])
    assert landed == local_checksums(chunks)
    consumer.process.call("release", req_id="r-fill-overlap")

    def broken() -> list[int]:
        raise TransferError("copying the chunks into staging failed: a test")

    failed = list(range(12_000, 12_000 + 3 * CHUNK_SIZE))
    started = time.monotonic()
    with pytest.raises(TransferError, match="a test"):
        producer.push(
            consumer.spec("r-fill-fails"), make_chunks(keyer.chunk_keys(failed), 12), fill=broken
        )
    after = consumer.process.wait_until(
        lambda s: s["used_pages"] == 0, 1.0, "the withdrawn pages back before their lease"
    )
    assert time.monotonic() - started < consumer.fields["alloc_lease_s"]
    assert after["allocations_cancelled"] == before["allocations_cancelled"] + 1
    assert consumer.process.call("lookup", tokens=failed) == 0
    # Our copy failed, not the peer: no handshake again. The control: the same producer's next
    # push, on the same socket, lands, its own answer read.
    assert producer.connected(consumer.spec("r-after-withdraw"))
    again = list(range(13_000, 13_000 + CHUNK_SIZE + 3))
    chunks = make_chunks(keyer.chunk_keys(again), seed=13)
    assert producer.push(consumer.spec("r-after-withdraw"), chunks).chunks_sent == 2
    wait_landed(consumer, again)
    consumer.process.call("release", req_id="r-after-withdraw")


def test_a_small_push_writes_into_pages_reserved_ahead_without_asking(
    consumer: Consumer, keyer: ChunkKeyer
) -> None:
    """A push asks for later pushes' pages while its write is in flight; a push of at most
    ``reserved_pages`` chunks, soon after, writes into them at once (no AllocRequest) and lands
    bit-exact. Controls: a larger push, and one after the reservation went stale, ask first."""
    pushes = {
        "r-res-first": list(range(9000, 9100)),
        "r-res-reserved": list(range(9100, 9300)),
        "r-res-two-chunks": list(range(9300, 9300 + CHUNK_SIZE + 5)),
        "r-res-stale": list(range(9600, 9700)),
    }
    reserved: dict[str, bool] = {}
    with Producer(producer_config(num_pages=NUM_PAGES + 8, reserved_pages=1)) as producer:
        for req_id, tokens in pushes.items():
            if req_id == "r-res-stale":
                time.sleep(protocol.RESERVED_FRESH_S + 0.1)
            chunks = make_chunks(keyer.chunk_keys(tokens), seed=len(tokens))
            before = consumer.process.stats()
            result = producer.push(consumer.spec(req_id), chunks)
            reserved[req_id] = result.reserved
            wait_landed(consumer, tokens)
            asks = req_id in ("r-res-first", "r-res-stale")
            # The ReserveRequest goes out after the write: its answer may come after the landing.
            least = before["pages_reserved"] + int(asks)
            after = consumer.process.wait_until(
                lambda s, least=least: s["pages_reserved"] >= least, 5, "pages reserved"
            )
            landed = consumer.process.call("checksums", keys=[key.hex() for key, _ in chunks])
            assert landed == local_checksums(chunks), req_id
            # A reserved write needs no AllocRequest. A write asks for a few pushes' worth of
            # pages while it is in flight, unless we hold some still fresh: the first and the
            # one after they went stale (then the stale ones, not lapsed yet, count against the
            # consumer's share of reserved pages, so it may get fewer).
            assert after["alloc_requests"] - before["alloc_requests"] == int(not result.reserved)
            reserved_now = after["pages_reserved"] - before["pages_reserved"]
            if req_id == "r-res-first":
                assert reserved_now == RESERVE_BATCH
            elif not asks:
                assert reserved_now == 0, req_id
            landed_reserved = after["chunks_landed_reserved"] - before["chunks_landed_reserved"]
            assert landed_reserved == (len(chunks) if result.reserved else 0)
            consumer.process.call("release", req_id=req_id)
        # A push that finds the buffer full gives the pages reserved for it back and asks again.
        held = consumer.process.stats()["reserved_pages"]
        tokens = list(range(20_000, 20_000 + NUM_PAGES * CHUNK_SIZE))
        assert held > 0 and len(keyer.chunk_keys(tokens)) == NUM_PAGES
        full = producer.push(consumer.spec("r-res-fills"), make_chunks(keyer.chunk_keys(tokens), 5))
        assert full.chunks_sent == NUM_PAGES and not full.reserved
        wait_landed(consumer, tokens)
        assert consumer.process.stats()["reserved_pages"] == 0
        consumer.process.call("release", req_id="r-res-fills")
    assert reserved == {
        "r-res-first": False,  # nothing reserved yet
        "r-res-reserved": True,
        "r-res-two-chunks": False,
        "r-res-stale": False,
    }


def ask_raw(port: int, frames: list[bytes]) -> protocol.Message:
    """Send raw frames from a bare DEALER and decode the reply (which must come in time)."""
    with zmq.Context.instance().socket(zmq.DEALER) as socket:
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://127.0.0.1:{port}")
        socket.send_multipart(frames)
        assert socket.poll(REPLY_TIMEOUT_MS), "no reply to a malformed message"
        codec = protocol.INIT_REPLIES if port_kind(port) == "init" else protocol.ALLOC_REPLIES
        # One frame: a request of more (an empty first frame included) is refused unread.
        return codec.decode(socket.recv())


_PORT_KINDS: dict[int, str] = {}


def port_kind(port: int) -> str:
    return _PORT_KINDS[port]


@pytest.fixture
def raw_ports(consumer: Consumer) -> dict[str, int]:
    ports = {"init": consumer.fields["init_port"], "alloc": consumer.fields["alloc_port"]}
    _PORT_KINDS.update({port: kind for kind, port in ports.items()})
    return ports


def test_malformed_bytes_on_both_ports_get_error_replies_and_serving_goes_on(
    consumer: Consumer, producer: Producer, keyer: ChunkKeyer, raw_ports: dict[str, int]
) -> None:
    before = consumer.process.stats()["malformed_messages"]
    sent = []

    @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        kind=st.sampled_from(["init", "alloc"]),
        frames=st.lists(st.binary(max_size=300), min_size=1, max_size=3),
    )
    def garbage_gets_an_error_reply(kind: str, frames: list[bytes]) -> None:
        reply = ask_raw(raw_ports[kind], frames)
        sent.append(frames)
        assert isinstance(reply, protocol.ErrorReply)
        assert reply.code is protocol.ErrorCode.MALFORMED

    garbage_gets_an_error_reply()
    assert len(sent) >= 100
    assert consumer.process.stats()["malformed_messages"] - before == len(sent)
    assert consumer.logged("refused a malformed message")
    tokens = list(range(300))
    producer.push(consumer.spec("r-after-garbage"), make_chunks(keyer.chunk_keys(tokens), 3))
    wait_landed(consumer, tokens)
    consumer.process.call("release", req_id="r-after-garbage")


def test_wrong_protocol_version_is_refused_on_both_ports(
    consumer: Consumer, raw_ports: dict[str, int]
) -> None:
    newer = protocol.PROTOCOL_VERSION + 1
    for kind, message in [
        ("init", {"type": "MetadataRequest", "version": newer}),
        ("alloc", {"type": "AllocRequest", "version": newer, "req_id": "r-v2", "chunks": []}),
    ]:
        reply = ask_raw(raw_ports[kind], [msgspec.msgpack.encode(message)])
        assert isinstance(reply, protocol.ErrorReply)
        assert reply.code is protocol.ErrorCode.VERSION
    assert consumer.process.stats()["version_mismatches"] >= 2
    assert consumer.logged(f"protocol version {newer}")


def test_request_larger_than_the_buffer_is_refused_at_once(
    consumer: Consumer, keyer: ChunkKeyer
) -> None:
    tokens = list(range((NUM_PAGES + 1) * CHUNK_SIZE))
    with Producer(producer_config(num_pages=NUM_PAGES + 8)) as producer:
        started = time.monotonic()
        with pytest.raises(AllocationError, match="r-huge") as refused:
            producer.push(consumer.spec("r-huge"), make_chunks(keyer.chunk_keys(tokens), 4))
    assert not isinstance(refused.value, BufferFull)
    assert time.monotonic() - started < 1.0
    assert consumer.process.stats()["refused_too_large"] >= 1
    assert consumer.logged("req r-huge")


def test_full_buffer_is_reported_before_the_deadline(
    consumer: Consumer, producer: Producer, keyer: ChunkKeyer
) -> None:
    # An earlier test's producer may have closed with a ReserveRequest on its way: the consumer
    # holds those pages for it until their lease (seen once under a loaded suite: "30 pages
    # asked, 28 of 32 free"). Filling the buffer needs them back.
    consumer.process.wait_until(
        lambda s: s["reserved_pages"] == 0, protocol.RESERVED_LEASE_S + 5, "reserved pages back"
    )
    filler = list(range((NUM_PAGES - 2) * CHUNK_SIZE))
    producer.push(consumer.spec("r-filler"), make_chunks(keyer.chunk_keys(filler), 5))
    started = time.monotonic()
    with pytest.raises(BufferFull, match="r-no-room"):
        producer.push(
            consumer.spec("r-no-room"),
            make_chunks(keyer.chunk_keys(list(range(9000, 9000 + 3 * CHUNK_SIZE))), 6),
        )
    elapsed = time.monotonic() - started
    assert elapsed < producer.config.alloc_timeout_s
    assert consumer.process.stats()["refused_buffer_full"] >= 1
    assert consumer.logged("req r-no-room: buffer full")
    consumer.process.call("release", req_id="r-filler")


def test_pages_allocated_but_never_written_come_back_after_the_lease(
    consumer: Consumer, raw_ports: dict[str, int], keyer: ChunkKeyer
) -> None:
    before = consumer.process.stats()["leases_expired"]
    chunks = [protocol.ChunkSpec(k.key, 1000) for k in keyer.chunk_keys(list(range(40000, 41000)))]
    request = protocol.AllocRequest(
        version=protocol.PROTOCOL_VERSION, req_id="r-never-writes", chunks=chunks
    )
    reply = ask_raw(raw_ports["alloc"], [protocol.encode(request)])
    assert isinstance(reply, protocol.AllocResponse)
    assert consumer.process.stats()["used_pages"] == 4
    consumer.process.wait_until(lambda s: s["used_pages"] == 0, 6, "the lease to expire")
    assert consumer.process.stats()["leases_expired"] == before + 1
    assert consumer.logged("req r-never-writes: write not confirmed")


def test_consumer_killed_mid_transfer_fails_the_push_within_its_deadline(
    tmp_path: Path, keyer: ChunkKeyer, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = Consumer(tmp_path)
    allocate = PeerState.allocate

    def allocate_then_kill(state: PeerState, *args, **kwargs) -> protocol.AllocResponse:
        """The consumer dies between the allocation and the write."""
        response = allocate(state, *args, **kwargs)
        node.process.kill()
        return response

    monkeypatch.setattr(PeerState, "allocate", allocate_then_kill)
    with Producer(producer_config(transfer_timeout_s=2.0)) as producer:
        tokens = list(range(4 * CHUNK_SIZE))
        # The handshake first: its deadline is its own, and the push's starts after it (a
        # loaded host once took 2.4 s more over both, past the bound below).
        producer.connect(node.spec("r-orphaned"))
        started = time.monotonic()
        with pytest.raises((TransferError, PeerTimeout), match="r-orphaned"):
            producer.push(node.spec("r-orphaned"), make_chunks(keyer.chunk_keys(tokens), 7))
        # The deadline (2 s) and room for UCX to see the peer gone inside NIXL's post, which no
        # deadline of ours interrupts: 4.4 s in a full run beside vLLM tests (2026-12-05).
        assert time.monotonic() - started < 2.0 + 4.0
        # The dead peer is forgotten: a new push handshakes again and fails fast, not hangs.
        started = time.monotonic()
        with pytest.raises(PeerTimeout):
            producer.push(node.spec("r-after-death"), make_chunks(keyer.chunk_keys(tokens), 8))
        assert time.monotonic() - started < producer.config.handshake_timeout_s + 1.0


def test_second_consumer_on_taken_ports_fails_fast_and_says_so(
    consumer: Consumer, tmp_path: Path
) -> None:
    fields = {**consumer.fields}
    started = time.monotonic()
    with pytest.raises(PeerTimeout, match="exited with status"):
        ConsumerProcess(write_config(tmp_path, "clash", **fields), log_path=tmp_path / "clash.log")
    assert time.monotonic() - started < 30
    assert "cannot bind" in (tmp_path / "clash.log").read_text()


def test_a_consumer_on_taken_ports_fails_before_it_makes_a_nixl_agent(
    consumer: Consumer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ports come first: an agent waits its turn for the host's UCX lock, which a busy host
    can hold for seconds (the test above once went silent for 60 s beside four vLLM starts)."""
    from lmcache_pd.config import load_config
    from lmcache_pd.transfer import consumer as consumer_module

    def no_agent(*args: object, **kwargs: object) -> None:
        raise AssertionError("a NIXL agent made for ports it cannot have")

    monkeypatch.setattr(consumer_module.NixlChannel, "from_config", no_agent)
    config = load_config(write_config(tmp_path, "clash", **consumer.fields))
    with pytest.raises(ConfigError, match="cannot bind"):
        consumer_module.Consumer(config, make_keyer(chunk_size=config.chunk_size))


def test_ucx_backends_are_created_one_at_a_time_on_a_host(tmp_path: Path) -> None:
    """ai-dynamo/nixl#1668: two agents creating their UCX backend at the same moment can hang.
    Every channel takes a host-wide lock for that step: a second taker waits for the first."""
    from lmcache_pd.transfer.channel import _one_backend_at_a_time

    path = str(tmp_path / "backend.lock")
    held = threading.Event()
    waited: list[float] = []

    def second() -> None:
        held.wait()
        started = time.monotonic()
        with _one_backend_at_a_time(path):
            waited.append(time.monotonic() - started)

    with _one_backend_at_a_time(path):
        taker = threading.Thread(target=second)
        taker.start()
        held.set()
        time.sleep(0.3)
    taker.join(5)
    assert waited and waited[0] >= 0.25
    started = time.monotonic()
    with _one_backend_at_a_time(path):  # control: nobody holds it
        assert time.monotonic() - started < 0.1


def test_a_write_of_no_segment_is_refused_before_nixl_or_the_fake_sees_it() -> None:
    """A WRITE of nothing is a caller's bug: a clear ValueError, not an IndexError from inside
    NIXL's descriptor code (which it raised before the check) or a fake write that lands."""
    from lmcache_pd.transfer.channel import NixlChannel
    from lmcache_pd.transfer.fake_channel import FakeChannel, FakeFabric

    fake = FakeChannel(FakeFabric(), "producer")
    with NixlChannel(
        role="producer", backends=["UCX"], ucx_error_handling_mode="none", progress_thread=False
    ) as nixl:
        for channel in (nixl, fake):
            buffer = channel.register(torch.zeros(4096, dtype=torch.uint8))
            with pytest.raises(ValueError, match="at least one segment"):
                channel.post_write("nobody", [], buffer, b"")
