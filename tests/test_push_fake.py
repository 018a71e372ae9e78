"""Producer and consumer logic over real ZMQ sockets with the in-tree fake transport.

The fake stands in for NIXL only; tests with real NIXL between processes are in
test_transfer_nixl.py. Here the transport misbehaves on demand.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
import zmq

from lmcache_pd.compat import KVProfile
from lmcache_pd.config import load_config
from lmcache_pd.errors import (
    AllocationError,
    BufferFull,
    IntegrityError,
    PeerError,
    PeerTimeout,
    RequestDropped,
    TransferError,
)
from lmcache_pd.kernels.integrity import checksum
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.protocol import (
    CANCEL_TIMEOUT_S,
    PROTOCOL_VERSION,
    AbandonReason,
    AgentMetadata,
    AllocRequest,
    ChunkSpec,
    DisaggSpec,
    encode,
    write_budget_s,
)
from lmcache_pd.transfer.consumer import Consumer
from lmcache_pd.transfer.fake_channel import FakeChannel, FakeFabric
from lmcache_pd.transfer.producer import Producer
from tests.helpers import (
    CHUNK_SIZE,
    PAGE_BYTES,
    consumer_fields,
    free_port,
    make_chunks,
    producer_config,
    spec_for,
    wait_for,
)


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric()


def start_consumer(fabric: FakeFabric, keyer: ChunkKeyer, **overrides: object) -> Consumer:
    config = load_config(None, environ={}, **consumer_fields(num_pages=8, **overrides))
    return Consumer(config, keyer, channel=FakeChannel(fabric, "consumer"))


@pytest.fixture
def consumer(fabric: FakeFabric, keyer: ChunkKeyer) -> Iterator[Consumer]:
    with start_consumer(fabric, keyer) as consumer:
        yield consumer


def make_producer(fabric: FakeFabric, **knobs: object) -> tuple[Producer, FakeChannel]:
    settings = {
        k: knobs.pop(k)
        for k in list(knobs)
        if k.endswith("_s") or k.startswith("max_") or k == "reserved_pages"
    }
    settings.setdefault("transport_self_test", knobs.pop("transport_self_test", not knobs))
    channel = FakeChannel(fabric, "producer", **knobs)
    return Producer(producer_config(num_pages=8, **settings), channel=channel), channel


def test_pushed_chunks_land_and_are_found(consumer: Consumer, fabric, keyer) -> None:
    tokens = list(range(600))
    chunks = make_chunks(keyer.chunk_keys(tokens), seed=1)
    producer, _ = make_producer(fabric)
    with producer:
        result = producer.push(spec_for(consumer.config, "r1"), chunks)
    assert (result.chunks_sent, result.chunks_skipped) == (3, 0)
    wait_for(lambda: consumer.lookup(tokens) == 600, what="chunks to land")
    for key, tensor in chunks:
        assert checksum(consumer.get_chunk(key)) == checksum(tensor.view(-1).view(torch.uint8))
    consumer.release("r1")
    assert consumer.used_pages == 0


def test_transfer_that_never_finishes_times_out_and_its_lease_frees_the_pages(
    fabric, keyer
) -> None:
    with start_consumer(fabric, keyer, alloc_lease_s=0.5, transfer_timeout_s=0.2) as consumer:
        producer, _ = make_producer(fabric, polls_before_done=10**9, transfer_timeout_s=0.2)
        chunks = make_chunks(keyer.chunk_keys(list(range(300))), seed=2)
        started = time.monotonic()
        with producer, pytest.raises(PeerTimeout, match="r-stuck"):
            producer.push(spec_for(consumer.config, "r-stuck"), chunks)
        assert time.monotonic() - started < 1.0
        assert consumer.used_pages == 2
        wait_for(lambda: consumer.used_pages == 0, what="the lease to expire")
        assert consumer.stats_snapshot()["leases_expired"] == 1


@pytest.mark.parametrize("lease_s", [0.6, 1.6])
def test_the_write_deadline_follows_the_consumer_lease_stated_at_handshake(
    fabric, keyer, lease_s: float
) -> None:
    """The producer's own transfer_timeout_s (20 s) is longer than this consumer's lease: its
    write must still end before the lease could hand the pages to another request."""
    with start_consumer(fabric, keyer, alloc_lease_s=lease_s) as consumer:
        producer, _ = make_producer(fabric, polls_before_done=10**9)
        assert producer.config.transfer_timeout_s == 20.0
        chunks = make_chunks(keyer.chunk_keys(list(range(300))), seed=2)
        started = time.monotonic()
        with producer, pytest.raises(PeerTimeout):
            producer.push(spec_for(consumer.config, "r-stuck"), chunks)
        took = time.monotonic() - started
    assert write_budget_s(lease_s) - 0.1 <= took < lease_s


@pytest.mark.parametrize("knob", ["fail_post", "fail_poll"])
def test_failed_transfer_raises_and_the_next_push_handshakes_again(
    consumer: Consumer, fabric, keyer, knob: str
) -> None:
    producer, channel = make_producer(fabric, **{knob: True})
    chunks = make_chunks(keyer.chunk_keys(list(range(10))), seed=3)
    with producer:
        with pytest.raises(TransferError):
            producer.push(spec_for(consumer.config, "r-fail"), chunks)
        setattr(channel, knob, False)
        producer.push(spec_for(consumer.config, "r-ok"), chunks)
    assert consumer.stats_snapshot()["init_requests"] == 4
    wait_for(lambda: consumer.lookup(list(range(10))) == 10)
    consumer.release("r-fail")
    consumer.release("r-ok")
    wait_for(lambda: consumer.used_pages == 0, what="pages to return")


def test_lost_notification_means_not_landed(fabric, keyer) -> None:
    with start_consumer(fabric, keyer, alloc_lease_s=0.3, transfer_timeout_s=0.1) as consumer:
        producer, _ = make_producer(fabric, drop_notifications=True, transfer_timeout_s=0.1)
        tokens = list(range(256))
        with producer:
            producer.push(
                spec_for(consumer.config, "r-lost"), make_chunks(keyer.chunk_keys(tokens), 4)
            )
        time.sleep(0.05)
        assert consumer.lookup(tokens) == 0
        wait_for(lambda: consumer.used_pages == 0, what="the lease to expire")


def test_released_request_keeps_its_page_until_the_write_lands(fabric, keyer) -> None:
    with start_consumer(fabric, keyer) as consumer:
        producer, channel = make_producer(fabric, stalled=True)
        tokens = list(range(100))
        chunks = make_chunks(keyer.chunk_keys(tokens), seed=5)
        pushed = threading.Thread(
            target=lambda: producer.push(spec_for(consumer.config, "r-early"), chunks)
        )
        pushed.start()
        wait_for(lambda: consumer.used_pages == 1, what="the allocation")
        consumer.release("r-early")
        assert consumer.used_pages == 1  # the write may still land: the page is not reused
        channel.stalled = False
        pushed.join(5)
        producer.close()
        wait_for(lambda: consumer.used_pages == 0, what="the landed write to free its page")
        assert consumer.stats_snapshot()["chunks_landed"] == 1


def test_chunks_no_decode_claims_are_freed_after_the_claim_timeout(fabric, keyer) -> None:
    """Pushed for a request whose client left (or whose decode computed the prompt itself):
    the pages come back after claim_timeout_s, not hold_timeout_s; a claimed request's stay."""
    with start_consumer(fabric, keyer, claim_timeout_s=0.3, hold_timeout_s=30.0) as consumer:
        producer, _ = make_producer(fabric)
        with producer:
            consumer.claim("r-claimed")  # control: a decode waits for this one
            for req_id in ("r-orphan", "r-claimed"):
                chunks = make_chunks(keyer.chunk_keys([1, 2, len(req_id)]), 6)
                producer.push(spec_for(consumer.config, req_id), chunks)
        # A push into pages reserved ahead is the consumer's to count once its note lands.
        wait_for(lambda: consumer.stats_snapshot()["chunks_landed"] == 2, what="both to land")
        assert consumer.used_pages == 2
        wait_for(lambda: consumer.used_pages == 1, what="the unclaimed hold to lapse")
        time.sleep(0.3)
        assert consumer.used_pages == 1
        assert consumer.stats_snapshot()["holds_expired"] == 1
        assert consumer.dropped_reason("r-orphan") == "hold_lapsed"
        consumer.release("r-claimed")
        assert consumer.used_pages == 0


