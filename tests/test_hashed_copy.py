"""Our XXH3-64 (``kernels/xxh3.h``), alone and taken in the same pass as a block copy, against the
``xxhash`` package as the reference; a flipped bit anywhere in a chunk changes it."""

from __future__ import annotations

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_pd.kernels import CpuKVCache
from lmcache_pd.kernels.integrity import checksum

EXAMPLES = settings(max_examples=40, deadline=None)


def reference(data: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(data.numpy().tobytes())


def random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def paged_layers(num_layers: int, num_blocks: int, block_shape: tuple[int, int, int], seed: int):
    """uint8 layers of shape (num_blocks, *block_shape): any block size in bytes, odd ones too."""
    buffer = random_bytes(num_layers * num_blocks * torch.Size(block_shape).numel(), seed)
    return list(buffer.view(num_layers, num_blocks, *block_shape).unbind(0))


# Every length class of the specification (0, 1-3, 4-8, 9-16, 17-128, 129-240, longer), the
# edges of a 1 KiB accumulator block, and sizes a KV chunk has.
LENGTHS = [*range(0, 260), 511, 512, 1023, 1024, 1025, 2047, 2048, 2049, 4096 + 13]
LENGTHS += [(1 << 17) + 64, 1 << 20]


@pytest.mark.parametrize("offset", [0, 1])  # from an aligned address and from an odd one
def test_checksum_matches_the_reference_xxh3_64_at_every_length_class(offset):
    data = random_bytes(max(LENGTHS) + 1, 7)[offset:]
    mismatched = [n for n in LENGTHS if checksum(data[:n]) != reference(data[:n])]
    assert mismatched == []


@EXAMPLES
@given(
    num_layers=st.integers(1, 3),
    # 30 and 96 bytes are not multiples of a 64-byte stripe: copied, then hashed from cache
    block_shape=st.sampled_from([(1, 3, 10), (2, 3, 16), (2, 32, 32), (1, 64, 64)]),
    data=st.data(),
)
def test_hashed_gather_and_scatter_copy_as_plain_ones_and_return_the_chunks_hash(
    num_layers, block_shape, data
):
    num_blocks = 7
    layers = paged_layers(num_layers, num_blocks, block_shape, 1)
    cache = CpuKVCache(layers)
    count = data.draw(st.integers(1, num_blocks), label="count")
    table = torch.tensor(data.draw(st.permutations(range(num_blocks)), label="order")[:count])
    plain = torch.empty(num_layers * count * cache.block_nbytes, dtype=torch.uint8)
    hashed = torch.empty_like(plain)

    cache.gather(table, plain)
    assert cache.gather(table, hashed, hashed=True) == reference(plain)
    assert torch.equal(hashed, plain)

    target = CpuKVCache(paged_layers(num_layers, num_blocks, block_shape, 2))
    assert target.scatter(hashed, table, hashed=True) == reference(plain)
    again = torch.empty_like(plain)
    target.gather(table, again)
    assert torch.equal(again, plain)


@pytest.mark.parametrize("skip", [1, 3])
def test_scatter_of_a_chunks_tail_writes_only_its_last_blocks_and_hashes_all_of_it(skip):
    layers = paged_layers(2, 8, (2, 32, 32), 3)
    cache = CpuKVCache(layers)
    chunk = torch.empty(2 * 4 * cache.block_nbytes, dtype=torch.uint8)
    cache.gather(torch.tensor([0, 1, 2, 3]), chunk)
    target_layers = [torch.zeros_like(layer) for layer in layers]
    tail = list(range(4 + skip, 8))  # blocks of decode that receive the chunk's last ones

    digest = CpuKVCache(target_layers).scatter(chunk, torch.tensor(tail), hashed=True)

    assert digest == reference(chunk)
    for source, landed in zip(layers, target_layers, strict=True):
        assert torch.equal(landed[tail], source[skip:4])
        assert not landed[: 4 + skip].any()  # nothing else written


def test_a_flipped_bit_anywhere_in_a_chunk_changes_the_hash_its_scatter_returns():
    layers = paged_layers(2, 4, (2, 32, 32), 4)
    cache = CpuKVCache(layers)
    table = torch.tensor([0, 1, 2, 3])
    chunk = torch.empty(2 * 4 * cache.block_nbytes, dtype=torch.uint8)
    sent = cache.gather(table, chunk, hashed=True)
    target = CpuKVCache([torch.zeros_like(layer) for layer in layers])
    assert target.scatter(chunk, table, hashed=True) == sent  # the control: untouched, equal
    n = chunk.numel()
    # first and last bytes, both sides of every block boundary, the last (overlapping) stripe
    places = {0, 1, n - 1, n - 64, n - 65, n // 2}
    places |= {b * cache.block_nbytes + d for b in range(1, 8) for d in (-1, 0)}
    for place in sorted(places):
        for bit in (0, 7):
            damaged = chunk.clone()
            damaged[place] ^= 1 << bit
            assert target.scatter(damaged, table, hashed=True) != sent, (place, bit)


def test_a_chunk_the_wrong_size_is_refused_before_any_copy():
    cache = CpuKVCache(paged_layers(2, 4, (2, 32, 32), 5))
    table = torch.tensor([0, 1])
    longer = torch.zeros(2 * 3 * cache.block_nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bytes"):
        cache.gather(table, longer, hashed=True)  # a gather fills exactly what it is given
    with pytest.raises(ValueError, match="bytes"):
        cache.scatter(longer[: cache.block_nbytes], table, hashed=True)
