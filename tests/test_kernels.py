"""Gather/scatter of paged KV caches: bit-exact round trips, wrong tables caught, bad input refused.

Every comparison is of raw bytes, so bfloat16 NaN payloads must survive too; the references
index the cache one block or one token at a time, independently of the code under test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_pd.kernels import (
    CpuKVCache,
    KVLayout,
    TokenKVCache,
    TritonTokenKV,
    blocks_for_tokens,
    chunk_nbytes,
    gather_blocks,
    gather_tokens,
    gather_tokens_triton,
    scatter_blocks,
    scatter_tokens,
    scatter_tokens_triton,
    token_chunk_nbytes,
    triton_available,
    validate_chunk_size,
)
from lmcache_pd.kernels.token_layout import slot_mapping
from lmcache_pd.kernels.triton_layout import PlanRow, chunk_blocks

BLOCK_SIZES = (32, 64, 128)
DTYPES = (torch.float32, torch.bfloat16)
EXAMPLES = settings(max_examples=25, deadline=None)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of random bytes (NaNs included), so that any byte moved wrong shows."""
    generator = torch.Generator().manual_seed(seed)
    nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).view(shape)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


# CPU: whole blocks -----------------------------------------------------------------------------


def cpu_layers(
    arrangement: str, num_layers: int, num_blocks: int, heads: int, block: int, head: int, dtype
) -> list[torch.Tensor]:
    """Layers of shape (num_blocks, heads, block, 2 * head) laid out in memory as vLLM might."""
    if arrangement == "one_buffer":  # vLLM CPU: every layer a view into one buffer
        buffer = random_bits((num_layers, num_blocks, heads, block, 2 * head), dtype, 1)
        return list(buffer.unbind(0))
    if arrangement == "separate":
        shape = (num_blocks, heads, block, 2 * head)
        return [random_bits(shape, dtype, 2 + i) for i in range(num_layers)]
    if arrangement == "blocks_outermost":  # a block of every layer side by side
        buffer = random_bits((num_blocks, num_layers, heads, block, 2 * head), dtype, 3)
        return list(buffer.unbind(1))
    if arrangement == "kv_split":  # older CPU backend: (2, blocks, heads, block, head) per layer
        buffer = random_bits((num_layers, 2, num_blocks, heads, block, head), dtype, 4)
        return [half for layer in buffer.unbind(0) for half in layer.unbind(0)]
    raise AssertionError(arrangement)


