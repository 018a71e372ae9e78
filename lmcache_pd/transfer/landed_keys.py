"""The keys of the chunks a consumer rank holds landed, on a shared-memory board of their own,
for decode's scheduler to publish as KV events (``connector/landed_events.py``).

Why: a chunk that landed here and is kept (``landed_cache.py``) spares a later request that
shares it the push; the proxy can send such a request to this instance only if it knows. vLLM
publishes its prefix cache's events from the scheduler's process; the landed chunks are known
only to the consumer process, which posts their keys here, and the scheduler turns what
changed into events on vLLM's own stream (the connector's ``take_events``).

The board is ``landed_board``'s seqlock over a payload of its own: the msgpack array of the
keys of every chunk landed and not yet freed, in no order. The whole set is posted, not what
changed, so that a post the scheduler misses loses nothing: its next read sees the set as it
is. It is sized for every page of the buffer; posts are memory writes only, and at most every
``POST_INTERVAL_S`` (a post encodes every key: up to a few thousand).
"""

from __future__ import annotations

import mmap
from pathlib import Path

import msgspec

from lmcache_pd.keys import KEY_BYTES
from lmcache_pd.transfer.landed_board import PAYLOAD_AT, BoardReader, BoardWriter

# The consumer posts the keys at most this often (what changed in between waits for the next).
POST_INTERVAL_S = 0.05
# The largest msgpack array header (array 32), then per key its bin 8 header and the key.
_MAX_ARRAY_HEADER = 5
_KEY_ENTRY_BYTES = 2 + KEY_BYTES

_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(list[bytes]).decode


def keys_path(board: Path) -> Path:
    """The keys board beside a rank's landed board (same folder, same lifetime)."""
    return board.with_name(f"{board.name}-keys")


def board_bytes(max_keys: int) -> int:
    """A board that holds ``max_keys`` keys, in whole pages."""
    needed = PAYLOAD_AT + _MAX_ARRAY_HEADER + max_keys * _KEY_ENTRY_BYTES
    return -(-needed // mmap.PAGESIZE) * mmap.PAGESIZE


class KeysWriter:
    """The consumer's side: made once at start, then ``post`` writes memory only."""

    def __init__(self, path: Path, max_keys: int) -> None:
        """Raises ``OSError`` if the board cannot be made."""
        self._board = BoardWriter(path, board_bytes(max_keys))
        self._max_keys = max_keys

    def post(self, keys: list[bytes]) -> None:
        """Say that ``keys`` are the chunks landed here now (at most ``max_keys``: the buffer's
        pages, which no more chunks can fill)."""
        self._board.post_payload(_encode(keys[: self._max_keys]))

    def close(self) -> None:
        """Mark the board closed (its reader then sees nothing held) and remove it."""
        self._board.close()


class KeysReader:
    """Decode's scheduler's side: each read is memory reads only, nothing is waited for."""

    def __init__(self, path: Path) -> None:
        self._board = BoardReader(path)
        self._version: tuple[int, int] | None = None

    def changed(self) -> set[bytes] | None:
        """The keys landed now if the board changed since the last call (an empty set once
        the consumer closed it); None if it did not (its header says so: nothing is copied or
        checked), or cannot be read now."""
        if self._version is not None and self._board.posted() == self._version:
            return None
        post = self._board.read_payload()
        if post is None or post[0] == self._version:
            return None
        self._version = post[0]
        try:
            return set(_decode(post[1])) if post[1] else set()
        except msgspec.DecodeError:
            return set()

    def close(self) -> None:
        self._board.close()
