"""Bounded state per peer and per request: whatever peers send, a consumer's tables stay within
their caps and it keeps serving, one producer cannot hold the buffer while another waits, and a
producer lets idle consumers go instead of refusing a new one.

The fast tests drive the chunk store and the handshake in this process; those marked
``processes`` put the consumer in a child process and talk to its real ports, each with a
negative control (the same steps without the fault, or below the cap).
"""

from __future__ import annotations

import socket as stdlib_socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_pd import protocol
from lmcache_pd.auth import Door
from lmcache_pd.compat import KVProfile
from lmcache_pd.errors import BufferFull, PeerTimeout, RequestDropped
from lmcache_pd.harness.consumer_process import ConsumerProcess
from lmcache_pd.kernels.integrity import checksum
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.peers import PeerAddress
from lmcache_pd.protocol import (
    PROTOCOL_VERSION,
    AbandonReason,
    AgentMetadata,
    AllocCancel,
    AllocRequest,
    ChunkSpec,
    DisaggSpec,
    WriteDone,
    encode,
)
from lmcache_pd.trace import TraceFile
from lmcache_pd.transfer import chunk_store as chunk_store_module
from lmcache_pd.transfer.allocator import PageAllocator, PageState
from lmcache_pd.transfer.chunk_store import ChunkStore
from lmcache_pd.transfer.consumer_stats import LimitCounts
from lmcache_pd.transfer.dropped_requests import DroppedRequests
from lmcache_pd.transfer.fake_channel import FakeChannel, FakeFabric
from lmcache_pd.transfer.holds import STALE_DEADLINES
from lmcache_pd.transfer.producer import Producer
from lmcache_pd.transfer.sender import MAX_PEERS, SenderPool
from lmcache_pd.transfer.sender_jobs import Saving
from lmcache_pd.transfer.sockets import bind_router
from lmcache_pd.transfer.staging import Staging
from tests.helpers import (
    CHUNK_SIZE,
    PAGE_BYTES,
    consumer_fields,
    free_port,
    make_chunks,
    producer_config,
    spec_for,
    submit_push,
    wait_for,
    write_config,
)

REPLY_TIMEOUT_MS = 5000
A, B = b"producer-a", b"producer-b"


# ---- the chunk store's caps, in this process ----


def make_store(num_pages: int = 8, **limits: object) -> ChunkStore:
    allocator = PageAllocator(num_pages=num_pages, page_bytes=64, lease_s=3.0)
    return ChunkStore(allocator, claim_s=2.0, hold_s=5.0, **limits)


def alloc_request(req_id: str, *keys: bytes) -> AllocRequest:
    return AllocRequest(
        version=PROTOCOL_VERSION, req_id=req_id, chunks=[ChunkSpec(key, 64) for key in keys]
    )


def write_done(req_id: str, alloc_id: int) -> WriteDone:
    return WriteDone(version=PROTOCOL_VERSION, req_id=req_id, alloc_id=alloc_id, checksums=None)


def keys(prefix: str, count: int) -> list[bytes]:
    return [f"{prefix}-{index}".encode() for index in range(count)]


def test_requests_let_go_past_the_cap_are_forgotten_oldest_first_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counts = LimitCounts()
    dropped = DroppedRequests(600.0, counts, max_entries=4)
    for index in range(4):  # the control: up to the cap, nothing is forgotten
        dropped.remember(f"r{index}", "client_gone", now=0.0)
    assert len(dropped) == 4 and counts.dropped_forgotten_early == 0
    with caplog.at_level("WARNING", "lmcache_pd.transfer.dropped_requests"):
        for index in range(4, 10):
            dropped.remember(f"r{index}", "client_gone", now=0.0)
    assert sorted(dropped) == ["r6", "r7", "r8", "r9"]
    assert counts.dropped_forgotten_early == 6
    assert caplog.text.count("forgotten early") == 1
    assert "req r4" in caplog.text
    dropped.forget_lapsed(now=600.0)  # their memory ends as before
    assert len(dropped) == 0