def test_a_push_after_the_request_was_released_is_refused_and_holds_nothing(
    consumer: Consumer, fabric, keyer
) -> None:
    producer, _ = make_producer(fabric)
    spec = spec_for(consumer.config, "r-late")
    with producer:
        producer.push(spec, make_chunks(keyer.chunk_keys(list(range(256))), 1))
        consumer.release("r-late")
        with pytest.raises(RequestDropped, match="let go"):
            producer.push(spec, make_chunks(keyer.chunk_keys(list(range(300))), 2))
        # control: another request is served as before
        producer.push(spec_for(consumer.config, "r-other"), make_chunks(keyer.chunk_keys([5]), 3))
    assert consumer.stats_snapshot()["refused_dropped"] == 1
    # r-other's page; r-late's goes once its write's notice is in (a moment after push returns)
    wait_for(lambda: consumer.used_pages == 1, timeout_s=2.0, what="r-late's page back")


def test_abandoned_kv_is_known_to_the_consumer_at_once(consumer: Consumer, fabric, keyer) -> None:
    """The producer cannot deliver: it says so, and the consumer frees the request's pages and
    tells a decode that claims it to recompute, instead of letting it wait for its deadline."""
    producer, _ = make_producer(fabric)
    spec = spec_for(consumer.config, "r-gone")
    with producer:
        producer.push(spec, make_chunks(keyer.chunk_keys(list(range(256))), 1))
        assert consumer.claim("r-gone") is None  # control: nothing said yet
        assert producer.abandon(spec, AbandonReason.STAGING_FULL, "no room")
        assert producer.abandon(spec, AbandonReason.STAGING_FULL)  # idempotent
    assert consumer.claim("r-gone") == "staging_full"
    # freed (or cached) once the write's notice is in, a moment after push returned
    wait_for(lambda: consumer.used_pages == 0, timeout_s=2.0, what="the pages back")
    assert consumer.stats_snapshot()["requests_abandoned"] == 2