def reference_blocks(layers: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    return torch.cat([as_bytes(layer[block]) for layer in layers for block in block_ids])


def empty_like_layers(layers: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros_like(layer) for layer in layers]


@EXAMPLES
@given(
    arrangement=st.sampled_from(["one_buffer", "separate", "blocks_outermost", "kv_split"]),
    num_layers=st.integers(1, 3),
    heads=st.sampled_from([1, 2, 4]),
    block_size=st.sampled_from(BLOCK_SIZES),
    head_size=st.sampled_from([16, 64]),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_gather_then_scatter_reproduces_the_source_blocks(
    arrangement, num_layers, heads, block_size, head_size, dtype, data
):
    num_blocks = 6
    layers = cpu_layers(arrangement, num_layers, num_blocks, heads, block_size, head_size, dtype)
    num_tokens = data.draw(st.integers(1, 3 * block_size), label="num_tokens")
    count = blocks_for_tokens(num_tokens, block_size)
    block_ids = data.draw(st.permutations(range(num_blocks)), label="order")[:count]
    table = torch.tensor(block_ids, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))

    chunk = torch.empty(chunk_nbytes(layers, num_tokens), dtype=torch.uint8)
    gather_blocks(layers, table, chunk)
    assert torch.equal(chunk, reference_blocks(layers, block_ids))

    target = empty_like_layers(layers)
    scatter_blocks(chunk, target, table)
    for source, landed in zip(layers, target, strict=True):
        for block in range(num_blocks):
            expected = source[block] if block in block_ids else torch.zeros_like(source[block])
            assert torch.equal(as_bytes(landed[block]), as_bytes(expected))


@pytest.mark.parametrize("dtype", DTYPES)
def test_scatter_with_a_permuted_block_table_does_not_reproduce_the_source(dtype):
    layers = cpu_layers("one_buffer", 2, 8, 2, 32, 16, dtype)
    block_ids = [5, 1, 6]
    chunk = torch.empty(chunk_nbytes(layers, 3 * 32), dtype=torch.uint8)
    gather_blocks(layers, torch.tensor(block_ids), chunk)

    def landed_equals_source(table: list[int]) -> bool:
        target = empty_like_layers(layers)
        scatter_blocks(chunk, target, torch.tensor(table))
        return all(
            torch.equal(as_bytes(dst[block]), as_bytes(src[block]))
            for src, dst in zip(layers, target, strict=True)
            for block in block_ids
        )

    assert landed_equals_source(block_ids)  # the control: the right table does
    assert not landed_equals_source([1, 6, 5])


def test_cpu_kv_cache_object_matches_the_free_functions():
    layers = cpu_layers("one_buffer", 3, 5, 2, 64, 16, torch.bfloat16)
    cache = CpuKVCache(layers)
    table = torch.tensor([4, 0])
    assert (cache.num_layers, cache.block_size, cache.num_blocks) == (3, 64, 5)
    once, reused = (torch.empty(cache.chunk_nbytes(100), dtype=torch.uint8) for _ in range(2))
    gather_blocks(layers, table, once)
    cache.gather(table, reused)
    assert torch.equal(once, reused)
    target = empty_like_layers(layers)
    CpuKVCache(target).scatter(reused, table)
    assert torch.equal(reference_blocks(target, [4, 0]), once)


@pytest.mark.parametrize(("num_tokens", "blocks"), [(1, 1), (128, 1), (129, 2), (256, 2), (300, 3)])
def test_chunk_nbytes_counts_whole_blocks_including_a_partial_last_one(num_tokens, blocks):
    layers = cpu_layers("one_buffer", 4, 4, 2, 128, 64, torch.float32)
    block_bytes = 2 * 128 * 2 * 64 * 4
    assert chunk_nbytes(layers, num_tokens) == 4 * blocks * block_bytes


@pytest.mark.parametrize(("chunk_size", "block_size"), [(200, 128), (96, 64), (32, 64), (0, 32)])
def test_chunk_size_that_is_not_whole_blocks_is_refused(chunk_size, block_size):
    with pytest.raises(ValueError, match="block_size"):
        validate_chunk_size(chunk_size, block_size)


@pytest.mark.parametrize(
    ("chunk_size", "block_size", "blocks"), [(256, 128, 2), (256, 32, 8), (128, 128, 1)]
)
def test_chunk_size_of_whole_blocks_gives_the_blocks_per_chunk(chunk_size, block_size, blocks):
    assert validate_chunk_size(chunk_size, block_size) == blocks


BAD_BLOCK_CALLS: dict[str, tuple[Callable[[list[torch.Tensor], torch.Tensor], None], str]] = {
    "out_too_small": (
        lambda layers, out: gather_blocks(layers, torch.tensor([0, 1, 2]), out),
        r"of \d+ bytes",
    ),
    "block_out_of_range": (
        lambda layers, out: gather_blocks(layers, torch.tensor([0, 9]), out),
        "outside",
    ),
    "negative_block_in_scatter": (
        lambda layers, out: scatter_blocks(out, layers, torch.tensor([1, -1])),
        "outside",
    ),
    "float_block_ids": (
        lambda layers, out: gather_blocks(layers, torch.tensor([0.0, 1.0]), out),
        "int32/int64",
    ),
    "no_blocks": (
        lambda layers, out: gather_blocks(layers, torch.tensor([], dtype=torch.int64), out[:0]),
        "empty",
    ),
    "block_twice_in_scatter": (
        lambda layers, out: scatter_blocks(out, layers, torch.tensor([3, 3])),
        "twice",
    ),
    "typed_out": (
        lambda layers, out: gather_blocks(layers, torch.tensor([0, 1]), out.view(torch.float32)),
        "uint8",
    ),
    "token_layout_layer": (
        lambda layers, out: gather_blocks([torch.zeros(2, 4, 32, 2, 16)], torch.tensor([0]), out),
        "num_blocks, num_kv_heads",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BLOCK_CALLS))
def test_bad_block_arguments_are_refused_before_any_copy(case):
    layers = cpu_layers("one_buffer", 2, 4, 2, 32, 16, torch.float32)
    out = torch.zeros(chunk_nbytes(layers, 64), dtype=torch.uint8)
    before = [layer.clone() for layer in layers]
    call, message = BAD_BLOCK_CALLS[case]
    with pytest.raises(ValueError, match=message):
        call(layers, out)
    assert not out.any()
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(before, layers, strict=True))


