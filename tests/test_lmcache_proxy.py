"""LMCache's proxy protocol, our side of it: the ``ProxyNotif`` prefill sends, as their proxy
decodes it, sent once per decode rank and only once the request's pushes to that rank are done;
the 1p1d shape (no ``disagg_spec``: the configured peer); and decode serving a request that names
no transfer parameters from the chunks landed for it, waiting briefly for them to show.

Their proxy's decoder is written here from their struct definitions (a msgspec union of structs
tagged by class name), not imported: nothing of theirs is in the project.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import zmq

from lmcache_pd import lmcache_proxy
from lmcache_pd.config import load_config
from lmcache_pd.connector.landed_chunks import LandedChunks
from lmcache_pd.connector.metadata import PDConnectorMetadata, SaveRequest
from lmcache_pd.connector.scheduler import ConsumerScheduler, ProducerScheduler
from lmcache_pd.lmcache_proxy import ProxyNotifier, encode_notice
from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.trace import TraceFile
from lmcache_pd.transfer.consumer import Consumer
from lmcache_pd.transfer.fake_channel import FakeChannel, FakeFabric
from lmcache_pd.transfer.landed_keys import KeysWriter
from lmcache_pd.transfer.producer import Producer
from lmcache_pd.transfer.sender import SenderPool
from lmcache_pd.transfer.sender_jobs import NoticeJob, Saving
from lmcache_pd.transfer.staging import Staging
from tests.helpers import (
    CHUNK_SIZE,
    consumer_fields,
    free_port,
    make_chunks,
    make_keyer,
    producer_config,
    spec_for,
    submit_push,
    wait_for,
)

RECEIVE_TIMEOUT_MS = 5000


# ---- their proxy's decoders, from their struct definitions ----


class PDMsgBase(msgspec.Struct, tag=True):
    """Today's PD backend's messages: tagged by class name, under msgspec's ``type``."""


class AllocRequest(PDMsgBase):
    keys: list[str]
    fmt: int
    shape: list[int]
    dtype: str
    last_chunk_toks: int


class AllocResponse(PDMsgBase):
    already_sent_indexes: list[int]
    remote_indexes: list[int]


class ProxyNotif(PDMsgBase):
    req_id: str


class NixlMsgBase(msgspec.Struct, tag=True):
    """The xpyd era's messages."""


class NixlAllocResponse(NixlMsgBase):
    remote_indexes: list[int]


class NixlProxyNotif(NixlMsgBase):
    req_id: str


PDMsg = AllocRequest | AllocResponse | ProxyNotif
NixlMsg = NixlAllocResponse | NixlProxyNotif


def test_a_notice_is_what_their_proxy_decodes() -> None:
    """The msgpack map ``{"type": "ProxyNotif", "req_id": ...}``, decoded by today's proxy's
    union into its ``ProxyNotif``; the xpyd era's tag by that era's. The control: each proxy
    refuses the other generation's tag, so the tag must follow the configuration's generation."""
    raw = encode_notice("42")
    assert msgspec.msgpack.decode(raw) == {"type": "ProxyNotif", "req_id": "42"}
    assert msgspec.msgpack.decode(raw, type=PDMsg) == ProxyNotif(req_id="42")
    old = encode_notice("42", "NixlProxyNotif")
    assert msgspec.msgpack.decode(old, type=NixlMsg) == NixlProxyNotif(req_id="42")
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(old, type=PDMsg)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(raw, type=NixlMsg)


@pytest.fixture
def proxy_socket() -> Iterator[tuple[zmq.Socket, int]]:
    """Their proxy's side: a PULL socket bound on a free port."""
    context = zmq.Context()
    pull = context.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.setsockopt(zmq.RCVTIMEO, RECEIVE_TIMEOUT_MS)
    port = free_port()
    pull.bind(f"tcp://127.0.0.1:{port}")
    yield pull, port
    pull.close()
    context.term()