def test_an_allocation_for_one_request_too_many_is_refused_until_a_hold_ends() -> None:
    store = make_store(num_pages=8, max_held_requests=3)
    for index in range(3):
        store.allocate(alloc_request(f"r{index}", b"k%d" % index), now=0.0)
    with pytest.raises(BufferFull, match="at most 3"):
        store.allocate(alloc_request("r3", b"k3"), now=0.0)
    assert store.limit_counts.refused_holds_full == 1
    assert store.held_requests == 3
    # A request that holds pages already may ask for more: the control.
    store.allocate(alloc_request("r0", b"k9"), now=0.0)
    store.release("r1", now=0.0)
    store.allocate(alloc_request("r3", b"k3"), now=0.0)
    assert store.held_requests == 3 and store.limit_counts.refused_holds_full == 1


def test_renewing_one_hold_again_and_again_does_not_grow_its_deadlines() -> None:
    store = make_store()
    for step in range(20_000):
        store.allocate(alloc_request("r-renewed", b"k"), now=step * 1e-4)
        store.cancel_writes_of("r-renewed")
    assert len(store._holds.deadlines) <= 1 + STALE_DEADLINES
    assert store.used_pages == 0


def test_pages_allocated_and_cancelled_again_and_again_do_not_grow_the_leases() -> None:
    allocator = PageAllocator(num_pages=4, page_bytes=64, lease_s=60.0)
    for step in range(10_000):
        for page in allocator.allocate(2, now=step * 1e-3):
            allocator.free(page)
    assert len(allocator._leases) <= 2 * allocator.num_pages
    pages = allocator.allocate(4, now=20.0)  # the live leases are still kept, and lapse
    assert sorted(allocator.expire(now=81.0)) == sorted(pages)


def test_the_board_lists_only_requests_with_landed_chunks_up_to_its_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(chunk_store_module, "MAX_BOARD_ENTRIES", 3)
    store = make_store(num_pages=16)
    for index in range(6):
        allocation = store.allocate(alloc_request(f"r{index}", b"k%d" % index), now=0.0)
        if index != 1:  # r1's write never lands: it is not on the board
            store.confirm(write_done(f"r{index}", allocation.alloc_id))
    assert store.unclaimed_landed() == {"r0": 1, "r2": 1, "r3": 1}  # held longest first


def test_allocation_and_reservation_ids_are_63_random_bits() -> None:
    store = make_store(num_pages=64)
    ids = [store.allocate(alloc_request(f"r{i}", b"k%d" % i), now=0.0).alloc_id for i in range(8)]
    ids += [store.reserve(1, now=0.0)[0] for _ in range(8)]
    assert all(0 <= alloc_id < 1 << 63 for alloc_id in ids)
    assert len(set(ids)) == len(ids)
    assert sorted(ids) != list(range(min(ids), min(ids) + len(ids)))  # not a counter
    assert max(ids) > 1 << 40  # 16 draws below 2**40 would be a 1-in-2**368 event