def test_abandoning_towards_a_dead_consumer_is_bounded(fabric) -> None:
    producer, _ = make_producer(fabric)
    dead = DisaggSpec("r-x", "127.0.0.1", free_port(), free_port())
    started = time.monotonic()
    with producer:
        assert not producer.abandon(dead, AbandonReason.TRANSFER_FAILED)
    assert time.monotonic() - started < 2 * CANCEL_TIMEOUT_S


@pytest.mark.parametrize("reserved_pages", [0, 1])
def test_a_consumer_restarted_on_the_same_ports_gets_a_fresh_handshake(
    fabric, keyer, caplog: pytest.LogCaptureFixture, reserved_pages: int
) -> None:
    """Asking first, the new consumer's answer names another agent: its pages are cancelled,
    the push is retried once and lands. Writing into pages the former consumer reserved ahead
    fails instead, and the push is retried once the same way."""
    fields = consumer_fields(num_pages=8)
    config = load_config(None, environ={}, **fields)
    producer, _ = make_producer(fabric, reserved_pages=reserved_pages)
    with producer:
        with Consumer(config, keyer, channel=FakeChannel(fabric, "consumer")) as first:
            producer.push(spec_for(fields, "r-1"), make_chunks(keyer.chunk_keys([1, 2]), 1))
            wait_for(lambda: first.stats_snapshot()["chunks_landed"] == 1)
            # asked for while the write was in flight; answered, at times, after it landed
            wait_for(lambda: first.stats_snapshot()["reserved_pages"] == reserved_pages)
        with Consumer(config, keyer, channel=FakeChannel(fabric, "consumer")) as second:
            result = producer.push(spec_for(fields, "r-2"), make_chunks(keyer.chunk_keys([3]), 2))
            assert result.chunks_sent == 1 and not result.reserved
            wait_for(lambda: second.stats_snapshot()["chunks_landed"] == 1)
            stats = second.stats_snapshot()
            assert stats["used_pages"] == 1
    expected = "reserved ahead failed" if reserved_pages else "is now"
    assert f"{expected}" in caplog.text and "shaking hands again" in caplog.text
    if not reserved_pages:
        assert stats["allocations_cancelled"] == 1


def test_full_buffer_is_retried_until_room_appears(consumer: Consumer, fabric, keyer) -> None:
    producer, _ = make_producer(fabric, max_alloc_retries=20)
    first = make_chunks(keyer.chunk_keys(list(range(8 * 256))), seed=7)
    second = make_chunks(keyer.chunk_keys(list(range(1000, 1256))), seed=8)
    with producer:
        producer.push(spec_for(consumer.config, "r-fill"), first)
        wait_for(
            lambda: consumer.used_pages == 8 and consumer.stats_snapshot()["chunks_landed"] == 8
        )
        threading.Timer(0.1, consumer.release, args=("r-fill",)).start()
        result = producer.push(spec_for(consumer.config, "r-next"), second)
    assert result.chunks_sent == 1
    assert consumer.stats_snapshot()["refused_buffer_full"] >= 1
    consumer.release("r-next")


