"""Chunk keys: token ids -> ``(start, end, key)`` per chunk, chained so a key names its prefix.

A key is a 16-byte BLAKE2b digest over the previous chunk's key, this chunk's token ids (as
little-endian int64) and, through the seed, everything that makes KV bytes incompatible: model,
world size, worker id, dtype and chunk size. A request's ``cache_salt`` (vLLM's per-request
prefix-cache isolation) starts its chain elsewhere, so every one of its keys differs from another
salt's and from no salt's: requests of different tenants never share a chunk. A request's LoRA
adapter (its name, as every instance of a deployment loads the same adapter under it) starts it
elsewhere again: an adapter's KV is never loaded for another adapter or the base model. A
request's LMCache tags (``lmcache.tag.<name>`` in its ``kv_transfer_params``, tenants' or
namespaces' names) start it elsewhere once more: two requests share a chunk only if they carry
the same tags. A request's multimodal items (images: vLLM's hash of each, at its placeholder
positions) go into the key of every chunk they overlap, so two prompts of the same text and
different images share the chunks before the first image and none from it on. Python's
``hash()`` is salted per process, so it is never used: the same tokens give the same keys in
every process on every machine.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

KEY_BYTES = 16

# A request's multimodal items, sorted by position: (offset, length, identifier) each, the
# placeholder tokens ``offset .. offset + length`` of the prompt that the item's features fill,
# and vLLM's hash of the item (``MultiModalFeatureSpec.identifier``: the model's name, the item's
# bytes and the processor's options, with a LoRA prefix where the vision tower has adapters).
MMItems = tuple[tuple[int, int, str], ...]


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """Tokens ``[start, end)`` of a prompt and the key of the prefix that ends there."""

    start: int
    end: int
    key: bytes


def _as_int64(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(tokens)
    if array.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {array.shape}")
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"tokens must be integers, got dtype {array.dtype}")
    return np.ascontiguousarray(array, dtype="<i8")


class ChunkKeyer:
    """Computes chunk keys for one (model, world size, worker, dtype, chunk size)."""

    def __init__(
        self,
        *,
        model_name: str,
        world_size: int,
        worker_id: int,
        kv_dtype: str,
        chunk_size: int,
        heads: int | None = None,
    ) -> None:
        """``heads``: keys of a part of the KV (prefill and decode at different tensor-parallel
        sizes, ``tp_parts.py``): KV heads ``worker_id .. worker_id + heads`` of ``world_size``
        heads, in place of a rank of ``world_size`` ranks."""
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if not 0 <= worker_id < world_size:
            raise ValueError(f"worker_id {worker_id} outside world_size {world_size}")
        if heads is not None and not 0 < heads <= world_size - worker_id:
            raise ValueError(f"heads {heads} from {worker_id} outside {world_size} heads")
        self.chunk_size = chunk_size
        # What makes this keyer: another process builds the same one with ChunkKeyer(**params).
        self.params = {
            "model_name": model_name,
            "world_size": world_size,
            "worker_id": worker_id,
            "kv_dtype": kv_dtype,
            "chunk_size": chunk_size,
        } | ({} if heads is None else {"heads": heads})
        shard = (
            f"{world_size}|{worker_id}"
            if heads is None
            else f"heads {worker_id}-{worker_id + heads} of {world_size}"
        )
        identity = f"lmcache-pd/v1|{model_name}|{shard}|{kv_dtype}|{chunk_size}"
        self._seed = hashlib.blake2b(identity.encode(), digest_size=KEY_BYTES).digest()

    def chunk_keys(
        self,
        tokens: Sequence[int] | np.ndarray,
        mask: Sequence[bool] | np.ndarray | None = None,
        salt: str | None = None,
        lora: str | None = None,
        tags: Iterable[tuple[str, str]] = (),
        mm: MMItems = (),
    ) -> list[ChunkKey]:
        """Keys of every chunk of ``tokens``; the last chunk may be partial and has its own key.

        ``mask`` (same length as tokens) marks with False a prefix that is already cached and
        needs no key: it must be a run of Falses, of a whole number of chunks, then only Trues.
        ``salt``: the request's ``cache_salt``; None or empty means none (vLLM refuses an empty
        one), and keys are then those of an unsalted request. ``lora``: the request's LoRA
        adapter's name (None: the base model). ``tags``: the request's LMCache tags, (name,
        value) pairs in any order (none: an untagged request's keys). ``mm``: its multimodal
        items (none: a text prompt's keys), each mixed into the key of every chunk it overlaps.
        """
        ids = _as_int64(tokens)
        skip = self._masked_prefix(mask, len(ids))
        keys: list[ChunkKey] = []
        previous = self._chain_start(salt, lora, tags)
        for start in range(0, len(ids), self.chunk_size):
            end = min(start + self.chunk_size, len(ids))
            digest = hashlib.blake2b(_with_mm(previous, mm, start, end), digest_size=KEY_BYTES)
            digest.update(ids[start:end].tobytes())
            previous = digest.digest()
            if start >= skip:
                keys.append(ChunkKey(start, end, previous))
        return keys

    def _chain_start(
        self, salt: str | None, lora: str | None, tags: Iterable[tuple[str, str]]
    ) -> bytes:
        """The seed; with ``salt``, a digest of it keyed by that and personalised, unlike a
        chunk's digest, so that no tokens of an unsalted prompt can stand in for a salt; with
        ``lora``, a digest of the adapter's name keyed by that, personalised otherwise again, so
        that no salt can stand in for an adapter; with ``tags``, a digest of them all
        (``_tag_bytes``) keyed by that, personalised once more. Any string encodes (a lone
        surrogate from a client's JSON included): a salt never fails a request's keys."""
        start = self._seed
        for value, person in ((salt, b"cache_salt"), (lora, b"lora")):
            if value:
                start = hashlib.blake2b(
                    value.encode("utf-8", "surrogatepass"),
                    digest_size=KEY_BYTES,
                    key=start,
                    person=person,
                ).digest()
        tagged = _tag_bytes(tags)
        if tagged:
            start = hashlib.blake2b(
                tagged, digest_size=KEY_BYTES, key=start, person=b"lmcache tags"
            ).digest()
        return start

    def _masked_prefix(self, mask: Sequence[bool] | np.ndarray | None, length: int) -> int:
        """Number of leading tokens the mask excludes, after checking the mask's shape."""
        if mask is None:
            return 0
        flags = np.asarray(mask, dtype=bool)
        if flags.shape != (length,):
            raise ValueError(f"mask has shape {flags.shape}, tokens have length {length}")
        skip = int(np.argmax(flags)) if flags.any() else length
        if flags[skip:].size and not flags[skip:].all():
            raise ValueError("mask must be a run of False followed only by True")
        if skip % self.chunk_size and skip != length:
            raise ValueError(
                f"mask's False prefix ({skip} tokens) is not a multiple of chunk_size "
                f"({self.chunk_size})"
            )
        return skip


def _tag_bytes(tags: Iterable[tuple[str, str]]) -> bytes:
    """Tags as bytes that name them alone: sorted by name (the order a client wrote them in
    does not matter), each name and value length-prefixed (no two sets of tags run together
    into the same bytes)."""
    out = bytearray()
    for name, value in sorted(tags):
        for text in (name, value):
            encoded = text.encode("utf-8", "surrogatepass")
            out += len(encoded).to_bytes(4, "little") + encoded
    return bytes(out)


def _with_mm(previous: bytes, mm: MMItems, start: int, end: int) -> bytes:
    """The chain's link into the chunk of tokens ``start .. end``: ``previous``, or where items
    overlap the chunk, a digest of them keyed by it and personalised unlike a chunk's digest, so
    that no token ids stand in for an item. Each item counts by its identifier (length-
    prefixed), its offset from the chunk's start (negative where it began in an earlier chunk)
    and its length, as vLLM's block hashes take them. An image's placeholder tokens are the same
    for every image: without this, two images' KV would share keys."""
    out = bytearray()
    for offset, length, identifier in mm:
        if offset < end and offset + length > start:
            encoded = identifier.encode("utf-8", "surrogatepass")
            out += len(encoded).to_bytes(4, "little") + encoded
            out += (offset - start).to_bytes(8, "little", signed=True)
            out += length.to_bytes(8, "little")
    if not out:
        return previous
    return hashlib.blake2b(bytes(out), digest_size=KEY_BYTES, key=previous, person=b"mm").digest()


def from_held(keys: Sequence[ChunkKey], held: int) -> list[ChunkKey]:
    """``keys`` with the chunk ``held`` falls inside (not on its start) cut to its tail: tokens
    ``held .. end``, under a key of its own, the chunk's key personalised with ``held``. Decode
    holds the chunk's head in its own prefix cache already, so prefill pushes, and decode loads,
    the tail alone; both sides cut the same chunk from the DisaggSpec's ``decode_holds``. A
    tail's key never names the whole chunk, nor another offset's tail."""
    cut: list[ChunkKey] = []
    for chunk in keys:
        if chunk.start < held < chunk.end:
            key = hashlib.blake2b(
                held.to_bytes(8, "little"),
                digest_size=KEY_BYTES,
                key=chunk.key,
                person=b"chunk tail",
            ).digest()
            chunk = ChunkKey(held, chunk.end, key)
        cut.append(chunk)
    return cut