def test_a_producer_over_its_share_is_refused_while_another_waits_then_the_other_gets_room() -> (
    None
):
    store = make_store(num_pages=8, max_producer_share=0.5)
    first = store.allocate(alloc_request("a1", *keys("a1", 5)), now=0.0, producer=A)
    store.allocate(alloc_request("a2", b"a2"), now=0.0, producer=A)  # alone, A may take more
    with pytest.raises(BufferFull) as no_room:
        store.allocate(alloc_request("b1", *keys("b1", 3)), now=0.0, producer=B)
    assert "max_producer_share" not in str(no_room.value)
    with pytest.raises(BufferFull, match="max_producer_share"):
        store.allocate(alloc_request("a3", b"a3"), now=0.1, producer=A)
    assert store.limit_counts.refused_producer_share == 1
    store.allocate(alloc_request("b1", *keys("b1", 2)), now=0.2, producer=B)  # B gets the rest
    with pytest.raises(BufferFull):  # and waits again for more
        store.allocate(alloc_request("b2", b"b2"), now=0.25, producer=B)
    store.cancel_writes_of("b1")
    store.release("b1", now=0.3)
    with pytest.raises(BufferFull, match="max_producer_share"):  # room, but A holds 6
        store.allocate(alloc_request("a3", b"a3"), now=0.3, producer=A)
    # A claimed request's pages are its decode's: they no longer count towards A.
    store.confirm(write_done("a1", first.alloc_id))
    store.claim("a1", now=0.35)
    store.allocate(alloc_request("a3", b"a3"), now=0.4, producer=A)
    assert store.limit_counts.refused_producer_share == 2
    store.release("a1", now=0.5)
    # Past SHARE_ENFORCED_S, A alone may hold more than its share again.
    later = protocol.SHARE_ENFORCED_S + 1
    store.allocate(alloc_request("a4", *keys("a4", 4)), now=later, producer=A)
    assert store._shares.pages_of(A) == 6
    for req_id in ["a2", "a3", "a4"]:
        store.cancel_writes_of(req_id)
        store.release(req_id, now=later)
    assert store.used_pages == 0
    assert store._shares.pages_of(A) == store._shares.pages_of(B) == 0


def test_a_producer_given_room_after_a_refusal_no_longer_holds_the_others_to_their_share() -> None:
    store = make_store(num_pages=8, max_producer_share=0.5)
    store.allocate(alloc_request("a1", *keys("a1", 5)), now=0.0, producer=A)
    with pytest.raises(BufferFull):
        store.allocate(alloc_request("b1", *keys("b1", 4)), now=0.0, producer=B)
    store.allocate(alloc_request("b1", b"b1"), now=0.1, producer=B)  # B asked less, and got it
    store.allocate(alloc_request("a2", *keys("a2", 2)), now=0.2, producer=A)  # nobody waits
    assert store._shares.pages_of(A) == 7 and store.limit_counts.refused_producer_share == 0


def counted_from_scratch(store: ChunkStore) -> Counter[bytes]:
    """Pages per producer by the definition: its pending writes, and pages held by requests it
    allocated for that no decode claimed."""
    counts: Counter[bytes] = Counter()
    for page, info in store._pages.items():
        owners = {info.writer} if store._allocator.state(page) is PageState.LEASED else set()
        owners |= {
            store._holds[holder].producer
            for holder in info.holders
            if holder not in store._holds.claimed
        }
        counts.update(owners)
    return counts


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(
            ["allocate", "confirm", "claim", "release", "cancel", "reserve", "land", "expire"]
        ),
        st.sampled_from([A, B]),
        st.integers(0, 3),  # which request
        st.lists(st.integers(0, 5), min_size=1, max_size=3, unique=True),  # which chunk keys
    ),
    max_size=40,
)


def land_in_reserved_pages(
    store: ChunkStore, producer: bytes, req_id: str, chunk_keys: list[int], now: float
) -> None:
    """Chunks of ``req_id`` written into pages reserved for ``producer``, if it has any."""
    for reservation_id, pages in list(store._reserved.items()):
        if store._reserved.producer_of[reservation_id] == producer:
            chosen = sorted(pages)[: len(chunk_keys)]
            chunks = [ChunkSpec(b"k%d" % k, 64) for k in chunk_keys[: len(chosen)]]
            done = protocol.ReservedWriteDone(
                version=PROTOCOL_VERSION,
                req_id=req_id,
                reservation_id=reservation_id,
                chunks=chunks,
                pages=chosen,
                checksums=None,
            )
            store.land_reserved(done, now)
            return