def test_full_buffer_without_retries_raises_buffer_full(consumer: Consumer, fabric, keyer) -> None:
    producer, _ = make_producer(fabric, max_alloc_retries=0)
    with producer:
        producer.push(
            spec_for(consumer.config, "r-fill"), make_chunks(keyer.chunk_keys(list(range(2048))), 9)
        )
        with pytest.raises(BufferFull, match="r-more"):
            producer.push(
                spec_for(consumer.config, "r-more"), make_chunks(keyer.chunk_keys([5]), 10)
            )
    consumer.release("r-fill")
    wait_for(lambda: consumer.used_pages == 0)


def test_checksum_catches_bytes_changed_after_the_write(consumer: Consumer, fabric, keyer) -> None:
    producer, _ = make_producer(fabric)
    chunks = make_chunks(keyer.chunk_keys(list(range(300))), seed=11)
    with producer:
        producer.push(spec_for(consumer.config, "r-bad"), chunks)
    wait_for(lambda: consumer.lookup(list(range(300))) == 300)
    consumer.get_chunk(chunks[1][0])  # negative control: intact bytes pass
    consumer.get_chunk(chunks[1][0])[17] ^= 0xFF
    with pytest.raises(IntegrityError):
        consumer.get_chunk(chunks[1][0])
    assert consumer.stats_snapshot()["integrity_failures"] == 1
    consumer.release("r-bad")


def test_chunks_already_in_staging_are_sent_without_a_copy(
    consumer: Consumer, fabric, keyer
) -> None:
    producer, _ = make_producer(fabric)
    [key] = [k.key for k in keyer.chunk_keys(list(range(256)))]
    with producer, producer.staged(1) as [page]:
        page.copy_(torch.arange(page.numel(), dtype=torch.int32).to(torch.uint8))
        producer.push(spec_for(consumer.config, "r-staged"), [(key, page)])
        wait_for(lambda: consumer.lookup(list(range(256))) == 256)
        assert torch.equal(consumer.get_chunk(key), page)
    consumer.release("r-staged")


def test_a_bug_while_answering_gets_an_error_reply_and_serving_goes_on(
    consumer: Consumer, fabric, keyer, monkeypatch: pytest.MonkeyPatch
) -> None:
    allocate = consumer._store.allocate
    failures = iter([True])

    def allocate_with_a_bug(request, now, producer):
        if next(failures, False):
            raise RuntimeError("a bug")
        return allocate(request, now, producer)

    monkeypatch.setattr(consumer._store, "allocate", allocate_with_a_bug)
    producer, _ = make_producer(fabric)
    chunks = make_chunks(keyer.chunk_keys(list(range(20))), seed=12)
    with producer:
        with pytest.raises(PeerError, match="internal"):
            producer.push(spec_for(consumer.config, "r-bug"), chunks)
        producer.push(spec_for(consumer.config, "r-after-bug"), chunks)
    assert consumer.stats_snapshot()["internal_errors"] == 1
    consumer.release("r-after-bug")
    # The write's notice reaches the consumer's thread a moment after push() returns.
    wait_for(lambda: consumer.used_pages == 0, timeout_s=2.0, what="the write confirmed")


def test_no_room_in_producer_staging_fails_before_the_consumer_is_asked(
    consumer: Consumer, fabric, keyer
) -> None:
    channel = FakeChannel(fabric, "producer")
    chunks = make_chunks(keyer.chunk_keys(list(range(3 * 256))), seed=13)
    with Producer(producer_config(num_pages=2), channel=channel) as producer:
        with pytest.raises(AllocationError, match="staging"):
            producer.push(spec_for(consumer.config, "r-no-staging"), chunks)
        with producer.staged(2) as pages:  # the failed push gave back what it took
            assert len(pages) == 2
    assert consumer.stats_snapshot()["alloc_requests"] == 0
    assert consumer.used_pages == 0


