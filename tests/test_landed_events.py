"""Decode's landed chunks published as KV events (``connector/landed_events.py``) and read by the
proxy's index (``proxy/prefix_index.py``): the keys the consumer posts, the events the scheduler
makes of them, their bytes as vLLM's publisher encodes them, and the proxy's lookup of a prompt
against them. Fast lane: no process is started."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
)

from lmcache_pd.connector.landed_chunks import LandedChunks
from lmcache_pd.connector.landed_events import LandedEvents
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.kv_events import BATCHES, LANDED_MEDIUM, prefix_keys
from lmcache_pd.proxy.prefix_index import InstanceCaches
from lmcache_pd.transfer.landed_keys import KeysWriter

CHUNK = 16
PROMPT = list(range(1000, 1000 + 3 * CHUNK + 5))  # three full chunks and a partial one


@pytest.fixture
def keyer() -> ChunkKeyer:
    return ChunkKeyer(
        model_name="m", world_size=1, worker_id=0, kv_dtype="float32", chunk_size=CHUNK
    )


@pytest.fixture
def board(tmp_path: Path) -> Iterator[KeysWriter]:
    writer = KeysWriter(tmp_path / "keys", max_keys=64)
    yield writer
    writer.close()


@pytest.fixture
def landed(keyer: ChunkKeyer, tmp_path: Path, board: KeysWriter) -> Iterator[LandedEvents]:
    chunks = LandedChunks([keyer], [tmp_path / "keys"])
    yield LandedEvents(chunks, max_chunks=64)
    chunks.close()


def over_the_wire(events: list[KVCacheEvent]) -> InstanceCaches:
    """The events as vLLM's publisher encodes a batch, decoded and applied by the proxy."""
    caches = InstanceCaches(max_blocks=100)
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=events))
    for event in BATCHES.decode(payload).events:
        caches.apply(event)
    return caches


def test_landed_chunks_are_published_parents_first_and_the_proxy_finds_the_prompt(
    keyer: ChunkKeyer, board: KeysWriter, landed: LandedEvents
) -> None:
    chunks = keyer.chunk_keys(PROMPT)
    board.post([chunk.key for chunk in chunks])
    assert landed.take() == []  # landed, but no load said what the keys stand for yet
    landed.learn(PROMPT, None)
    events = landed.take()
    # The partial last chunk is not published; the full ones are, parents first, each under
    # the key the proxy gives it.
    assert [event.block_hashes for event in events] == [[k] for k in prefix_keys(PROMPT, CHUNK)]
    assert all(isinstance(e, BlockStored) and e.medium == LANDED_MEDIUM for e in events)
    caches = over_the_wire(events)
    assert len(caches.prefix) == 0  # vLLM's prefix cache is not told of them
    found = caches.landed.held_tokens(prefix_keys(PROMPT, CHUNK))
    assert found == 3 * CHUNK
    # Negative control: a prompt that differs in its second chunk is found for one chunk only.
    other = PROMPT[:CHUNK] + [7] * (len(PROMPT) - CHUNK)
    assert caches.landed.held_tokens(prefix_keys(other, CHUNK)) == CHUNK
    assert landed.take() == []  # nothing changed since


def test_chunks_after_a_prefix_that_never_landed_are_found_past_it(
    keyer: ChunkKeyer, board: KeysWriter, landed: LandedEvents
) -> None:
    """A push skipped the first chunk (decode's prefix cache held it): the two after it landed
    alone, and the proxy finds them past that prefix, not from the prompt's start."""
    chunks = keyer.chunk_keys(PROMPT)
    landed.learn(PROMPT, None)
    board.post([chunks[1].key, chunks[2].key])
    caches = over_the_wire(landed.take())
    keys = prefix_keys(PROMPT, CHUNK)
    assert caches.landed.held_tokens(keys) == 0  # not a prefix on their own
    assert caches.landed.held_after(keys, CHUNK) == 3 * CHUNK
    assert caches.landed.held_after(keys, CHUNK + 5) == 3 * CHUNK  # from the chunk holding it
    # Controls: a prefix cache ending before them reaches none; a prompt whose first chunk
    # differs has other keys for the same tokens after it.
    assert caches.landed.held_after(keys, CHUNK - 1) == CHUNK - 1
    other = [7] * CHUNK + PROMPT[CHUNK:]
    assert caches.landed.held_after(prefix_keys(other, CHUNK), CHUNK) == CHUNK


