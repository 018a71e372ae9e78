"""Compatibility at handshake: profiles compared field by field, a mismatch refused with the
field and both values, and the request's decode told at once so that it recomputes."""

from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import msgspec
import pytest
import torch

from lmcache_pd.compat import FIELDS, KVProfile, incompatibilities
from lmcache_pd.config import load_config
from lmcache_pd.connector.counters import StatsRecorder
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
    kv_heads=2,
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
    "kv_heads": 4,
    "prefill_tp_size": 2,
    "pp_size": 2,
    "unsupported_layers": "MambaSpec",
}


@pytest.mark.parametrize("field", FIELDS)
def test_each_field_that_differs_is_named_with_both_values(field: str) -> None:
    consumer = msgspec.structs.replace(FULL, **{field: DIFFERENT[field]})
    problems = incompatibilities(FULL, consumer)
    # A producer's prefill TP size is its own TP size; an unknown pipeline size is 1.
    ours = {"prefill_tp_size": FULL.tp_size, "pp_size": 1}.get(field, getattr(FULL, field))
    assert problems[0].startswith(f"{field}: producer {ours!r}, consumer {DIFFERENT[field]!r}")


def rank(profile: KVProfile, tp_size: int, tp_rank: int, **fields: object) -> KVProfile:
    """``profile`` as rank ``tp_rank`` of ``tp_size``: its chunks hold its share of 2 heads."""
    fields.setdefault("chunk_format", f"blocks:4x{2 // min(tp_size, 2)}x128x128")
    return msgspec.structs.replace(profile, tp_size=tp_size, tp_rank=tp_rank, **fields)


