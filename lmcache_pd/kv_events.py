"""vLLM's KV events as the proxy reads them, and the prefix keys both ends compute.

Every instance publishes vLLM's own KV events (``--kv-events-config``): a ``BlockStored`` when
blocks of its prefix cache fill, a ``BlockRemoved`` when they are evicted, ``AllBlocksCleared``
when the cache is reset. They arrive as msgpack ``[topic, seq, batch]`` frames over ZMQ, the
batch an array ``[ts, events, data_parallel_rank]`` of tagged maps. The structs here mirror
vLLM's (``vllm/distributed/kv_events.py``) field for field, so that the proxy decodes them
without importing vLLM; fields vLLM adds later are ignored, and anything malformed fails the
typed decoder at the door.

vLLM names a block by its own hash, which the proxy cannot compute without vLLM's hashing
function and seed. So the proxy names blocks by content instead: a ``BlockStored`` carries its
blocks' token ids and its parent's hash, and ``prefix_key`` chains a 16-byte BLAKE2b over the
parent's key, the block's token ids and its extra keys (as vLLM 0.32 publishes them: a LoRA
adapter's name on every block of its requests, then the request's ``cache_salt`` on a prompt's
first block). The proxy computes the same keys from a prompt's token ids
(``prefix_keys``) and looks them up: a match is a block the instance holds.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec

KEY_BYTES = 16
# A BlockStored of more blocks than this, or a block size beyond this, is refused as malformed:
# vLLM stores a step's blocks at once, at most a prompt's (max_model_len / block_size).
MAX_BLOCKS_PER_EVENT = 1 << 16
MAX_BLOCK_SIZE = 1 << 12
# A batch frame larger than this is refused by the socket before it is read (a step's events of
# a long prompt are a few hundred KiB).
MAX_BATCH_BYTES = 64 << 20

# The medium of the events a decode instance publishes for the chunks landed in its consumer
# (``connector/landed_events.py``): blocks of a chunk's tokens, named by the chunk's key.
LANDED_MEDIUM = "LMCACHE_PD_LANDED"

# vLLM's ExternalBlockHash: bytes (sha256 hashing) or int (builtin hashing).
BlockHash = bytes | int


class BlockStored(msgspec.Struct, tag=True, frozen=True):
    block_hashes: Annotated[list[BlockHash], msgspec.Meta(max_length=MAX_BLOCKS_PER_EVENT)]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block: what besides the tokens went into its hash (LoRA name, multimodal
    # identifiers, cache_salt), untagged.
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, frozen=True):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, frozen=True):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, frozen=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


BATCHES = msgspec.msgpack.Decoder(KVEventBatch)


def prefix_key(parent: bytes | None, tokens: Sequence[int], extra: Sequence[Any] | None) -> bytes:
    """The key of a block: its parent's key (None for a prompt's first block), its token ids and
    its extra keys. Equal keys mean equal prefixes up to and including this block."""
    digest = hashlib.blake2b(parent or b"\0" * KEY_BYTES, digest_size=KEY_BYTES)
    digest.update(array("q", tokens).tobytes())
    if extra:
        digest.update(msgspec.msgpack.encode(list(extra)))
    return digest.digest()


def prefix_keys(
    tokens: Sequence[int], block_size: int, salt: str | None = None, lora: str | None = None
) -> list[bytes]:
    """The keys of ``tokens``' full blocks of ``block_size``, as an instance that cached them
    names them (its partial last block is never cached). ``salt``: the request's cache_salt,
    which vLLM mixes into the first block; ``lora``: the LoRA adapter's name, which it mixes
    into every block (and publishes first among a block's extra keys)."""
    keys: list[bytes] = []
    parent = None
    adapter = [lora] if lora is not None else []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = [*adapter, salt] if salt is not None and start == 0 else adapter
        parent = prefix_key(parent, tokens[start : start + block_size], extra)
        keys.append(parent)
    return keys
