"""Prefill and decode at different tensor-parallel sizes: which prefill rank sends which KV heads
to which decode rank.

vLLM gives tensor-parallel rank ``r`` of ``T`` the KV heads ``[r*H/T, (r+1)*H/T)`` of the
model's ``H`` (or, with fewer heads than ranks, head ``r*H//T``, held by ``T/H`` ranks alike:
``vllm/model_executor/layers/linear.py``, ``QKVParallelLinear``). A prefill rank holds one range
and a decode rank needs another; what one sends the other is a **part**: the heads both hold.
Each decode rank gets each of its heads exactly once, from one prefill rank (of several that
hold it, the one at the decode rank's index among them, so that equal sizes pair rank i with
rank i), so the bytes pushed for a request are its KV's size. An MLA latent cache is one "head"
every rank holds alike (``kv_heads`` 1): one copy per decode rank, from one prefill rank.

A part travels as chunks of its own, named by keys of its own (``part_keyer``): the heads it
holds are part of every key, so a part can stand for no other. Equal sizes keep the keys they
always had (no parts); the two sides agree on this since each knows both sizes (prefill from the
decode ranks a request's spec lists, decode from ``prefill_tp_size``), and the handshake refuses
a pair that does not (``compat.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lmcache_pd.keys import ChunkKeyer


@dataclass(frozen=True, slots=True)
class TPLayout:
    """A worker's place in its instance: the model's KV heads (``kv_heads``; an MLA latent is
    one) and its instance's tensor-parallel size."""

    kv_heads: int
    tp_size: int


@dataclass(frozen=True, slots=True)
class Part:
    """KV heads ``[lo, hi)`` that prefill rank ``source`` sends to decode rank ``dest``."""

    source: int
    dest: int
    lo: int
    hi: int


def rank_heads(kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """The KV heads tensor-parallel ``rank`` of ``tp_size`` holds, as vLLM shards them."""
    if kv_heads >= tp_size:
        width = kv_heads // tp_size
        return rank * width, (rank + 1) * width
    head = rank * kv_heads // tp_size
    return head, head + 1


def check_sizes(kv_heads: int, *tp_sizes: int) -> None:
    """``ValueError`` unless every size shards ``kv_heads`` evenly (vLLM refuses the rest)."""
    for size in tp_sizes:
        if size < 1 or kv_heads < 1 or (kv_heads % size and size % kv_heads):
            raise ValueError(
                f"{kv_heads} KV heads cannot be sharded evenly over {size} tensor-parallel ranks"
            )


@functools.lru_cache(maxsize=64)
def route(kv_heads: int, prefill_tp: int, decode_tp: int) -> tuple[Part, ...]:
    """Every part of a request's KV, decode rank by decode rank, heads in order. ``ValueError``
    for sizes that do not shard ``kv_heads`` evenly."""
    check_sizes(kv_heads, prefill_tp, decode_tp)
    holders: dict[tuple[int, int], list[int]] = {}
    for rank in range(prefill_tp):
        holders.setdefault(rank_heads(kv_heads, prefill_tp, rank), []).append(rank)
    parts = []
    for dest in range(decode_tp):
        want_lo, want_hi = rank_heads(kv_heads, decode_tp, dest)
        for (lo, hi), ranks in sorted(holders.items()):
            if max(lo, want_lo) < min(hi, want_hi):
                source = ranks[dest % len(ranks)]
                parts.append(Part(source, dest, max(lo, want_lo), min(hi, want_hi)))
    return tuple(parts)


def part_keyer(keyer: ChunkKeyer, kv_heads: int, part: Part) -> ChunkKeyer:
    """``keyer`` (a rank's own) for a part's chunks: the same model, dtype and chunk size, with
    the part's heads in place of the rank."""
    params = keyer.params
    return ChunkKeyer(
        model_name=params["model_name"],
        world_size=kv_heads,
        worker_id=part.lo,
        heads=part.hi - part.lo,
        kv_dtype=params["kv_dtype"],
        chunk_size=params["chunk_size"],
    )
