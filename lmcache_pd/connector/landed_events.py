"""Decode's landed chunks as KV events on vLLM's own stream, so that the proxy can send a request
to the decode instance that holds its chunks already (and prefill pushes fewer of them).

The consumer process posts the keys of the chunks landed on its rank (``landed_keys.py``, read
through ``landed_chunks.py``); the scheduler sees each disaggregated request's prompt when it
loads it, and so knows which tokens each key stands for. vLLM asks the connector for events
after its own, every step
(``take_events``); what the board says changed becomes ``BlockStored`` / ``BlockRemoved`` of
medium ``LANDED_MEDIUM``, one block per chunk, of ``chunk_size`` tokens: a chunk is fetched
whole, so no event names a part of one that could not be served alone. A partial last chunk is
not published (only a prompt that ends exactly there could use it). Each chunk goes under the
key the proxy gives it (``kv_events.prefix_key`` chained over chunks, which the proxy checks),
with its parent's as the parent: the proxy can name a chunk whose parent never landed, as the
chunks after a prefix a push skipped (decode's prefix cache held it) never have one.

Rank 0's chunks stand for the instance: the ranks of a load receive the same chunks from the
same pushes and keep them by the same rule. Prefill at another TP size sends parts under other
keys, which no prompt here is keyed by: nothing is published then. Events are hints for the
proxy; what a push is spared is decided by the consumer from what it holds.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from dataclasses import dataclass

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent

from lmcache_pd.connector.landed_chunks import LandedChunks
from lmcache_pd.kv_events import LANDED_MEDIUM, prefix_keys


@dataclass(frozen=True, slots=True)
class _Chunk:
    key: bytes  # as the proxy names it: prefix_key over the prompt's chunks up to this one
    parent: bytes | None  # the previous chunk's, alike; None for a prompt's first
    tokens: array  # int64 token ids, chunk_size of them
    salt: str | None  # the request's cache_salt on a prompt's first chunk, which its key mixes


class LandedEvents:
    """What one decode instance's rank-0 consumer holds landed, published as it changes."""

    def __init__(self, landed: LandedChunks, max_chunks: int) -> None:
        """``landed``: what the ranks hold (rank 0's is published); ``max_chunks``: the most
        prompt chunks remembered (the buffer's pages: no more can have landed)."""
        self._landed_chunks = landed
        self._keyer = landed.keyers[0]
        self._version = -1  # the version of ``landed`` seen last
        self._max_chunks = max_chunks
        # Chunks of the prompts loaded, least recently loaded first (a parent before its child).
        self._chunks: OrderedDict[bytes, _Chunk] = OrderedDict()
        self._landed: set[bytes] = set()  # as the board said last
        # The chunks published, by their consumer key, and the key the proxy knows each by.
        self._published: dict[bytes, bytes] = {}
        self._stale = False  # learned or landed something since the last pass

    def learn(self, prompt: list[int], salt: str | None) -> None:
        """A request loads ``prompt``'s KV: remember what its full chunks' keys stand for."""
        size = self._keyer.chunk_size
        salt = salt or None
        named = prefix_keys(prompt, size, salt)  # the full chunks' keys as the proxy makes them
        chunks = self._keyer.chunk_keys(prompt, salt=salt)
        for index, (chunk, key) in enumerate(zip(chunks, named, strict=False)):
            tokens = array("q", prompt[chunk.start : chunk.end])
            parent = named[index - 1] if index else None
            first_salt = salt if index == 0 else None
            self._chunks[chunk.key] = _Chunk(key, parent, tokens, first_salt)
            self._chunks.move_to_end(chunk.key)
        while len(self._chunks) > self._max_chunks:
            self._chunks.popitem(last=False)
        self._stale = True

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call: chunks gone, then chunks landed, parents first."""
        self._landed_chunks.refresh()
        if self._landed_chunks.version != self._version:
            self._version = self._landed_chunks.version
            self._landed, self._stale = self._landed_chunks.on_rank(0), True
        if not self._stale:
            return []
        self._stale = False
        events: list[KVCacheEvent] = []
        gone = self._published.keys() - self._landed
        if gone:
            names = [self._published.pop(key) for key in gone]
            events.append(BlockRemoved(block_hashes=names, medium=LANDED_MEDIUM))
        for key, chunk in self._chunks.items():
            if key in self._published or key not in self._landed:
                continue
            self._published[key] = chunk.key
            events.append(self._stored(chunk))
        return events

    def close(self) -> None:
        self._landed_chunks.close()

    def _stored(self, chunk: _Chunk) -> BlockStored:
        return BlockStored(
            block_hashes=[chunk.key],
            parent_block_hash=chunk.parent,
            token_ids=chunk.tokens.tolist(),
            block_size=self._keyer.chunk_size,
            lora_id=None,
            medium=LANDED_MEDIUM,
            lora_name=None,
            extra_keys=None if chunk.salt is None else [(chunk.salt,)],
        )