def test_handshake_cut_after_the_metadata_leaves_no_half_made_peer(
    consumer: Consumer, fabric, keyer
) -> None:
    """An init port that answers the metadata request, then falls silent: the producer had
    loaded the peer's metadata, and must forget it so that the next try starts clean."""
    silent_after_metadata = FakeChannel(fabric, "consumer")
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = free_port()
    router.bind(f"tcp://127.0.0.1:{port}")

    def answer_metadata_only() -> None:
        if router.poll(5000):
            identity, _ = router.recv_multipart()
            reply = AgentMetadata(
                version=PROTOCOL_VERSION,
                agent_name=silent_after_metadata.agent_name,
                metadata=silent_after_metadata.local_metadata(),
                profile=KVProfile(chunk_size=CHUNK_SIZE, page_bytes=PAGE_BYTES),
                stack="another-host",
            )
            router.send_multipart([identity, encode(reply)])

    answering = threading.Thread(target=answer_metadata_only)
    answering.start()
    producer, channel = make_producer(fabric, handshake_timeout_s=0.3)
    try:
        with producer:
            with pytest.raises(PeerTimeout, match="BufferRequest"):
                producer.connect(DisaggSpec("r-half", "127.0.0.1", port, free_port()))
            assert channel.peers == set()
            producer.connect(spec_for(consumer.config, "r-whole"))  # the control
            assert len(channel.peers) == 1
    finally:
        answering.join(5)
        router.close(linger=0)
        context.term()


def test_a_service_loop_that_stops_turning_is_reported_with_its_stack(
    consumer: Consumer, caplog: pytest.LogCaptureFixture
) -> None:
    """Something holds the consumer's lock (here: the test) for longer than the watchdog's
    patience: it logs where the service thread is stuck, counts the stall, then its end."""
    from lmcache_pd.transfer.consumer import SERVICE_STALL_S

    with caplog.at_level("WARNING", "lmcache_pd.transfer.watchdog"):
        with consumer._lock:
            wait_for(lambda: "has not turned" in caplog.text, SERVICE_STALL_S + 2, "a report")
            # counted just after the report (the stacks are logged first, by design)
            wait_for(lambda: consumer.stats.service_stalls == 1, 2, "the stall counted")
        # the stuck thread's own frames: the loop's turn, waiting at the lock
        assert "--- thread lmcache-pd-consumer:" in caplog.text
        assert "in _turn" in caplog.text
        wait_for(lambda: "turns again" in caplog.text, 3, "the end of the stall")
    assert consumer.stats.service_stalls == 1  # one stall, reported once


def test_an_unexpected_error_in_the_service_loop_is_counted_and_serving_goes_on(
    consumer: Consumer, fabric, keyer, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = consumer._store.expire
    failures = iter([RuntimeError("a bug")])

    def expire_once_broken(now: float):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return real(now)

    monkeypatch.setattr(consumer._store, "expire", expire_once_broken)
    wait_for(lambda: consumer.stats_snapshot()["internal_errors"] == 1, what="the error counted")
    producer, _ = make_producer(fabric)
    with producer:  # and it still serves
        result = producer.push(
            spec_for(consumer.config, "r-after"), make_chunks([keyer.chunk_keys([1])[0]], 1)
        )
    assert result.chunks_sent == 1
    assert consumer._thread.is_alive()


@pytest.mark.parametrize("write_in_flight", [False, True])
def test_abandoned_allocations_with_no_write_in_flight_are_freed_at_once(
    fabric, keyer, write_in_flight: bool
) -> None:
    """The producer's AllocRequest was answered after it had given up (the consumer was
    stopped meanwhile): no write will come, and saying so frees the pages now, not at the
    lease. Control: a write that may still land keeps its pages until the lease."""
    with start_consumer(fabric, keyer, alloc_lease_s=30.0) as consumer:
        request = AllocRequest(
            version=PROTOCOL_VERSION,
            req_id="r-gave-up",
            chunks=[ChunkSpec(k.key, 64) for k in keyer.chunk_keys(list(range(600)))],
        )
        with zmq.Context() as context, context.socket(zmq.DEALER) as socket:
            socket.connect(f"tcp://127.0.0.1:{consumer.config.alloc_port}")
            socket.send(encode(request))
            assert socket.poll(5000)
            socket.recv()
        assert consumer.used_pages == 3
        producer, _ = make_producer(fabric)
        with producer:
            spec = spec_for(consumer.config, "r-gave-up")
            reason = AbandonReason.TRANSFER_FAILED
            assert producer.abandon(spec, reason, write_in_flight=write_in_flight)
        assert consumer.used_pages == (3 if write_in_flight else 0)