def test_the_proxy_refuses_a_landed_chunk_under_a_key_its_tokens_do_not_make() -> None:
    """Keys named by the publisher are checked: a chunk claimed under another prompt's key
    (a stale or lying instance) is refused, and the feed counts the batch malformed."""
    tokens = list(range(CHUNK))
    wrong = prefix_keys([7] * CHUNK, CHUNK)[0]
    caches = InstanceCaches(max_blocks=100)
    with pytest.raises(ValueError, match="key its tokens do not make"):
        caches.apply(_stored([wrong], None, tokens))
    with pytest.raises(ValueError, match="parent is not a chunk key"):
        caches.apply(_stored(prefix_keys(tokens, CHUNK), 12345, tokens))
    assert caches.landed.held_tokens(prefix_keys(tokens, CHUNK)) == 0
    caches.apply(_stored(prefix_keys(tokens, CHUNK), None, tokens))  # the control
    assert caches.landed.held_tokens(prefix_keys(tokens, CHUNK)) == CHUNK


def test_chunks_freed_are_removed_and_the_proxy_forgets_them(
    keyer: ChunkKeyer, board: KeysWriter, landed: LandedEvents
) -> None:
    chunks = keyer.chunk_keys(PROMPT)
    landed.learn(PROMPT, None)
    board.post([chunk.key for chunk in chunks[:3]])
    stored = landed.take()
    board.post([chunks[0].key])
    removed = landed.take()
    assert len(removed) == 1 and isinstance(removed[0], BlockRemoved)
    assert set(removed[0].block_hashes) == set(prefix_keys(PROMPT, CHUNK)[1:3])
    caches = over_the_wire(stored + removed)
    assert caches.landed.held_tokens(prefix_keys(PROMPT, CHUNK)) == CHUNK


def test_a_salted_prompt_is_found_under_its_salt_only(
    keyer: ChunkKeyer, board: KeysWriter, landed: LandedEvents
) -> None:
    chunks = keyer.chunk_keys(PROMPT, salt="tenant-a")
    landed.learn(PROMPT, "tenant-a")
    board.post([chunk.key for chunk in chunks])
    caches = over_the_wire(landed.take())
    assert caches.landed.held_tokens(prefix_keys(PROMPT, CHUNK, "tenant-a")) == 3 * CHUNK
    assert caches.landed.held_tokens(prefix_keys(PROMPT, CHUNK, "tenant-b")) == 0
    assert caches.landed.held_tokens(prefix_keys(PROMPT, CHUNK)) == 0


def test_a_closed_board_removes_everything_published(
    keyer: ChunkKeyer, board: KeysWriter, landed: LandedEvents
) -> None:
    """The consumer process is gone: nothing it held can spare a push any more."""
    chunks = keyer.chunk_keys(PROMPT)
    landed.learn(PROMPT, None)
    board.post([chunk.key for chunk in chunks])
    landed.take()
    board.close()
    removed = landed.take()
    assert len(removed) == 1 and len(removed[0].block_hashes) == 3


def test_the_proxy_keeps_vllms_prefix_cache_and_the_landed_chunks_apart() -> None:
    caches = InstanceCaches(max_blocks=100)
    tokens = list(range(CHUNK))
    keys = prefix_keys(tokens, CHUNK)
    caches.apply(BATCHES.decode(_batch(medium=None)).events[0])
    caches.apply(BATCHES.decode(_batch(medium=LANDED_MEDIUM)).events[0])
    assert caches.prefix.held_tokens(keys) == CHUNK
    assert caches.landed.held_tokens(keys) == CHUNK
    caches.apply(BATCHES.decode(_cleared()).events[0])  # vLLM reset its prefix cache
    assert caches.prefix.held_tokens(keys) == 0
    assert caches.landed.held_tokens(keys) == CHUNK


def _stored(block_hashes: list[bytes], parent: object, tokens: list[int]) -> object:
    """A landed chunk's event as the proxy decodes it."""
    stored = BlockStored(
        block_hashes=block_hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=CHUNK,
        lora_id=None,
        medium=LANDED_MEDIUM,
        lora_name=None,
    )
    payload = msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=[stored]))
    return BATCHES.decode(payload).events[0]


def _batch(medium: str | None) -> bytes:
    stored = BlockStored(
        block_hashes=prefix_keys(list(range(CHUNK)), CHUNK),  # a landed chunk's is its key
        parent_block_hash=None,
        token_ids=list(range(CHUNK)),
        block_size=CHUNK,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=[stored]))


def _cleared() -> bytes:
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