@settings(max_examples=200, deadline=None)
@given(operations=OPERATIONS, cache_pages=st.sampled_from([0, 3]))
def test_pages_counted_per_producer_always_match_their_definition(
    operations: list[tuple[str, bytes, int, list[int]]], cache_pages: int
) -> None:
    store = make_store(num_pages=8, cache_pages=cache_pages, max_producer_share=1.0)
    now = 0.0
    for name, producer, request, chunk_keys in operations:
        req_id = f"{producer.decode()}-{request}"
        try:
            if name == "allocate":
                store.allocate(
                    alloc_request(req_id, *(b"k%d" % k for k in chunk_keys)), now, producer
                )
            elif name == "confirm":
                for alloc_id, pending in list(store._pending.items()):
                    if pending.req_id == req_id:
                        store.confirm(write_done(req_id, alloc_id))
            elif name == "claim":
                store.claim(req_id, now)
            elif name == "release":
                store.release(req_id, now)
            elif name == "cancel":
                store.cancel_writes_of(req_id)
            elif name == "reserve":
                store.reserve(len(chunk_keys), now, producer)
            elif name == "land":
                land_in_reserved_pages(store, producer, req_id, chunk_keys, now)
            else:
                now += 2.5
                store.expire(now)
        except (BufferFull, RequestDropped):
            pass
        expected = counted_from_scratch(store)
        for who in (A, B):
            assert store._shares.pages_of(who) == expected[who], (name, who)
            assert store._reserved.pages_of(who) == sum(
                len(pages)
                for reservation_id, pages in store._reserved.items()
                if store._reserved.producer_of[reservation_id] == who
            )


# ---- the handshake's one deadline, with the fake transport ----


def test_a_handshake_ends_by_one_deadline_however_slowly_each_step_is_answered(
    keyer: ChunkKeyer,
) -> None:
    """Each step answered just inside a deadline of its own would take several of them: the
    init port here answers the metadata request late, then falls silent. The handshake still
    ends by its one deadline; the control answers at once and ends by the same one."""
    fabric = FakeFabric()
    consumer_side = FakeChannel(fabric, "consumer")
    handshake_s = 2.0
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")
    delays: list[float] = []

    def answer_metadata_after(delay_s: float) -> None:
        if router.poll(REPLY_TIMEOUT_MS):
            identity, _ = router.recv_multipart()
            time.sleep(delay_s)
            reply = AgentMetadata(
                version=PROTOCOL_VERSION,
                agent_name=consumer_side.agent_name,
                metadata=consumer_side.local_metadata(),
                profile=KVProfile(chunk_size=CHUNK_SIZE, page_bytes=PAGE_BYTES),
                stack="another-host",
            )
            router.send_multipart([identity, encode(reply)])

    config = producer_config(num_pages=8, handshake_timeout_s=handshake_s)
    try:
        for delay_s in (0.7 * handshake_s, 0.0):
            answering = threading.Thread(target=answer_metadata_after, args=(delay_s,))
            answering.start()
            with Producer(config, channel=FakeChannel(fabric, "producer")) as producer:
                started = time.monotonic()
                with pytest.raises(PeerTimeout, match="BufferRequest"):
                    producer.connect(DisaggSpec(f"r-slow-{delay_s}", "127.0.0.1", port, 1))
                delays.append(time.monotonic() - started)
            answering.join(REPLY_TIMEOUT_MS / 1000)
            router.recv_multipart()  # the BufferRequest nobody answers
    finally:
        router.close(linger=0)
        context.term()
    # A deadline per step would end the slow one at 0.7 + 1 handshake deadlines.
    assert handshake_s - 0.1 < delays[0] < 1.35 * handshake_s
    assert handshake_s - 0.1 < delays[1] < 1.35 * handshake_s


def test_consumer_ports_queue_a_bounded_number_of_messages_per_peer() -> None:
    context = zmq.Context()
    try:
        router = bind_router(context, "127.0.0.1", free_port(), None, Door.ALLOC)
        assert router.getsockopt(zmq.RCVHWM) == protocol.MAX_QUEUED_MESSAGES
        assert router.getsockopt(zmq.MAXMSGSIZE) == protocol.MAX_FRAME_BYTES
        router.close(linger=0)
    finally:
        context.term()


# ---- a real consumer process, spoken to on its ports ----


