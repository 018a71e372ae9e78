"""Prefill and decode at different tensor-parallel sizes: the parts of a request's KV (which
prefill rank sends which heads to which decode rank), their keys, head slices of vLLM's CPU
cache, and both directions over real NIXL between worker halves (fan-out TP 1 -> 2, fan-in
TP 2 -> 1), bit-exact, each head pushed once; a part that never comes fails the load (decode
recomputes), and a part sent to the wrong rank is never loaded there."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from lmcache_pd.compat import KVProfile
from lmcache_pd.config import load_config
from lmcache_pd.connector.consumer_worker import ConsumerWorker
from lmcache_pd.connector.counters import StatsRecorder
from lmcache_pd.connector.metadata import LoadRequest, PDConnectorMetadata, SaveRequest
from lmcache_pd.connector.receive_pages import receive_config
from lmcache_pd.connector.worker import CacheFacts, ProducerWorker
from lmcache_pd.errors import ConfigError
from lmcache_pd.kernels.paged_kv import BlockKV, head_slice, recognise
from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.tp_parts import Part, TPLayout, part_keyer, rank_heads, route
from tests.helpers import free_port, make_keyer

BLOCK = 32
CHUNK = 64
HEADS = 2
HEAD = 16
LAYERS = 4
NUM_BLOCKS = 16


# ---- the parts: no processes ----


@pytest.mark.parametrize(
    ("kv_heads", "prefill", "decode"),
    [(8, 1, 4), (8, 4, 1), (8, 2, 8), (8, 8, 2), (2, 1, 4), (2, 4, 1), (1, 2, 4), (4, 4, 4)],
)
def test_every_decode_head_comes_once_from_a_prefill_rank_that_holds_it(
    kv_heads: int, prefill: int, decode: int
) -> None:
    parts = route(kv_heads, prefill, decode)
    for dest in range(decode):
        lo, hi = rank_heads(kv_heads, decode, dest)
        mine = [p for p in parts if p.dest == dest]
        # Its heads, each once, in order.
        assert [h for p in mine for h in range(p.lo, p.hi)] == list(range(lo, hi))
        for part in mine:
            held_lo, held_hi = rank_heads(kv_heads, prefill, part.source)
            assert held_lo <= part.lo < part.hi <= held_hi
    # Bytes pushed in all: every decode rank's share, no more (replicated heads included).
    assert sum(p.hi - p.lo for p in parts) == sum(
        hi - lo for lo, hi in (rank_heads(kv_heads, decode, d) for d in range(decode))
    )
    if prefill == decode:  # equal sizes: rank i to rank i, whole
        assert all(p.source == p.dest for p in parts)


def test_replicated_heads_and_the_mla_latent_are_sent_by_one_rank_each() -> None:
    """An MLA latent (one "head" every rank holds): each decode rank gets one copy, from the
    prefill rank of its index among the holders."""
    assert route(1, 2, 1) == (Part(0, 0, 0, 1),)  # fan-in: rank 1 sends nothing
    assert route(1, 1, 2) == (Part(0, 0, 0, 1), Part(0, 1, 0, 1))
    assert route(2, 4, 2) == (Part(0, 0, 0, 1), Part(3, 1, 1, 2))
    assert rank_heads(2, 4, 3) == (1, 2)  # vLLM: rank r holds head r * H // T


def test_sizes_that_cannot_shard_the_heads_are_refused() -> None:
    with pytest.raises(ValueError, match="3 KV heads cannot be sharded evenly over 2"):
        route(3, 1, 2)


def test_a_parts_keys_name_its_heads_and_differ_from_every_ranks_own() -> None:
    own = make_keyer(model_name="m", world_size=1, worker_id=0, chunk_size=CHUNK)
    tokens = list(range(200))
    first, second = (part_keyer(own, 2, Part(0, d, d, d + 1)) for d in (0, 1))
    keys = {
        name: [k.key for k in keyer.chunk_keys(tokens)]
        for name, keyer in {"own": own, "first": first, "second": second}.items()
    }
    assert len({tuple(k) for k in keys.values()}) == 3
    rank_of_two = make_keyer(model_name="m", world_size=2, worker_id=0, chunk_size=CHUNK)
    assert keys["first"] != [k.key for k in rank_of_two.chunk_keys(tokens)]
    # Another process builds the same keyer from its params.
    again = type(first)(**first.params)
    assert [k.key for k in again.chunk_keys(tokens)] == keys["first"]


@pytest.mark.parametrize(
    ("kv_heads", "prefill", "decode", "pages", "page_heads"),
    [
        (2, 1, 1, [16], [2]),  # equal sizes: a page a chunk, as always
        (2, 2, 1, [32], [1]),  # fan-in 2: two pages of half a chunk, in the same bytes
        (6, 2, 3, [16, 32, 16], [2, 1, 2]),  # rank 1 takes 2 parts of one head, the others 1
        (12, 3, 2, [32, 32], [4, 4]),  # parts of 4 and 2 heads: pages of 4, more bytes
    ],
)
def test_a_fan_in_ranks_buffer_holds_the_chunks_its_size_says_in_pages_of_a_part(
    kv_heads: int, prefill: int, decode: int, pages: list[int], page_heads: list[int]
) -> None:
    head_bytes = 1024  # a chunk's bytes of one head
    asked = 16 * kv_heads // decode * head_bytes  # 16 chunks of a decode rank's heads
    config = load_config(
        None, environ={}, kv_role="kv_consumer", buffer_size_bytes=asked, page_bytes=head_bytes
    )
    for rank in range(decode):
        parts = [p for p in route(kv_heads, prefill, decode) if p.dest == rank]
        got = receive_config(config, [(p.hi - p.lo) * head_bytes for p in parts], rank)
        assert (got.num_pages, got.page_bytes) == (pages[rank], page_heads[rank] * head_bytes)
        assert got.num_pages // len(parts) == 16  # whole chunks
        # The bytes asked, but where a rank's parts differ in size (12 heads, 3 -> 2: 4 + 2).
        assert (got.buffer_size_bytes > asked) == (kv_heads == 12)
    with pytest.raises(ConfigError, match="holds no chunk of this rank's cache"):
        receive_config(config, [asked, asked], 0)


def full_cache(seed: int | None) -> list[torch.Tensor]:
    """Four layers (blocks, 2 KV heads, block, 2 * head) of vLLM's CPU cache, all heads."""
    buffer = torch.zeros(LAYERS, NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD)
    if seed is not None:
        buffer.normal_(generator=torch.Generator().manual_seed(seed))
    return list(buffer.unbind(0))


