"""Compatibility at handshake: profiles compared field by field, a mismatch refused with the
field and both values, and the request's decode told at once so that it recomputes."""

from __future__ import annotations

import contextlib
import time

import msgspec
import pytest

from lmcache_pd.compat import FIELDS, KVProfile, incompatibilities
from lmcache_pd.config import load_config
from lmcache_pd.connector.stats import StatsRecorder
from lmcache_pd.errors import Incompatible
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.trace import TraceFile
from lmcache_pd.transfer.consumer import Consumer
from lmcache_pd.transfer.fake_channel import FakeChannel, FakeFabric
from lmcache_pd.transfer.producer import Producer
from lmcache_pd.transfer.sender import SenderPool
from lmcache_pd.transfer.sender_jobs import PushJob, Saving
from tests.helpers import (
    CHUNK_SIZE,
    PAGE_BYTES,
    consumer_fields,
    make_chunks,
    producer_config,
    spec_for,
    wait_for,
)

FULL = KVProfile(
    chunk_size=CHUNK_SIZE,
    page_bytes=PAGE_BYTES,
    model="/models/tiny-llama",
    kv_dtype="float32",
    chunk_format="blocks:4x2x128x128",
    block_size=128,
    tp_size=1,
    tp_rank=0,
)
DIFFERENT = {
    "chunk_size": 512,
    "page_bytes": 2 * PAGE_BYTES,
    "model": "/models/other",
    "kv_dtype": "bfloat16",
    "chunk_format": "blocks:4x2x128x64",
    "block_size": 256,
    "tp_size": 2,
    "tp_rank": 1,
}


@pytest.mark.parametrize("field", FIELDS)
def test_each_field_that_differs_is_named_with_both_values(field: str) -> None:
    consumer = msgspec.structs.replace(FULL, **{field: DIFFERENT[field]})
    problems = incompatibilities(FULL, consumer)
    assert (
        problems[0] == f"{field}: producer {getattr(FULL, field)!r}, consumer {DIFFERENT[field]!r}"
    )


def test_different_tensor_parallel_sizes_are_refused_as_such() -> None:
    problems = incompatibilities(FULL, msgspec.structs.replace(FULL, tp_size=2))
    assert "prefill and decode need the same tensor-parallel size" in problems


def test_fields_one_side_does_not_know_are_not_compared() -> None:
    standalone = KVProfile(chunk_size=CHUNK_SIZE, page_bytes=PAGE_BYTES)
    assert incompatibilities(standalone, FULL) == incompatibilities(FULL, standalone) == []
    assert incompatibilities(FULL, FULL) == []  # the control


TOKENS = msgspec.structs.replace(FULL, chunk_format="tokens:KV_2LTD:4x256", block_size=None)


def test_a_block_format_and_a_token_format_peer_are_refused_naming_both() -> None:
    for producer, consumer in ((FULL, TOKENS), (TOKENS, FULL)):
        problems = incompatibilities(producer, consumer)
        assert problems[0] == (
            f"chunk_format: producer {producer.chunk_format!r}, consumer {consumer.chunk_format!r}"
        )
        assert any("cannot be converted" in problem for problem in problems)


def test_token_chunks_do_not_depend_on_the_engines_layout_or_block_size() -> None:
    """An NHD producer and an HND consumer (or block sizes 16 and 32) make the same chunks:
    their profiles differ in nothing compared."""
    assert incompatibilities(TOKENS, TOKENS) == []
    wider_heads = msgspec.structs.replace(TOKENS, chunk_format="tokens:KV_2LTD:4x512")
    assert incompatibilities(TOKENS, wider_heads) == [
        "chunk_format: producer 'tokens:KV_2LTD:4x256', consumer 'tokens:KV_2LTD:4x512'"
    ]


@pytest.fixture
def fabric() -> FakeFabric:
    return FakeFabric()


def fake_consumer(fabric: FakeFabric, keyer: ChunkKeyer, profile: KVProfile) -> Consumer:
    config = load_config(None, environ={}, **consumer_fields(num_pages=8))
    return Consumer(config, keyer, channel=FakeChannel(fabric, "consumer"), profile=profile)


@pytest.mark.parametrize("model", ["/models/other", FULL.model], ids=["mismatch", "control"])
def test_an_incompatible_consumer_refuses_the_handshake_and_is_counted(
    fabric: FakeFabric, keyer: ChunkKeyer, model: str
) -> None:
    profile = msgspec.structs.replace(FULL, model=model)
    with (
        fake_consumer(fabric, keyer, profile) as consumer,
        Producer(producer_config(), channel=FakeChannel(fabric, "p"), profile=FULL) as producer,
    ):
        if model == FULL.model:
            producer.connect(spec_for(consumer.config, "r"))
            return
        with pytest.raises(Incompatible) as refused:
            producer.connect(spec_for(consumer.config, "r"))
        assert f"model: producer {FULL.model!r}, consumer {model!r}" in str(refused.value)
        assert consumer.stats_snapshot()["handshakes_refused"] == 1


def test_push_to_an_incompatible_consumer_is_abandoned_so_decode_recomputes_at_once(
    fabric: FakeFabric, keyer: ChunkKeyer
) -> None:
    """The sender tells the consumer (reason "incompatible"), so a decode waiting for the KV
    recomputes at its next step; the next push fails at once, without another handshake."""
    stats = StatsRecorder("rank0")
    other = msgspec.structs.replace(FULL, kv_dtype="bfloat16")
    with fake_consumer(fabric, keyer, other) as consumer, contextlib.ExitStack() as stack:
        pool = SenderPool(
            lambda: Producer(
                producer_config(),
                channel=FakeChannel(fabric, "producer"),
                profile=FULL,
                count=stats.add,
            ),
            stats.add,
            TraceFile(None),
            [],
        )
        stack.callback(pool.close)
        tokens = list(range(600))
        keys = keyer.chunk_keys(tokens)
        for req_id in ("first", "second"):
            request = Saving(spec_for(consumer.config, req_id), keys, len(tokens))
            chunks = make_chunks(keys, seed=1)
            pool.submit(PushJob(request, chunks, None, contextlib.nullcontext(), time.time()))
            wait_for(lambda r=req_id: consumer.dropped_reason(r) == "incompatible", 5, req_id)
        totals = stats.totals()
        assert totals["handshakes_refused"] == 1  # the second push did not shake hands again
        assert consumer.stats_snapshot()["handshakes_refused"] == 1
        assert totals["push_failures"] == totals["pushes_abandoned"] == 2
        assert totals["pushes"] == 0