def test_prefill_and_decode_at_different_tp_sizes_pair_the_ranks_that_share_heads() -> None:
    """2 KV heads: a TP-1 prefill feeds both ranks of a TP-2 decode (fan-out), both ranks of a
    TP-2 prefill feed a TP-1 decode (fan-in); page sizes differ by design."""
    for decode_rank in (0, 1):
        consumer = rank(FULL, 2, decode_rank, prefill_tp_size=1, page_bytes=PAGE_BYTES // 2)
        assert incompatibilities(FULL, consumer) == []
    for prefill_rank in (0, 1):
        producer = rank(FULL, 2, prefill_rank, page_bytes=PAGE_BYTES // 2)
        assert incompatibilities(producer, rank(FULL, 1, 0, prefill_tp_size=2)) == []
    # The rest must still agree.
    other_dtype = rank(FULL, 2, 0, prefill_tp_size=1, kv_dtype="bfloat16")
    assert incompatibilities(FULL, other_dtype) == [
        "kv_dtype: producer 'float32', consumer 'bfloat16'"
    ]


def test_different_tp_sizes_are_refused_where_parts_cannot_be_made() -> None:
    # Decode not told of prefill's size: it expects its own.
    (problem,) = incompatibilities(FULL, rank(FULL, 2, 0))
    assert problem.startswith("tp_size: producer 1, consumer 2 (decode takes KV")
    (problem,) = incompatibilities(FULL, rank(FULL, 2, 0, prefill_tp_size=4))
    assert problem.startswith("prefill_tp_size: producer 1, consumer 4")
    # Another head size is not a question of heads.
    wider = msgspec.structs.replace(
        rank(FULL, 2, 0, prefill_tp_size=1), chunk_format="blocks:4x1x128x64"
    )
    assert "beyond their heads" in incompatibilities(FULL, wider)[0]
    # Token chunks are not cut by heads yet.
    tokens = msgspec.structs.replace(FULL, chunk_format="tokens:KV_2LTD:4x256", block_size=None)
    decode_tokens = rank(tokens, 2, 0, prefill_tp_size=1, chunk_format="tokens:KV_2LTD:4x128")
    assert "not token chunks" in incompatibilities(tokens, decode_tokens)[0]
    # Heads a size cannot shard evenly, and a pair that shares no head.
    (problem,) = incompatibilities(
        msgspec.structs.replace(FULL, kv_heads=3), rank(FULL, 2, 0, prefill_tp_size=1, kv_heads=3)
    )
    assert problem == "3 KV heads cannot be sharded evenly over 2 tensor-parallel ranks"
    four = msgspec.structs.replace(FULL, kv_heads=4)
    producer = msgspec.structs.replace(
        four, tp_size=2, tp_rank=0, chunk_format="blocks:4x2x128x128"
    )
    consumer = msgspec.structs.replace(
        four, tp_size=4, tp_rank=3, prefill_tp_size=2, chunk_format="blocks:4x1x128x128"
    )
    (problem,) = incompatibilities(producer, consumer)
    assert problem == (
        "tp_rank: producer rank 0 of 2 sends none of consumer rank 3 of 4's KV heads"
    )
    # A side that does not name the model's heads (a standalone peer) cannot be resharded to.
    unknown = msgspec.structs.replace(rank(FULL, 2, 0, prefill_tp_size=1), kv_heads=None)
    assert any(
        "need both to name the model's KV heads" in p for p in incompatibilities(FULL, unknown)
    )


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
            pool.submit(PushJob(request, chunks, contextlib.nullcontext(), time.time()))
            wait_for(lambda r=req_id: consumer.dropped_reason(r) == "incompatible", 5, req_id)
        totals = stats.totals()
        assert totals["handshakes_refused"] == 1  # the second push did not shake hands again
        assert consumer.stats_snapshot()["handshakes_refused"] == 1
        assert totals["push_failures"] == totals["pushes_abandoned"] == 2
        assert totals["pushes"] == 0


def test_an_mla_latent_peer_and_a_per_head_peer_are_refused_naming_both() -> None:
    latent = msgspec.structs.replace(FULL, chunk_format="latent:2x16x576:float32")
    problems = incompatibilities(latent, FULL)
    assert (
        "an MLA model's latent cache (producer) and whole blocks of vLLM's CPU engine "
        in (problems[-1])
    )
    assert incompatibilities(latent, latent) == []


def test_pipeline_parallelism_is_refused_on_either_side_naming_it() -> None:
    for producer_pp, consumer_pp in ((2, 2), (1, 2), (2, 1)):
        producer = msgspec.structs.replace(FULL, pp_size=producer_pp)
        consumer = msgspec.structs.replace(FULL, pp_size=consumer_pp)
        assert incompatibilities(producer, consumer) == [
            f"pp_size: producer {producer_pp}, consumer {consumer_pp} (pipeline parallelism is "
            "not supported: decode recomputes)"
        ]
    one = msgspec.structs.replace(FULL, pp_size=1)
    assert incompatibilities(one, one) == []  # the control


@pytest.mark.processes  # importing vLLM starts one
def test_layers_whose_caches_are_not_moved_are_refused_naming_them() -> None:
    """A model with sliding-window (or Mamba...) layers vLLM keeps as such, on either side:
    refused naming the kind; which kinds a model has comes from vLLM's own cache specs."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    from lmcache_pd.connector.facade import unsupported_layers

    dims = {"block_size": 16, "num_kv_heads": 2, "head_size": 64, "dtype": torch.float32}
    full, window = FullAttentionSpec(**dims), SlidingWindowSpec(**dims, sliding_window=128)
    latent = MLAAttentionSpec(**{**dims, "num_kv_heads": 1, "head_size": 576})

    def groups(*specs: object) -> SimpleNamespace:
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])

    assert unsupported_layers(groups(full)) is None
    assert unsupported_layers(groups(latent)) is None
    assert unsupported_layers(groups(full, window)) == "SlidingWindowSpec"
    windowed = msgspec.structs.replace(FULL, unsupported_layers="SlidingWindowSpec")
    assert incompatibilities(windowed, FULL) == [
        "unsupported_layers: producer 'SlidingWindowSpec', consumer None (only full-attention "
        "and MLA layers' KV is moved: decode recomputes)"
    ]
    assert incompatibilities(FULL, windowed)[0].startswith("unsupported_layers: producer None")


@pytest.mark.processes  # importing vLLM starts one
def test_a_decode_whose_failed_loads_fail_their_requests_is_warned_of(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """vLLM's default ``kv_load_failure_policy`` fails a request whose load failed: said at
    start-up, naming the setting; the control, ``recompute``, says nothing."""
    from lmcache_pd.connector.facade import loads_recompute

    assert loads_recompute("recompute") and not caplog.records
    assert not loads_recompute("fail")
    assert '"kv_load_failure_policy": "recompute"' in caplog.text