def as_layers(tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"layer.{i}": tensor for i, tensor in enumerate(tensors)}


def test_a_head_slice_gathers_and_scatters_only_its_heads() -> None:
    source, target = full_cache(1), full_cache(None)
    blocks = [3, 9, 1]
    for head in range(HEADS):
        cut = head_slice(recognise(as_layers(source), CHUNK), head, head + 1)
        out = torch.empty(cut.chunk_nbytes(CHUNK * 3 // 2), dtype=torch.uint8)
        cut.gather(blocks, 0, 96, out)
        assert len(out) == LAYERS * 3 * BLOCK * 2 * HEAD * 4  # one head's bytes
        into = head_slice(recognise(as_layers(target), CHUNK), head, head + 1)
        into.scatter(out, blocks, 0, 96, 0)
        for src, dst in zip(source, target, strict=True):
            assert torch.equal(dst[blocks, head], src[blocks, head])
    whole = recognise(as_layers(source), CHUNK)
    assert isinstance(whole, BlockKV) and head_slice(whole, 0, HEADS) is whole
    with pytest.raises(ValueError, match=r"heads 1\.\.3"):
        head_slice(whole, 1, 3)


# ---- the workers over real NIXL ----


@dataclass
class Side:
    """One instance's ranks: a worker half and its cache per rank."""

    workers: list
    caches: list[list[torch.Tensor]]
    stats: list[StatsRecorder]


@dataclass
class Pair:
    prefill: Side
    decode: Side
    spec: DisaggSpec
    source: list[torch.Tensor]  # all heads, as prefill computed them


def shard(cache: list[torch.Tensor], tp_size: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s own cache: its heads of ``cache``, a tensor of its own."""
    lo, hi = rank_heads(HEADS, tp_size, rank)
    return [layer[:, lo:hi].clone() for layer in cache]


def profile(tp_size: int, rank: int, prefill_tp_size: int | None = None) -> KVProfile:
    return KVProfile(
        chunk_size=CHUNK,
        page_bytes=1,
        tp_size=tp_size,
        tp_rank=rank,
        kv_heads=HEADS,
        prefill_tp_size=prefill_tp_size,
    )


@pytest.fixture
def resharded(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A prefill of ``request.param[0]`` ranks and a decode of ``request.param[1]``, each
    decode rank's receive buffer the bytes of PROMPT's chunks (of its heads) and no more, no
    page reserved ahead (up to 1/8 of them, at any TP size): at fan-in too the buffer takes
    the chunks its size says, however many parts each comes in."""
    prefill_tp, decode_tp = request.param
    init, alloc = [free_port() for _ in range(decode_tp)], [free_port() for _ in range(decode_tp)]
    common = {"chunk_size": CHUNK, "load_timeout_s": 3.0}
    buffer = -(-len(PROMPT) // CHUNK) * kv_bytes(CHUNK // BLOCK, HEADS // decode_tp)
    consumer_config = load_config(
        None,
        environ={},
        kv_role="kv_consumer",
        init_port=init,
        alloc_port=alloc,
        prefill_tp_size=prefill_tp,
        buffer_size_bytes=buffer,
        page_bytes=buffer,  # the worker sets its own
        **common,
    )
    producer_config = load_config(
        None,
        environ={},
        kv_role="kv_producer",
        buffer_size_bytes=16 << 20,
        reserved_pages=0,
        **common,
    )
    source = full_cache(7)
    prefill, decode = Side([], [], []), Side([], [], [])
    try:
        for rank in range(decode_tp):
            cache, stats = shard(full_cache(None), decode_tp, rank), StatsRecorder(f"c{rank}")
            decode.workers.append(
                ConsumerWorker(
                    consumer_config.for_rank(rank),
                    make_keyer(
                        model_name="m", world_size=decode_tp, worker_id=rank, chunk_size=CHUNK
                    ),
                    as_layers(cache),
                    stats,
                    profile(decode_tp, rank, prefill_tp_size=prefill_tp),
                    rank,
                    layout=TPLayout(HEADS, decode_tp),
                )
            )
            decode.caches.append(cache)
            decode.stats.append(stats)
        for rank in range(prefill_tp):
            cache, stats = shard(source, prefill_tp, rank), StatsRecorder(f"p{rank}")
            prefill.workers.append(
                ProducerWorker(
                    producer_config.for_rank(rank),
                    make_keyer(
                        model_name="m", world_size=prefill_tp, worker_id=rank, chunk_size=CHUNK
                    ),
                    as_layers(cache),
                    stats,
                    profile(prefill_tp, rank),
                    rank,
                    layout=TPLayout(HEADS, prefill_tp),
                )
            )
            prefill.caches.append(cache)
            prefill.stats.append(stats)
        yield Pair(prefill, decode, DisaggSpec("d-1", "127.0.0.1", init, alloc), source)
    finally:
        for worker in (*prefill.workers, *decode.workers):
            worker.close()


PROMPT, BLOCKS = list(range(500, 700)), [3, 9, 1, 12, 5, 14, 0]  # 3 chunks and a part


def push(pair: Pair, spec: DisaggSpec, ranks: list[int] | None = None) -> None:
    """Prefill ranks ``ranks`` (all: None) save the prompt."""
    for rank, worker in enumerate(pair.prefill.workers):
        if ranks is None or rank in ranks:
            save = SaveRequest("p", spec, PROMPT, BLOCKS, len(PROMPT))
            worker.wait_for_save(PDConnectorMetadata(saves=[save]))


def load(pair: Pair, deadline_s: float = 10.0) -> list[tuple[set[str], set[str]]]:
    """Every decode rank loads the prompt; each rank's (received, failed) once all reported."""
    for worker in pair.decode.workers:
        request = LoadRequest("c", pair.spec.req_id, PROMPT, BLOCKS, 0)
        worker.start_load_kv(PDConnectorMetadata(loads=[request]))
    results: list[tuple[set[str], set[str]] | None] = [None] * len(pair.decode.workers)
    deadline = time.monotonic() + deadline_s
    while None in results and time.monotonic() < deadline:
        for index, worker in enumerate(pair.decode.workers):
            if results[index] is None:
                received, failed = worker.finished_loads()
                if received:
                    results[index] = (received, failed)
        time.sleep(0.01)
    assert None not in results, f"not every rank reported: {results}"
    return results  # type: ignore[return-value]


def kv_bytes(tokens_blocks: int, heads: int) -> int:
    return LAYERS * tokens_blocks * heads * BLOCK * 2 * HEAD * 4


@pytest.mark.processes
@pytest.mark.parametrize("resharded", [(1, 2), (2, 1)], indirect=True, ids=["fan-out", "fan-in"])
def test_each_decode_rank_loads_its_heads_from_the_prefill_ranks_that_hold_them(
    resharded: Pair,
) -> None:
    pair = resharded
    push(pair, pair.spec)
    decode_tp = len(pair.decode.workers)
    assert load(pair) == [({"c"}, set())] * decode_tp
    for rank, cache in enumerate(pair.decode.caches):
        lo, hi = rank_heads(HEADS, decode_tp, rank)
        for got, want in zip(cache, pair.source, strict=True):
            assert torch.equal(got[BLOCKS], want[BLOCKS, lo:hi])
        totals = pair.decode.stats[rank].totals()
        assert totals["tokens_loaded"] == len(PROMPT)
        assert totals.get("consumer_refused_buffer_full", 0) == 0, totals
    # Every head once: the bytes pushed are the KV's size (7 blocks, all heads).
    pushed = sum(stats.totals()["bytes_pushed"] for stats in pair.prefill.stats)
    assert pushed == kv_bytes(len(BLOCKS), HEADS)
    assert not any(s.totals().get("handshakes_refused", 0) for s in pair.prefill.stats)


@pytest.mark.processes
@pytest.mark.parametrize("resharded", [(2, 1)], indirect=True, ids=["fan-in"])
def test_a_part_that_never_comes_fails_the_load_at_its_deadline(resharded: Pair) -> None:
    """Prefill rank 1 never pushes: decode has half of each chunk, loads nothing (its heads
    would be half wrong) and fails at its deadline, so vLLM recomputes the prompt."""
    pair = resharded
    push(pair, pair.spec, ranks=[0])
    assert load(pair) == [({"c"}, {"c"})]
    stats = pair.decode.stats[0].totals()
    assert stats["load_timeouts"] == 1 and stats.get("tokens_loaded", 0) == 0
    assert not pair.decode.caches[0][0].any()  # nothing scattered


@pytest.mark.processes
@pytest.mark.parametrize("resharded", [(1, 2)], indirect=True, ids=["fan-out"])
def test_a_part_sent_to_the_wrong_rank_is_never_loaded_there(resharded: Pair) -> None:
    """The decode ranks' ports swapped in the spec: prefill sends each rank the other's heads.
    The handshakes pass (prefill rank 0 does send to both), but a part's keys name its heads,
    so neither rank finds its own: both fail at their deadline and recompute, nothing
    scattered (a wrong head never reaches the cache)."""
    pair = resharded
    init, alloc = list(pair.spec.receiver_init_port), list(pair.spec.receiver_alloc_port)
    push(pair, DisaggSpec("d-1", "127.0.0.1", init[::-1], alloc[::-1]))
    assert load(pair) == [({"c"}, {"c"})] * 2
    for rank, cache in enumerate(pair.decode.caches):
        assert pair.decode.stats[rank].totals()["load_timeouts"] == 1
        assert not cache[0].any()


@pytest.mark.processes
def test_a_cache_that_cannot_be_cut_by_heads_abandons_every_decode_rank_at_once() -> None:
    """A token-layout prefill (a GPU backend's cache, here on CPU) given a decode of two ranks:
    it cannot send each rank its heads, so it tells both at once that the KV will not come;
    they recompute within moments, not at their load deadline, and nothing is written."""
    init, alloc = [free_port(), free_port()], [free_port(), free_port()]
    common = {"chunk_size": CHUNK, "buffer_size_bytes": 16 << 20, "load_timeout_s": 30.0}
    consumer_config = load_config(
        None, environ={}, kv_role="kv_consumer", init_port=init, alloc_port=alloc, **common
    )
    facts = CacheFacts(block_size=BLOCK, physical_order="NHD", packed_blocks=False)
    tokens = [torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, HEAD) for _ in range(LAYERS)]
    workers: list = []
    try:
        for rank in range(2):
            own = [layer[:, :, :, rank : rank + 1].clone().zero_() for layer in tokens]
            keyer = make_keyer(model_name="m", world_size=2, worker_id=rank, chunk_size=CHUNK)
            workers.append(
                ConsumerWorker(
                    consumer_config.for_rank(rank),
                    keyer,
                    as_layers(own),
                    StatsRecorder(f"c{rank}"),
                    rank=rank,
                    facts=facts,
                    layout=TPLayout(HEADS, 2),
                )
            )
        stats = StatsRecorder("p")
        producer = ProducerWorker(
            load_config(None, environ={}, kv_role="kv_producer", **common),
            make_keyer(model_name="m", chunk_size=CHUNK),
            as_layers(tokens),
            stats,
            facts=facts,
            layout=TPLayout(HEADS, 1),
        )
        workers.append(producer)
        spec = DisaggSpec("d-1", "127.0.0.1", init, alloc)
        started = time.monotonic()
        save = SaveRequest("p", spec, PROMPT, BLOCKS, len(PROMPT))
        producer.wait_for_save(PDConnectorMetadata(saves=[save]))
        assert (
            load(Pair(Side([], [], []), Side(workers[:2], [], []), spec, []))
            == [({"c"}, {"c"})] * 2
        )
        assert time.monotonic() - started < 10.0  # told, not timed out at 30 s
        assert stats.totals()["pushes_without_rank"] == 1
        for worker in workers[:2]:
            assert worker._stats.totals()["loads_abandoned"] == 1
    finally:
        for worker in workers:
            worker.close()