class Node:
    """A consumer child process with its config, ports and log file."""

    def __init__(self, tmp: Path, num_pages: int, **overrides: object) -> None:
        self.fields = consumer_fields(num_pages=num_pages, **overrides)
        self.log = tmp / "consumer.log"
        self.process = ConsumerProcess(
            write_config(tmp, "consumer", **self.fields), log_path=self.log
        )

    def spec(self, req_id: str) -> DisaggSpec:
        return spec_for(self.fields, req_id)

    def stats(self) -> dict[str, int]:
        return self.process.stats()

    def dealer(self, context: zmq.Context) -> zmq.Socket:
        """A raw DEALER on the alloc port: a producer (or a peer posing as one) of its own."""
        socket = context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://127.0.0.1:{self.fields['alloc_port']}")
        return socket


def ask(socket: zmq.Socket, message: protocol.Message) -> protocol.Message:
    socket.send(encode(message))
    assert socket.poll(REPLY_TIMEOUT_MS), f"no reply to {type(message).__name__}"
    return protocol.ALLOC_REPLIES.decode(socket.recv())


def allocate(socket: zmq.Socket, req_id: str, count: int) -> protocol.Message:
    chunks = [ChunkSpec(f"{req_id}-{index}".encode(), 1000) for index in range(count)]
    return ask(socket, AllocRequest(version=PROTOCOL_VERSION, req_id=req_id, chunks=chunks))


def cancel(socket: zmq.Socket, req_id: str, reply: protocol.Message) -> None:
    assert isinstance(reply, protocol.AllocResponse), reply
    message = AllocCancel(version=PROTOCOL_VERSION, req_id=req_id, alloc_id=reply.alloc_id)
    assert ask(socket, message) == protocol.CancelAck(
        version=PROTOCOL_VERSION, req_id=req_id, alloc_id=reply.alloc_id, known=True
    )


def push_and_load(node: Node, producer: Producer, keyer: ChunkKeyer, req_id: str) -> None:
    """A real push lands bit for bit, and is loaded (read and checked), then released."""
    tokens = list(range(50_000, 50_000 + 3 * CHUNK_SIZE))
    chunks = make_chunks(keyer.chunk_keys(tokens), seed=len(req_id))
    producer.push(node.spec(req_id), chunks)
    wait_for(
        lambda: node.process.call("lookup", tokens=tokens) == len(tokens), 10, "the push landing"
    )
    landed = node.process.call("checksums", keys=[key.hex() for key, _ in chunks])
    assert landed == [checksum(t.view(-1).view(torch.uint8)) for _, t in chunks]
    node.process.call("release", req_id=req_id)


@pytest.mark.processes
def test_100k_abandon_notices_with_fresh_ids_stay_within_the_cap_and_a_load_still_works(
    tmp_path: Path, keyer: ChunkKeyer
) -> None:
    node = Node(tmp_path, num_pages=16)
    total, batch = 100_000, 500
    cap = protocol.MAX_DROPPED_REQUESTS
    context = zmq.Context()
    with node.process, Producer(producer_config(num_pages=16, reserved_pages=0)) as producer:
        socket = node.dealer(context)
        try:
            started = time.monotonic()
            for first in range(0, total, batch):
                for index in range(first, first + batch):
                    notice = protocol.KVAbandoned.of(f"flood-{index}", AbandonReason.CLIENT_GONE)
                    socket.send(encode(notice))
                for _ in range(batch):
                    assert socket.poll(REPLY_TIMEOUT_MS), "the consumer stopped answering"
                    assert isinstance(
                        protocol.ALLOC_REPLIES.decode(socket.recv()), protocol.AbandonAck
                    )
            flood_s = time.monotonic() - started
            stats = node.stats()
            assert stats["requests_abandoned"] == total
            assert stats["dropped_requests"] == cap
            assert stats["dropped_forgotten_early"] == total - cap
            # The newest are still refused, the oldest were forgotten: a push may hold pages.
            newest = allocate(socket, f"flood-{total - 1}", 1)
            assert isinstance(newest, protocol.ErrorReply)
            assert newest.code is protocol.ErrorCode.DROPPED
            forgotten = allocate(socket, "flood-0", 1)
            cancel(socket, "flood-0", forgotten)
        finally:
            socket.close(linger=0)
            context.term()
        push_and_load(node, producer, keyer, "r-after-flood")
        assert node.stats()["used_pages"] == 0
    assert node.log.read_text().count("forgotten early") == 1
    assert flood_s < 120, f"{total} notices took {flood_s:.0f} s"