def test_good_block_arguments_pass_the_same_checks():  # the negative control of the above
    layers = cpu_layers("one_buffer", 2, 4, 2, 32, 16, torch.float32)
    out = torch.zeros(chunk_nbytes(layers, 64), dtype=torch.uint8)
    gather_blocks(layers, torch.tensor([0, 3]), out)
    scatter_blocks(out, layers, torch.tensor([2, 3]))


# GPU layouts: tokens ---------------------------------------------------------------------------


# name -> (layout, how to allocate one layer, how to view it for the kernels)
def vllm_view(layer: torch.Tensor) -> torch.Tensor:
    """vLLM 0.32's per-layer ``(blocks, heads, block size, 2 * head size)`` view as the
    connector reads it (``paged_kv.recognise``): NHD, K and V the halves of each head's run."""
    return layer.unflatten(-1, (2, layer.shape[-1] // 2)).permute(3, 0, 2, 1, 4)


# name -> (layout, physical shape of one layer (or of one block of every layer, for the
# block-outer layouts), the view the kernels are given)
TOKEN_LAYOUTS = {
    "flash_attn_nhd": (KVLayout.NHD, lambda nb, bs, h, d: (2, nb, bs, h, d), lambda x: x),
    "flash_attn_hnd": (KVLayout.HND, lambda nb, bs, h, d: (2, nb, h, bs, d), lambda x: x),
    "flashinfer_nhd": (
        KVLayout.NHD,
        lambda nb, bs, h, d: (nb, 2, bs, h, d),
        lambda x: x.transpose(0, 1),
    ),
    "flashinfer_hnd": (
        KVLayout.HND,
        lambda nb, bs, h, d: (nb, 2, h, bs, d),
        lambda x: x.transpose(0, 1),
    ),
    # vLLM 0.32 (vllm/v1/kv_cache_layout.py): one buffer, each layer a 4-D view whose strides
    # follow the resolved layout. LBNHC: pages [tokens][heads][K|V], layer after layer.
    "vllm_lbnhc": (
        KVLayout.NHD,
        lambda nb, bs, h, d: (nb, bs, h, 2 * d),
        lambda x: vllm_view(x.permute(0, 2, 1, 3)),
    ),
    # LBHNC (FlashInfer on Blackwell, vLLM's NixlConnector): pages [heads][tokens][K|V].
    "vllm_lbhnc": (KVLayout.NHD, lambda nb, bs, h, d: (nb, h, bs, 2 * d), vllm_view),
    # BLNHC: block-outer, one block's pages of every layer together.
    "vllm_blnhc": (
        KVLayout.NHD,
        lambda nb, bs, h, d: (nb, bs, h, 2 * d),
        lambda x: vllm_view(x.permute(0, 2, 1, 3)),
    ),
}
BLOCK_OUTER = {"vllm_blnhc"}


def token_layers(name: str, num_layers: int, num_blocks: int, block: int, heads: int, head, dtype):
    layout, shape, view = TOKEN_LAYOUTS[name]
    page = shape(num_blocks, block, heads, head)
    if name in BLOCK_OUTER:
        buffer = random_bits((page[0], num_layers, *page[1:]), dtype, 7)
        return layout, [view(layer) for layer in buffer.unbind(1)]
    buffer = random_bits((num_layers, *page), dtype, 7)
    return layout, [view(layer) for layer in buffer.unbind(0)]


def reference_tokens(
    layers: list[torch.Tensor], slots: list[int], layout: KVLayout
) -> torch.Tensor:
    """[K/V][layer][token][head][dim] (KV_2LTD), one token at a time."""
    block_size = layers[0].shape[2] if layout is KVLayout.NHD else layers[0].shape[3]

    def token(layer: torch.Tensor, kv: int, slot: int) -> torch.Tensor:
        block, offset = divmod(slot, block_size)
        return layer[kv, block, offset] if layout is KVLayout.NHD else layer[kv, block, :, offset]

    return torch.stack(
        [
            torch.stack([torch.stack([token(layer, kv, s) for s in slots]) for layer in layers])
            for kv in range(2)
        ]
    )


@EXAMPLES
@given(
    name=st.sampled_from(sorted(TOKEN_LAYOUTS)),
    num_layers=st.integers(1, 3),
    block_size=st.sampled_from(BLOCK_SIZES),
    heads=st.sampled_from([1, 2, 4]),
    head_size=st.sampled_from([16, 64]),
    dtype=st.sampled_from(DTYPES),
    data=st.data(),
)
def test_token_gather_then_scatter_reproduces_the_source_tokens(
    name, num_layers, block_size, heads, head_size, dtype, data
):
    num_blocks = 3
    layout, layers = token_layers(name, num_layers, num_blocks, block_size, heads, head_size, dtype)
    num_tokens = data.draw(st.integers(1, 2 * block_size), label="num_tokens")
    order = data.draw(st.randoms(use_true_random=False), label="order")
    slots = order.sample(range(num_blocks * block_size), num_tokens)
    slot_mapping = torch.tensor(slots, dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))

    chunk = torch.empty(token_chunk_nbytes(layers, num_tokens, layout), dtype=torch.uint8)
    gather_tokens(layers, slot_mapping, chunk, layout)
    assert torch.equal(chunk, as_bytes(reference_tokens(layers, slots, layout)))

    _, target = token_layers(name, num_layers, num_blocks, block_size, heads, head_size, dtype)
    for layer in target:
        layer.zero_()
    scatter_tokens(chunk, target, slot_mapping, layout)
    assert torch.equal(as_bytes(reference_tokens(target, slots, layout)), chunk)
    untouched = sorted(set(range(num_blocks * block_size)) - set(slots))
    if untouched:
        assert not as_bytes(reference_tokens(target, untouched, layout)).any()


def request_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The slots of a request's tokens ``start .. end``, its blocks filled in order."""
    return [block_table[t // block_size] * block_size + t % block_size for t in range(start, end)]


@pytest.mark.parametrize("arrangement", ["one_buffer", "separate"])
@pytest.mark.parametrize("name", sorted(TOKEN_LAYOUTS))
@pytest.mark.parametrize(
    ("start", "end", "skip"),
    [(0, 64, 0), (64, 150, 0), (0, 64, 16), (32, 37, 3)],
    ids=["whole_blocks", "partial_last_block", "load_inside_chunk", "few_tokens"],
)
def test_token_copies_of_a_request_match_the_reference(name, arrangement, start, end, skip):
    """Slots as a request has them (runs of a block's tokens: the wide-row path), layers in one
    buffer (one copy for all) or apart (one per layer and K/V), and a scatter that skips the
    chunk's first tokens (decode's own prefix-cache hit ends inside the chunk)."""
    layout, layers = token_layers(name, 3, 16, 16, 4, 32, torch.bfloat16)
    if arrangement == "separate":
        layers = [layer.clone() for layer in layers]
    cache = TokenKVCache(layers, layout)
    table = torch.randperm(16, generator=torch.Generator().manual_seed(5)).tolist()
    slots = request_slots(table, start, end, 16)
    chunk = torch.empty(cache.chunk_nbytes(len(slots)), dtype=torch.uint8)
    cache.gather(torch.tensor(slots), chunk)
    assert torch.equal(chunk, as_bytes(reference_tokens(layers, slots, layout)))

    _, target = token_layers(name, 3, 16, 16, 4, 32, torch.bfloat16)
    target = [layer.zero_() for layer in target]
    if arrangement == "separate":
        target = [layer.clone() for layer in target]
    TokenKVCache(target, layout).scatter(chunk, torch.tensor(slots[skip:]), skip=skip)
    expected = reference_tokens(layers, slots[skip:], layout)
    assert torch.equal(as_bytes(reference_tokens(target, slots[skip:], layout)), as_bytes(expected))
    if skip:
        assert not as_bytes(reference_tokens(target, slots[:skip], layout)).any()


@pytest.mark.parametrize("name", sorted(TOKEN_LAYOUTS))
def test_token_scatter_with_permuted_slots_does_not_reproduce_the_source(name):
    layout, layers = token_layers(name, 2, 2, 32, 2, 16, torch.float32)
    slots = [3, 40, 17, 0]
    chunk = torch.empty(token_chunk_nbytes(layers, len(slots), layout), dtype=torch.uint8)
    gather_tokens(layers, torch.tensor(slots), chunk, layout)

    def landed_equals_source(mapping: list[int]) -> bool:
        _, target = token_layers(name, 2, 2, 32, 2, 16, torch.float32)
        scatter_tokens(chunk, target, torch.tensor(mapping), layout)
        landed, source = (reference_tokens(x, slots, layout) for x in (target, layers))
        return torch.equal(as_bytes(landed), as_bytes(source))

    assert landed_equals_source(slots)  # the control
    assert not landed_equals_source([40, 3, 17, 0])


def test_token_chunk_is_typed_kv_layer_token_head_dim():
    layout, layers = token_layers("flash_attn_hnd", 3, 2, 32, 4, 16, torch.bfloat16)
    typed = torch.empty(2, 3, 5, 4, 16, dtype=torch.bfloat16)
    gather_tokens(layers, torch.tensor([0, 1, 2, 33, 63]), typed, layout)
    # V, layer 2, chunk token 3 (slot 33: block 1, offset 1), head 2
    assert torch.equal(as_bytes(typed[1, 2, 3, 2]), as_bytes(layers[2][1, 1, 2, 1]))


BAD_TOKEN_CALLS = {
    "slot_out_of_range": (
        lambda layers, out: gather_tokens(layers, torch.tensor([0, 64]), out, KVLayout.NHD),
        "outside",
    ),
    "negative_slot": (
        lambda layers, out: gather_tokens(layers, torch.tensor([-1, 2]), out, KVLayout.NHD),
        "outside",
    ),
    "slot_twice_in_scatter": (
        lambda layers, out: scatter_tokens(out, layers, torch.tensor([5, 5]), KVLayout.NHD),
        "twice",
    ),
    "chunk_too_small": (
        lambda layers, out: gather_tokens(layers, torch.tensor([0, 1, 2]), out, KVLayout.NHD),
        "need",
    ),
    "cpu_layout_layer": (
        lambda layers, out: gather_tokens(
            [torch.zeros(4, 2, 32, 32)], torch.tensor([0]), out, KVLayout.NHD
        ),
        "5 dimensions",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_TOKEN_CALLS))
def test_bad_token_arguments_are_refused_before_any_copy(case):
    layout, layers = token_layers("flash_attn_nhd", 2, 2, 32, 2, 16, torch.float32)
    out = torch.zeros(token_chunk_nbytes(layers, 2, layout), dtype=torch.uint8)
    before = [layer.clone() for layer in layers]
    call, message = BAD_TOKEN_CALLS[case]
    with pytest.raises(ValueError, match=message):
        call(layers, out)
    assert not out.any()
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(before, layers, strict=True))


# Triton: only where it can run -----------------------------------------------------------------


def check_triton_against_torch(
    name: str, dtype: torch.dtype, device: str, geometry: tuple[int, int, int, int, int]
) -> None:
    """The Triton path equals the torch path, bit for bit, on one layout: a request's chunk
    from inside one block to inside another (a shuffled block table), gathered; then scattered
    into a zeroed cache whole and from inside the chunk on (a load past decode's own hit), with
    programs of one token and of four, every byte of the cache compared (nothing else
    written). ``geometry``: (layers, blocks, block size, heads, head size)."""
    num_layers, num_blocks, block, heads, head = geometry
    layout, layers = token_layers(name, num_layers, num_blocks, block, heads, head, dtype)
    layers = [layer.to(device) for layer in layers]
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    start, end = 5, 5 + 2 * block + 7
    slots = slot_mapping(table, start, end, block).to(device)
    size = token_chunk_nbytes(layers, end - start, layout)
    expected = torch.empty(size, dtype=torch.uint8, device=device)
    gather_tokens(layers, slots, expected, layout)
    chunk = torch.zeros_like(expected)
    gather_tokens_triton(layers, table, start, end, chunk, layout)
    assert torch.equal(chunk, expected), (name, dtype, "gather")
    _, target = token_layers(name, num_layers, num_blocks, block, heads, head, dtype)
    target = [layer.to(device).zero_() for layer in target]
    scatter_tokens_triton(chunk, target, table, start, end, layout)
    check = torch.empty_like(expected)
    gather_tokens(target, slots, check, layout)
    assert torch.equal(check, expected), (name, dtype, "scatter")
    for skip in (0, 9):
        for tile in (1, 4):
            _, target = token_layers(name, num_layers, num_blocks, block, heads, head, dtype)
            target = [layer.to(device).zero_() for layer in target]
            reference = [layer.clone() for layer in target]
            blocks, first = chunk_blocks(table, start + skip, end, block, num_blocks, unique=True)
            kernel = TritonTokenKV(target, layout)
            on_device = torch.tensor(blocks, device=device)
            kernel.scatter(chunk, on_device, first, end - start - skip, skip=skip, tile=tile)
            TokenKVCache(reference, layout).scatter(chunk, slots[skip:], skip=skip)
            assert any(layer.view(torch.uint8).any() for layer in target), (name, dtype)
            same = zip(target, reference, strict=True)
            assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in same), (
                name,
                dtype,
                skip,
                tile,
                "scatter",
            )
    # a load: three chunks of a request in one launch, from inside the first one on
    _, target = token_layers(name, num_layers, num_blocks, block, heads, head, dtype)
    target = [layer.to(device).zero_() for layer in target]
    reference = [layer.clone() for layer in target]
    kernel, torch_path = TritonTokenKV(target, layout), TokenKVCache(reference, layout)
    load_start, rows, chunks = 7, [], []
    generator = torch.Generator().manual_seed(3)
    for chunk_start, chunk_end in ((0, 20), (20, 45), (45, 50)):
        size = token_chunk_nbytes(target, chunk_end - chunk_start, layout)
        chunk = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
        chunks.append(chunk.to(device))
        begin = max(chunk_start, load_start)
        rows.append(PlanRow(begin // block, begin % block, chunk_end - begin, begin - chunk_start))
        mapping = slot_mapping(table, begin, chunk_end, block).to(device)
        torch_path.scatter(chunks[-1], mapping, skip=begin - chunk_start)
    kernel.run(kernel.plan(chunks, rows), torch.tensor(table, device=device), to_cache=True)
    same = zip(target, reference, strict=True)
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in same), (name, dtype, "load")


# Triton's first compile runs ldconfig (to find libcuda): a process.
@pytest.mark.processes
@pytest.mark.skipif(not triton_available(), reason="needs Triton and a CUDA device")
@pytest.mark.parametrize("name", sorted(TOKEN_LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_triton_path_matches_the_torch_path(name, dtype):
    check_triton_against_torch(name, dtype, "cuda", (3, 8, 64, 8, 128))


INTERPRETER_CHECK = """
import torch
from tests.test_kernels import TOKEN_LAYOUTS, check_triton_against_torch

for name in sorted(TOKEN_LAYOUTS):
    for dtype in (torch.float32, torch.bfloat16):
        check_triton_against_torch(name, dtype, "cpu", (2, 4, 16, 3, 24))
print("interpreter ok")
"""


# Where the Makefile installs Triton for its interpreter, outside .venv (vLLM must not find it).
TRITON_INTERPRETER = Path(__file__).resolve().parents[1] / ".cache" / "triton-interpreter"


@pytest.mark.processes
@pytest.mark.skipif(
    not (TRITON_INTERPRETER / "triton").is_dir(),
    reason=f"Triton's interpreter is not installed in {TRITON_INTERPRETER} (the Makefile does)",
)
def test_triton_kernel_in_the_interpreter_matches_the_torch_path():
    """Runs the real kernel on CPU tensors, every layout, two tile sizes (3 heads of 24: both
    get masked lanes), in a child process because TRITON_INTERPRET is read when Triton compiles
    the kernel."""
    result = subprocess.run(
        [sys.executable, "-c", INTERPRETER_CHECK],
        env={**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(TRITON_INTERPRETER)},
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "interpreter ok" in result.stdout


@pytest.mark.skipif(triton_available(), reason="Triton runs here")
def test_triton_path_without_triton_or_gpu_says_what_is_missing():
    layout, layers = token_layers("flash_attn_nhd", 1, 2, 32, 2, 16, torch.float32)
    out = torch.empty(token_chunk_nbytes(layers, 1, layout), dtype=torch.uint8)
    with pytest.raises((ImportError, ValueError), match=r"Triton|CUDA"):
        gather_tokens_triton(layers, [0], 0, 1, out, layout)
