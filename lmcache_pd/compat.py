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
    # The model's KV heads, all ranks together (an MLA latent counts as one): with it on both
    # sides, prefill and decode may differ in TP size (``tp_parts.py``).
    kv_heads: Positive | None = None
    # Consumer: the TP size of the prefill it takes KV from (None: its own).
    prefill_tp_size: Positive | None = None
    # vLLM's pipeline-parallel size: more than 1 stage is refused (each stage holds only its
    # layers' KV, which no chunk format here describes).
    pp_size: Positive | None = None
    # vLLM's KV cache specs other than full attention and MLA among the model's layers
    # (sliding-window, chunked-local, Mamba...: their caches hold other tokens than a prompt's
    # chunks); any is refused.
    unsupported_layers: Annotated[str, msgspec.Meta(max_length=256)] | None = None


# What each chunk format's kind holds, as a refusal names it.
CHUNK_KINDS = {
    "blocks": "whole blocks of vLLM's CPU engine",
    "tokens": "per-token K and V of a GPU attention backend",
    "latent": "an MLA model's latent cache",
}

# In the order a refusal names them.
FIELDS = KVProfile.__struct_fields__


def incompatibilities(producer: KVProfile, consumer: KVProfile) -> list[str]:
    """Every field both sides know and disagree on, as ``"field: producer X, consumer Y"``;
    empty when the consumer can load what the producer sends. Prefill and decode at different
    TP sizes are compared by what a part of the KV is (``tp_parts.py``), not field by field."""
    unsupported = _unsupported(producer, consumer)
    if _resharded(producer, consumer):
        return unsupported + _part_incompatibilities(producer, consumer)
    problems = unsupported
    for name in FIELDS:
        if name in UNSUPPORTED_FIELDS:
            continue
        ours, theirs = getattr(producer, name), getattr(consumer, name)
        if name == "prefill_tp_size":
            ours = producer.tp_size  # what the producer is, against what decode expects
        if ours is not None and theirs is not None and ours != theirs:
            problems.append(f"{name}: producer {ours!r}, consumer {theirs!r}")
    kinds = _kind(producer.chunk_format), _kind(consumer.chunk_format)
    if None not in kinds and kinds[0] != kinds[1]:
        # Not a setting to align: the two caches hold different things.
        ours, theirs = (CHUNK_KINDS.get(kind or "", repr(kind)) for kind in kinds)
        problems.append(f"{ours} (producer) and {theirs} (consumer) cannot be converted")
    if (
        producer.tp_size is not None
        and consumer.tp_size is not None
        and producer.tp_size != consumer.tp_size
    ):
        # Without the heads on both sides the parts cannot be worked out (a standalone peer).
        problems.append(
            "prefill and decode at different tensor-parallel sizes need both to name the "
            "model's KV heads (the vLLM connector does)"
        )
    return problems


# Fields that name a feature not supported (refused as such, not compared).
UNSUPPORTED_FIELDS = frozenset({"pp_size", "unsupported_layers"})


def _unsupported(producer: KVProfile, consumer: KVProfile) -> list[str]:
    """Refusals naming pipeline parallelism, or layers whose caches are not moved, on either
    side."""
    problems = []
    sizes = producer.pp_size or 1, consumer.pp_size or 1
    if max(sizes) > 1:
        problems.append(
            f"pp_size: producer {sizes[0]}, consumer {sizes[1]} (pipeline parallelism is not "
            "supported: decode recomputes)"
        )
    layers = producer.unsupported_layers, consumer.unsupported_layers
    if any(layers):
        problems.append(
            f"unsupported_layers: producer {layers[0]!r}, consumer {layers[1]!r} (only "
            "full-attention and MLA layers' KV is moved: decode recomputes)"
        )
    return problems


def _resharded(producer: KVProfile, consumer: KVProfile) -> bool:
    """Whether both sides know enough, and differ in TP size, for parts to be compared."""
    known = (
        producer.kv_heads,
        consumer.kv_heads,
        producer.tp_size,
        consumer.tp_size,
        producer.tp_rank,
        consumer.tp_rank,
    )
    return None not in known and producer.tp_size != consumer.tp_size


# Fields of a part that differ by design between TP sizes; the rest must still agree.
RESHARDED = frozenset({"page_bytes", "chunk_format", "tp_size", "tp_rank", "prefill_tp_size"})


def _part_incompatibilities(producer: KVProfile, consumer: KVProfile) -> list[str]:
    """Prefill and decode at different TP sizes: what must agree still does, the chunk formats
    differ only in their heads, both shard the model's heads evenly, decode expects this
    prefill's TP size, and the producer rank holds some of the consumer rank's heads."""
    from lmcache_pd.tp_parts import route  # keys.py imports numpy; not every caller needs it

    problems = [
        f"{name}: producer {ours!r}, consumer {theirs!r}"
        for name in FIELDS
        if name not in RESHARDED | UNSUPPORTED_FIELDS
        and (ours := getattr(producer, name)) is not None
        and (theirs := getattr(consumer, name)) is not None
        and ours != theirs
    ]
    heads, sizes = producer.kv_heads, (producer.tp_size, consumer.tp_size)
    if heads is None or sizes[0] is None or sizes[1] is None:  # never: _resharded saw them
        return problems
    if consumer.prefill_tp_size is None:
        problems.append(
            f"tp_size: producer {producer.tp_size!r}, consumer {consumer.tp_size!r} (decode "
            "takes KV from prefill at its own TP size unless its prefill_tp_size says another)"
        )
    elif consumer.prefill_tp_size != producer.tp_size:
        problems.append(
            f"prefill_tp_size: producer {producer.tp_size!r}, consumer "
            f"{consumer.prefill_tp_size!r} (the TP size of the prefill decode takes KV from)"
        )
    kinds = _kind(producer.chunk_format), _kind(consumer.chunk_format)
    if "tokens" in kinds:
        problems.append(
            "different tensor-parallel sizes need whole-block (vLLM's CPU engine) or MLA "
            "latent chunks, not token chunks"
        )
    elif _headless(producer.chunk_format) != _headless(consumer.chunk_format):
        problems.append(
            f"chunk_format: producer {producer.chunk_format!r}, consumer "
            f"{consumer.chunk_format!r} (beyond their heads)"
        )
    try:
        parts = route(heads, *sizes)
    except ValueError as exc:
        return [*problems, str(exc)]
    if not any(p.source == producer.tp_rank and p.dest == consumer.tp_rank for p in parts):
        problems.append(
            f"tp_rank: producer rank {producer.tp_rank} of {producer.tp_size} sends none of "
            f"consumer rank {consumer.tp_rank} of {consumer.tp_size}'s KV heads"
        )
    return problems


def _headless(chunk_format: str | None) -> str | None:
    """A whole-block chunk format without its heads ("blocks:4x*x128x128:float32"); others
    as they are."""
    if chunk_format is None or _kind(chunk_format) != "blocks":
        return chunk_format
    fields = chunk_format.split(":")  # a peer's: any string at all
    dims = fields[1].split("x") if len(fields) > 1 else []
    if len(dims) < 2:
        return chunk_format
    fields[1] = "x".join([dims[0], "*", *dims[2:]])
    return ":".join(fields)


def _kind(chunk_format: str | None) -> str | None:
    """ "blocks" or "tokens" (the part before the first colon); None when not known."""
    return None if chunk_format is None else chunk_format.split(":", 1)[0]