@pytest.mark.processes
def test_a_three_frame_message_is_refused_unread_and_counted_and_the_port_serves_on(
    tmp_path: Path,
) -> None:
    node = Node(tmp_path, num_pages=8)
    context = zmq.Context()
    with node.process:
        socket = node.dealer(context)
        try:
            request = encode(
                AllocRequest(
                    version=PROTOCOL_VERSION, req_id="r-frames", chunks=[ChunkSpec(b"k", 1000)]
                )
            )
            socket.send_multipart([request, b"x" * 1000, b"y"])
            assert socket.poll(REPLY_TIMEOUT_MS)
            reply = protocol.ALLOC_REPLIES.decode(socket.recv())
            assert isinstance(reply, protocol.ErrorReply)
            assert reply.code is protocol.ErrorCode.MALFORMED and "got 3" in reply.detail
            stats = node.stats()
            assert stats["refused_extra_frames"] == 1 and stats["malformed_messages"] == 1
            assert stats["alloc_requests"] == 0 and stats["used_pages"] == 0  # never decoded
            # The control: the same request in one frame is answered, on the same connection.
            allowed = allocate(socket, "r-frames", 1)
            assert node.stats()["refused_extra_frames"] == 1
            cancel(socket, "r-frames", allowed)
        finally:
            socket.close(linger=0)
            context.term()
    assert "refused a message of 3 body frames unread" in node.log.read_text()


@pytest.mark.processes
@pytest.mark.parametrize("share", [0.5, 1.0], ids=["share", "no_share"])
def test_a_producer_over_its_share_is_refused_while_another_waits_and_the_other_gets_pages(
    tmp_path: Path, share: float
) -> None:
    """32 pages: A holds 20, B asks 14 and is refused (room), A asks 4 more. With a share of
    half the buffer A is refused and B then gets the 12 left; with the whole buffer as its
    share (the control) A takes 4 and B is refused again."""
    node = Node(tmp_path, num_pages=32, max_producer_share=share, alloc_lease_s=30.0)
    context = zmq.Context()
    with node.process:
        a, b = node.dealer(context), node.dealer(context)
        try:
            held = allocate(a, "a-1", 20)
            assert isinstance(held, protocol.AllocResponse)
            no_room = allocate(b, "b-1", 14)
            assert isinstance(no_room, protocol.ErrorReply)
            assert no_room.code is protocol.ErrorCode.BUFFER_FULL and no_room.retry_after_s > 0
            more = allocate(a, "a-2", 4)
            if share < 1:
                assert isinstance(more, protocol.ErrorReply)
                assert more.code is protocol.ErrorCode.BUFFER_FULL
                assert "max_producer_share" in more.detail and more.retry_after_s > 0
                assert node.stats()["refused_producer_share"] == 1
                rest = allocate(b, "b-2", 12)
                assert isinstance(rest, protocol.AllocResponse)
                cancel(b, "b-2", rest)
            else:
                assert isinstance(more, protocol.AllocResponse)
                assert isinstance(allocate(b, "b-2", 12), protocol.ErrorReply)
                assert node.stats()["refused_producer_share"] == 0
                cancel(a, "a-2", more)
            cancel(a, "a-1", held)
            assert node.stats()["used_pages"] == 0
        finally:
            a.close(linger=0)
            b.close(linger=0)
            context.term()
    if share < 1:
        assert "req a-2: buffer full: " in node.log.read_text()


# ---- a producer's table of consumers ----


@pytest.fixture
def unanswering_port() -> Iterator[int]:
    """A port where something listens that speaks no ZMQ: connections are never accepted."""
    with stdlib_socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        yield listener.getsockname()[1]