def test_the_notifier_reaches_their_proxy_and_says_plainly_it_is_not_curve(
    proxy_socket: tuple[zmq.Socket, int], caplog: pytest.LogCaptureFixture
) -> None:
    pull, port = proxy_socket
    counted: list[str] = []
    with caplog.at_level(logging.WARNING, logger="lmcache_pd.lmcache_proxy"):
        notifier = ProxyNotifier("127.0.0.1", port, "ProxyNotif", count=counted.append, secret=True)
    try:
        assert notifier.send("7")
        assert msgspec.msgpack.decode(pull.recv(), type=PDMsg) == ProxyNotif(req_id="7")
    finally:
        notifier.close()
        notifier.close()  # idempotent
    assert counted == ["proxy_notices"]
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("SECURITY: LMCache's proxy speaks plain ZMQ")
    assert not notifier.send("8")  # closed: nothing goes, nothing raises


def test_notices_a_proxy_does_not_read_are_dropped_and_counted_never_waited_for(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(lmcache_proxy, "NOTICE_QUEUE", 1)
    monkeypatch.setattr(lmcache_proxy, "CLOSE_LINGER_MS", 0)
    counted: list[str] = []
    notifier = ProxyNotifier(
        "127.0.0.1", free_port(), "ProxyNotif", count=counted.append, secret=False
    )
    started = time.monotonic()
    try:
        sent = [notifier.send(str(n)) for n in range(20)]
    finally:
        notifier.close()
    assert time.monotonic() - started < 1.0
    assert not all(sent) and counted.count("proxy_notices_dropped") == sent.count(False)
    assert counted.count("proxy_notices") == sent.count(True)
    assert not [r for r in caplog.records if r.getMessage().startswith("SECURITY")]


# ---- a notice follows its request's pushes on the consumer rank's sender thread ----


class Senders:
    """A producer rank's sender pool in this process over the fake transport, and a consumer."""

    def __init__(self, fabric: FakeFabric, **channel: object) -> None:
        self.keyer = make_keyer()
        consumer_config = load_config(None, environ={}, **consumer_fields(num_pages=16))
        self.consumer = Consumer(
            consumer_config, self.keyer, channel=FakeChannel(fabric, "consumer")
        )
        # No self-test write: the knobs hold every write, that one too.
        settings = {"transport_self_test": False}
        if channel.get("stalled"):
            settings["transfer_timeout_s"] = 0.3
        config = producer_config(num_pages=16, reserved_pages=0, **settings)
        self.staging = Staging(num_pages=config.num_pages, page_bytes=config.page_bytes)
        self.counts: dict[str, int] = {}
        self.pool = SenderPool(
            lambda: Producer(
                config, staging=self.staging, channel=FakeChannel(fabric, "producer", **channel)
            ),
            self.count,
            TraceFile(None),
            [],
        )
        self.spec = spec_for(consumer_config, "r1")

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def push(self, request: Saving, tokens: list[int], seed: int) -> None:
        chunks = make_chunks(self.keyer.chunk_keys(tokens), seed=seed)
        submit_push(self.pool, self.staging, request, chunks)

    def close(self) -> None:
        self.pool.close()
        self.consumer.close()


def test_the_notice_comes_once_the_requests_pushes_to_the_rank_are_written() -> None:
    """Two pushes (prefill's two steps), each write done only after a few polls, then the
    notice job: it runs after both writes were done (pushes counted), says the KV landed, and the
    consumer holds all of it. The control: a push whose write never finishes fails, and the
    notice still comes, saying so (their proxy waits for it with no deadline)."""
    senders = Senders(FakeFabric(), polls_before_done=5)
    tokens = list(range(3 * CHUNK_SIZE))
    request = Saving(senders.spec, [], prompt_tokens=len(tokens))
    seen: list[tuple[bool, int]] = []
    done = threading.Event()

    def notify(landed: bool) -> None:
        """What the sender says, and how many pushes it had finished by then."""
        seen.append((landed, watched.counts.get("pushes", 0)))
        done.set()

    watched = senders
    try:
        senders.push(request, tokens[: 2 * CHUNK_SIZE], seed=1)
        senders.push(request, tokens, seed=1)  # the same first chunks: their keys again
        senders.pool.submit(NoticeJob(request, notify))
        assert done.wait(10)
        assert seen == [(True, 2)]
        wait_for(lambda: senders.consumer.lookup(tokens) == len(tokens), what="all landed")
    finally:
        senders.close()

    stalled = watched = Senders(FakeFabric(), stalled=True)
    request = Saving(stalled.spec, [], prompt_tokens=CHUNK_SIZE)
    seen.clear()
    done.clear()
    try:
        stalled.push(request, tokens[:CHUNK_SIZE], seed=2)
        stalled.pool.submit(NoticeJob(request, notify))
        assert done.wait(10)
        assert seen == [(False, 0)]
    finally:
        stalled.close()


# ---- the scheduler halves ----


def stand_in(req_id: str, prompt: list[int], params: dict | None, arrived: float = 0.0):
    """A stand-in vLLM Request."""
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=prompt,
        kv_transfer_params=params,
        cache_salt=None,
        lora_request=None,
        mm_features=[],
        output_token_ids=[5],
        num_computed_tokens=len(prompt),
        num_preemptions=0,
        arrival_time=arrived,
        status=None,
        priority=0,
    )


