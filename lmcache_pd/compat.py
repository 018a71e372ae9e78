"""What makes a producer's KV bytes usable by a consumer: compared field by field at handshake.

Keys already differ where KV bytes would (``keys.py``), but a key mismatch shows only as chunks
that never match: decode waits its whole load deadline, then recomputes, and nobody learns why.
Comparing the profiles once, at handshake, turns that into one clear refusal naming the field
and both values, and every request of that pair is recomputed at once.

The vLLM connector knows every field; a standalone producer or consumer (config only) leaves
what it does not know as None, and a field is compared only where both sides know it. What is
compared is the chunk's format, never the engine's cache layout: two GPU engines whose caches
are laid out differently (NHD, HND) exchange the same token chunks.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Name = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Positive = Annotated[int, msgspec.Meta(ge=1, lt=1 << 32)]
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]


class KVProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank's KV format and place in its parallel layout; None: not known here."""

    chunk_size: Positive
    page_bytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 31)]
    # The model as vLLM was given it: the same string the chunk keys are seeded with.
    model: Name | None = None
    kv_dtype: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None
    # What a chunk's bytes are (``connector/paged_kv.py`` writes it), not how either engine
    # lays out its cache: "blocks:4x2x128x128:float32" (vLLM's CPU engine: whole blocks as
    # opaque bytes, layers x KV heads x block size x 2*head size, so both caches must be
    # alike) or "tokens:KV_2LTD:32x1024:bfloat16" (GPU backends: K/V, layers, tokens, KV heads
    # x head size, the same whatever the layout, so an NHD producer feeds an HND consumer).
    chunk_format: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    # Compared only where chunks are whole blocks: a token chunk does not depend on it.
    block_size: Positive | None = None
    tp_size: Positive | None = None
    tp_rank: Rank | None = None


# In the order a refusal names them.
FIELDS = KVProfile.__struct_fields__


def incompatibilities(producer: KVProfile, consumer: KVProfile) -> list[str]:
    """Every field both sides know and disagree on, as ``"field: producer X, consumer Y"``;
    empty when the consumer can load what the producer sends."""
    problems = []
    for name in FIELDS:
        ours, theirs = getattr(producer, name), getattr(consumer, name)
        if ours is not None and theirs is not None and ours != theirs:
            problems.append(f"{name}: producer {ours!r}, consumer {theirs!r}")
    kinds = {_kind(producer.chunk_format), _kind(consumer.chunk_format)}
    if kinds == {"blocks", "tokens"}:
        # Not a setting to align: one engine's cache is opaque blocks, the other's tokens.
        problems.append(
            "a whole-block chunk (vLLM's CPU engine) and a token chunk (a GPU attention "
            "backend) cannot be converted into each other"
        )
    if (
        producer.tp_size is not None
        and consumer.tp_size is not None
        and producer.tp_size != consumer.tp_size
    ):
        # Rank i pushes its shard to rank i: resharding between sizes is not done.
        problems.append("prefill and decode need the same tensor-parallel size")
    return problems


def _kind(chunk_format: str | None) -> str | None:
    """ "blocks" or "tokens" (the part before the first colon); None when not known."""
    return None if chunk_format is None else chunk_format.split(":", 1)[0]
