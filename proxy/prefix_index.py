"""What each instance's prefix cache and landed chunks hold, as its KV events told the proxy.

One ``InstanceCaches`` per instance: an ``InstanceBlocks`` of vLLM's prefix cache, and one of
the chunks a decode instance's consumer holds landed (events of medium ``LANDED_MEDIUM``, a
block per chunk: ``connector/landed_events.py``). Each ``InstanceBlocks`` maps vLLM's block
hashes (or chunk keys) to the proxy's prefix keys (``lmcache_pd.kv_events``), and counts the
keys it holds. ``held_tokens`` walks a prompt's keys from the start and stops at the first the
instance lacks: what it holds is a prefix, as vLLM can only reuse a prefix.

Landed chunks are named by content already: a decode instance publishes each under the proxy's
own key (``prefix_key`` chained over chunks) with its parent's key as the parent, so that a chunk
is indexed whether or not its parent landed (a push skips the chunks decode's prefix cache
holds, whose children then land without them). The proxy does not take those keys on trust: it
computes each from the parent key, the tokens and the extra keys, and refuses an event whose
keys differ. ``held_after`` walks them from the chunk that holds a given token on, as decode
loads them past its prefix-cache hit (``connector/landed_chunks.py``).

Memory is bounded: at most ``max_blocks`` blocks per instance; past it the oldest stored go
first (vLLM evicts least recently used blocks too, and re-announces a block it reuses, which
moves it to the young end here). A block whose parent the proxy never saw (its event lost) is
not indexed: its key cannot be computed. Everything here runs on the proxy's event loop.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from lmcache_pd.kv_events import (
    KEY_BYTES,
    LANDED_MEDIUM,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    prefix_key,
)

logger = logging.getLogger(__name__)

# What one remembered block takes: two dict entries, a 16-byte key, vLLM's hash.
BYTES_PER_BLOCK = 200


class InstanceBlocks:
    """The blocks one instance holds, by vLLM's hash and by the proxy's key."""

    def __init__(self, max_blocks: int, *, content_keys: bool = False) -> None:
        """``content_keys``: each block's hash is its key and its parent hash its parent's key
        (landed chunks), checked as they are stored, rather than vLLM's own hashes."""
        self._max_blocks = max_blocks
        self._content_keys = content_keys
        self._by_hash: dict[BlockHash, bytes] = {}  # insertion order: oldest first
        self._keys: dict[bytes, int] = {}  # key -> how many of the instance's hashes name it
        self.block_size: int | None = None
        self.orphans = 0  # blocks whose parent was unknown: not indexed
        self.evicted = 0  # blocks forgotten to stay within max_blocks

    def __len__(self) -> int:
        return len(self._by_hash)

    def __contains__(self, key: object) -> bool:
        """Whether a block of the proxy's ``key`` is held."""
        return key in self._keys

    @property
    def approx_bytes(self) -> int:
        """What the index of this instance takes, roughly (the dicts and their keys)."""
        tables = sys.getsizeof(self._by_hash) + sys.getsizeof(self._keys)
        return tables + len(self._by_hash) * BYTES_PER_BLOCK

    def apply(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        match event:
            case BlockStored():
                self._store(event)
            case BlockRemoved():
                for block_hash in event.block_hashes:
                    self._forget(block_hash)
            case AllBlocksCleared():
                self.clear()

    def clear(self) -> None:
        self._by_hash.clear()
        self._keys.clear()

    def held_tokens(self, keys: Sequence[bytes]) -> int:
        """How many leading tokens of the prompt whose block keys are ``keys`` are held."""
        held = 0
        for key in keys:
            if key not in self._keys:
                break
            held += 1
        return held * (self.block_size or 0)

    def held_after(self, keys: Sequence[bytes], start: int) -> int:
        """Where the run of held blocks that holds token ``start`` ends (``start`` itself if
        the block that holds it is not held): what an instance that has the first ``start``
        tokens elsewhere holds on from there."""
        size = self.block_size or 0
        if not size:
            return start
        end = start
        for index in range(start // size, len(keys)):
            if keys[index] not in self._keys:
                break
            end = (index + 1) * size
        return max(start, end)

    def _store(self, event: BlockStored) -> None:
        size = event.block_size
        if len(event.token_ids) != len(event.block_hashes) * size:
            raise ValueError(
                f"BlockStored of {len(event.block_hashes)} blocks of {size} carries "
                f"{len(event.token_ids)} token ids"
            )
        if event.group_idx:  # a second KV-cache group (hybrid models): not routed on
            return
        if self.block_size != size:
            if self.block_size is not None:
                logger.warning("block size changed %s -> %d: index reset", self.block_size, size)
                self.clear()
            self.block_size = size
        parent = self._parent_key(event)
        if parent is None and event.parent_block_hash is not None:
            self.orphans += len(event.block_hashes)
            return
        extras = event.extra_keys or []
        for index, block_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[index * size : (index + 1) * size]
            extra = extras[index] if index < len(extras) else None
            parent = prefix_key(parent, tokens, extra)
            if self._content_keys and block_hash != parent:
                raise ValueError("a landed chunk published under a key its tokens do not make")
            self._forget(block_hash)  # re-announced: now the youngest
            self._by_hash[block_hash] = parent
            self._keys[parent] = self._keys.get(parent, 0) + 1
        while len(self._by_hash) > self._max_blocks:
            self._forget(next(iter(self._by_hash)))
            self.evicted += 1

    def _parent_key(self, event: BlockStored) -> bytes | None:
        """The key the event's first block chains from: its parent's, as indexed (None if
        never seen), or as published where blocks are named by content."""
        parent = event.parent_block_hash
        if parent is None or not self._content_keys:
            return None if parent is None else self._by_hash.get(parent)
        if not isinstance(parent, bytes) or len(parent) != KEY_BYTES:
            raise ValueError("a landed chunk's parent is not a chunk key")
        return parent

    def _forget(self, block_hash: BlockHash) -> None:
        key = self._by_hash.pop(block_hash, None)
        if key is None:
            return
        count = self._keys[key] - 1
        if count:
            self._keys[key] = count
        else:
            del self._keys[key]


class InstanceCaches:
    """One instance's prefix cache and landed chunks, each indexed by its own block size."""

    def __init__(self, max_blocks: int) -> None:
        self.prefix = InstanceBlocks(max_blocks)
        self.landed = InstanceBlocks(max_blocks, content_keys=True)

    def __len__(self) -> int:
        return len(self.prefix) + len(self.landed)

    @property
    def approx_bytes(self) -> int:
        return self.prefix.approx_bytes + self.landed.approx_bytes

    @property
    def orphans(self) -> int:
        return self.prefix.orphans + self.landed.orphans

    def apply(self, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        """An event of the landed medium goes to the landed chunks; vLLM's ``AllBlocksCleared``
        (its prefix cache reset) clears the prefix cache alone."""
        if isinstance(event, AllBlocksCleared):
            self.prefix.clear()
        elif event.medium == LANDED_MEDIUM:
            self.landed.apply(event)
        else:
            self.prefix.apply(event)

    def clear(self) -> None:
        self.prefix.clear()
        self.landed.clear()