def new_step(req_id: str, blocks: list[int], computed: int) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=req_id, block_ids=(blocks,), num_computed_tokens=0)
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={req_id: computed},
        finished_req_ids=set(),
    )


def test_a_request_naming_no_consumer_is_pushed_to_the_configured_peer() -> None:
    """LMCache's 1p1d proxy sends prefill ``{"ret_first_tok": true}`` and no ``disagg_spec``:
    the producer pushes to its configured peer (every rank's ports) under an id of its own and
    answers ``first_tok``. The control: without a peer, such a request is not pushed."""
    peer = "10.0.0.7:7300,7301:7400,7401"
    scheduler = ProducerScheduler(default_peer=peer)
    prompt = list(range(300))
    req = stand_in("cmpl-1", prompt, {"ret_first_tok": True})
    scheduler.update_state_after_alloc(req, None, 0)
    scheduler.update_state_after_alloc(req, None, 0)  # asked again: one push, one id
    [save] = scheduler.build_connector_meta(new_step("cmpl-1", [1, 2, 3], 300)).saves
    assert isinstance(save, SaveRequest) and save.prompt == prompt
    assert save.spec.req_id.startswith("peer-")
    assert save.spec == DisaggSpec(save.spec.req_id, "10.0.0.7", [7300, 7301], [7400, 7401])
    returned = scheduler.request_finished(req)
    assert returned == {"first_tok": 5, "disagg_req_id": save.spec.req_id}
    alone = ProducerScheduler()
    alone.update_state_after_alloc(stand_in("cmpl-2", prompt, {"ret_first_tok": True}), None, 0)
    assert alone.build_connector_meta(new_step("cmpl-2", [1], 300)).saves == []
    assert alone.request_finished(stand_in("cmpl-2", prompt, None)) is None
    assert PDConnectorMetadata().saves == []


def test_a_request_with_no_transfer_parameters_waits_briefly_for_its_chunks_to_show(
    tmp_path: Path,
) -> None:
    """Their proxy sends decode the prompt and first token bare once prefill said the KV
    landed; decode's view of its consumer lags a landing: the request waits (vLLM asks again
    next step) until its prompt's chunks, the partial last one too, all show, then loads them
    all; counted once. Past ``landed_wait_s`` from its arrival it waits no more and loads what
    is there (the control, and a request nothing was pushed for). Without the setting (our own
    proxy's requests served alone) nothing waits."""
    keyer = make_keyer(chunk_size=64)
    writer = KeysWriter(tmp_path / "keys", max_keys=64)
    landed = LandedChunks([keyer], [tmp_path / "keys"])
    counted: list[str] = []
    scheduler = ConsumerScheduler(
        counted.append, chunk_size=64, landed_chunks=landed, landed_wait_s=0.5
    )
    prompt = list(range(150))  # two whole chunks and a partial one
    chunks = keyer.chunk_keys(prompt)
    req = stand_in("c", [*prompt, 9], None, arrived=time.time())
    writer.post([chunk.key for chunk in chunks[:2]])
    assert scheduler.get_num_new_matched_tokens(req, 0) == (None, False)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (None, False)
    writer.post([chunk.key for chunk in chunks])
    assert scheduler.get_num_new_matched_tokens(req, 0) == (150, False)
    assert counted == ["landed_waits"]
    late = stand_in("late", [*prompt[:100], 7, 9], None, arrived=time.time() - 0.5)
    assert scheduler.get_num_new_matched_tokens(late, 0) == (64, False)  # its first chunk only
    unwaiting = ConsumerScheduler(counted.append, chunk_size=64, landed_chunks=landed)
    fresh = stand_in("fresh", [*prompt[:100], 7, 9], None, arrived=time.time())
    assert unwaiting.get_num_new_matched_tokens(fresh, 0) == (64, False)
    assert counted == ["landed_waits"]
    landed.close()
    writer.close()