class Pushes:
    """A producer rank's sender pool in this process, as the vLLM connector drives it."""

    def __init__(self, **settings: object) -> None:
        config = producer_config(num_pages=MAX_PEERS + 8, reserved_pages=0, **settings)
        self.staging = Staging(num_pages=config.num_pages, page_bytes=config.page_bytes)
        self.counts: dict[str, int] = {}
        self.pool = SenderPool(
            lambda: Producer(config, staging=self.staging),
            self.count,
            TraceFile(None),
            [],
        )

    def count(self, name: str, n: int) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def submit(self, spec: DisaggSpec, chunks: list[tuple[bytes, torch.Tensor]]) -> Saving:
        request = Saving(spec, [], prompt_tokens=len(chunks) * CHUNK_SIZE)
        submit_push(self.pool, self.staging, request, chunks)
        return request

    def settle(self) -> None:
        wait_for(lambda: self.pool.outstanding == 0, 30, "every push to end")


@pytest.mark.processes
def test_65_bogus_consumers_then_a_real_decode_push_lands(
    tmp_path: Path, keyer: ChunkKeyer, unanswering_port: int
) -> None:
    node = Node(tmp_path, num_pages=16)
    tokens = list(range(2 * CHUNK_SIZE))
    chunks = make_chunks(keyer.chunk_keys(tokens), seed=65)
    # 65 consumers to the producer (no two name the same ports): where nothing listens, or
    # something that speaks no ZMQ.
    bogus = [
        DisaggSpec(
            f"r-bogus-{index}",
            "127.0.0.1",
            free_port() if index % 2 else unanswering_port,
            free_port(),
        )
        for index in range(MAX_PEERS + 1)
    ]
    with node.process:
        # Short enough for 65 bogus handshakes to end soon, long enough for the real one, and
        # for all 64 to be submitted before the first ends, on a loaded machine (3 s was seen
        # too short for the latter once in a full suite).
        pushes = Pushes(handshake_timeout_s=6.0)
        try:
            for spec in bogus[:MAX_PEERS]:
                pushes.submit(spec, chunks[:1])
            # The control: while all 64 are busy with their handshakes, a new one is refused.
            refused = pushes.submit(node.spec("r-while-busy"), chunks)
            assert refused.abandoned.is_set() and "peers_evicted" not in pushes.counts
            pushes.settle()
            pushes.submit(bogus[MAX_PEERS], chunks[:1])  # the 65th: the idlest one goes
            pushes.settle()
            assert pushes.counts["peers_evicted"] == 1
            real = pushes.submit(node.spec("r-real"), chunks)
            pushes.settle()
            assert not real.abandoned.is_set()
            assert pushes.counts["peers_evicted"] == 2
            assert pushes.counts.get("pushes", 0) == 1
            # A push ends once written; the consumer lands it when it reads the notice.
            wait_for(
                lambda: node.process.call("lookup", tokens=tokens) == len(tokens),
                10,
                "the real push landing",
            )
            landed = node.process.call("checksums", keys=[key.hex() for key, _ in chunks])
            assert landed == [checksum(t.view(-1).view(torch.uint8)) for _, t in chunks]
            node.process.call("release", req_id="r-real")
            assert len(pushes.pool._senders) == MAX_PEERS
            assert PeerAddress.of(node.spec("r-real")) in pushes.pool._senders
        finally:
            pushes.pool.close()
        assert not pushes.pool._stopping  # every sender let go was joined
        assert node.stats()["used_pages"] == 0


def test_a_dropped_request_is_refused_by_the_store_until_forgotten() -> None:
    """The cap keeps what a refusal rests on: a request let go is refused while remembered."""
    store = make_store(max_dropped_requests=2)
    for req_id in ["r0", "r1", "r2"]:
        store.release(req_id, now=0.0)
    with pytest.raises(RequestDropped):
        store.allocate(alloc_request("r2", b"k"), now=0.0)
    store.allocate(alloc_request("r0", b"k"), now=0.0)  # forgotten early: it may hold again
    assert store.dropped_requests == 2
    assert store.limit_counts.dropped_forgotten_early == 1