# ---- prefill's worker: one notice per request, at the end of its prompt, over real NIXL ----


@pytest.mark.processes
def test_prefill_tells_their_proxy_once_per_request_after_its_last_push(
    proxy_socket: tuple[zmq.Socket, int], tmp_path: Path
) -> None:
    """A prompt computed in two steps (two pushes) brings one notice, after the second push was
    written: decode then loads all of it. The control: a request whose consumer is not there
    gets its notice too, saying so in the counters (their proxy would otherwise wait forever),
    and decode computes it."""
    from lmcache_pd.connector.consumer_worker import ConsumerWorker
    from lmcache_pd.connector.counters import StatsRecorder
    from lmcache_pd.connector.metadata import LoadRequest
    from lmcache_pd.connector.worker import ProducerWorker
    from tests.test_connector_halves import BLOCK, CHUNK, paged_cache

    pull, port = proxy_socket
    keyer = make_keyer(model_name="m", chunk_size=CHUNK)
    init_port, alloc_port = free_port(), free_port()
    common = {"chunk_size": CHUNK, "buffer_size_bytes": 64 << 20, "handshake_timeout_s": 1.0}
    consumer_stats, producer_stats = StatsRecorder("c"), StatsRecorder("p")
    source, target = paged_cache(40, seed=1), paged_cache(40, seed=None)
    consumer = ConsumerWorker(
        load_config(
            None,
            environ={},
            kv_role="kv_consumer",
            init_port=init_port,
            alloc_port=alloc_port,
            **common,
        ),
        keyer,
        target,
        consumer_stats,
        board=tmp_path / "landed",
    )
    producer = ProducerWorker(
        load_config(
            None,
            environ={},
            kv_role="kv_producer",
            lmcache_proxy_host="127.0.0.1",
            lmcache_proxy_port=port,
            **common,
        ),
        keyer,
        source,
        producer_stats,
    )
    prompt, blocks = list(range(1000, 1150)), [7, 3, 12, 20, 5]
    try:
        spec = DisaggSpec("their-7", "127.0.0.1", init_port, alloc_port)
        for computed, step_blocks, announced in (
            (BLOCK * 2, blocks[:2], prompt),
            (150, blocks[2:], None),
        ):
            producer.wait_for_save(
                PDConnectorMetadata(
                    saves=[SaveRequest("p", spec, announced, step_blocks, computed)]
                )
            )
        assert msgspec.msgpack.decode(pull.recv(), type=PDMsg) == ProxyNotif(req_id="their-7")
        assert producer_stats.totals()["pushes"] == 2  # both written before the notice
        consumer.start_load_kv(
            PDConnectorMetadata(loads=[LoadRequest("c", "their-7", prompt, [1, 30, 2, 9, 11], 0)])
        )
        wait_for(lambda: consumer.finished_loads() == ({"c"}, set()), what="the load")
        assert consumer_stats.totals()["tokens_loaded"] == 150

        nowhere = DisaggSpec("their-8", "127.0.0.1", free_port(), free_port())
        producer.wait_for_save(
            PDConnectorMetadata(saves=[SaveRequest("q", nowhere, prompt, blocks, 150)])
        )
        assert msgspec.msgpack.decode(pull.recv(), type=PDMsg) == ProxyNotif(req_id="their-8")
        wait_for(lambda: producer_stats.totals()["proxy_notices"] == 2, what="counted")
        assert producer_stats.totals()["proxy_notices_unlanded"] == 1
        pull.setsockopt(zmq.RCVTIMEO, 300)
        with pytest.raises(zmq.Again):  # one notice per request, however many steps
            pull.recv()
    finally:
        producer.close()
        consumer.close()
