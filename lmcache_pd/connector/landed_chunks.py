"""What decode's consumer ranks hold landed, as decode's scheduler sees it: each rank's keys
board (``transfer/landed_keys.py``), read without waiting.

Two uses. A request decode serves alone loads the chunks landed on every rank for earlier
requests that its prompt continues, past what vLLM's own prefix cache holds (``landed_run``):
the landed chunks are a second tier of decode's cache, as LMCache's local tier is, and a chunk
vLLM evicted need not be computed again. And rank 0's set is published as KV events
(``landed_events.py``).

What the boards say is a hint: a chunk may be evicted between the read and the load, whose
claim on it then fails and vLLM computes those tokens (``kv_load_failure_policy: recompute``).

vLLM asks a waiting request's hit on every scheduling attempt (each step it waits): a board is
read only when its header says it changed, a request's chunk keys are hashed once (until
``forget``), and its run is walked again only when a board or the hit it starts from changed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from lmcache_pd.keys import ChunkKey, ChunkKeyer, MMItems
from lmcache_pd.transfer.landed_keys import KeysReader


class LandedChunks:
    """The chunk keys landed on each consumer rank, and each rank's keyer."""

    def __init__(self, keyers: Sequence[ChunkKeyer], boards: Sequence[Path]) -> None:
        """``keyers`` and ``boards``: one per rank, in rank order."""
        if len(keyers) != len(boards) or not keyers:
            raise ValueError(f"{len(keyers)} keyers for {len(boards)} boards")
        self.keyers = list(keyers)
        self._readers = [KeysReader(board) for board in boards]
        self._sets: list[set[bytes]] = [set() for _ in boards]
        self.version = 0  # bumped whenever a rank's set changed
        # Per request: its prompt's chunk keys on each rank, and its last run (the version and
        # the hit it was walked for, and where it ended).
        self._keys: dict[str, list[list[ChunkKey]]] = {}
        self._runs: dict[str, tuple[int, int, int]] = {}

    @property
    def chunk_size(self) -> int:
        return self.keyers[0].chunk_size

    def on_rank(self, rank: int) -> set[bytes]:
        """The keys landed on ``rank`` as last read (``refresh``)."""
        return self._sets[rank]

    def refresh(self) -> None:
        """Read every board that changed since the last read (memory reads only)."""
        for rank, reader in enumerate(self._readers):
            landed = reader.changed()
            if landed is not None:
                self._sets[rank] = landed
                self.version += 1

    def landed_run(
        self,
        request_id: str,
        tokens: list[int],
        salt: str | None,
        computed: int,
        lora: str | None = None,
        mm: MMItems = (),
    ) -> int:
        """Where the run of ``tokens``' chunks (keyed with ``salt``, ``lora`` and ``mm``) landed on
        every rank ends, from the chunk that holds token ``computed`` on (``computed`` itself if
        that chunk has not landed, or the prompt ends there). ``request_id``'s chunk keys are
        those of its first call, until ``forget``."""
        self.refresh()
        if computed >= len(tokens) or not all(self._sets):
            return computed
        run = self._runs.get(request_id)
        if run is not None and run[:2] == (self.version, computed):
            return run[2]
        per_rank = self._keys.get(request_id)
        if per_rank is None:
            per_rank = self._keys[request_id] = [
                keyer.chunk_keys(tokens, salt=salt or None, lora=lora, mm=mm)
                for keyer in self.keyers
            ]
        end = self._run_end(per_rank, computed)
        self._runs[request_id] = (self.version, computed, end)
        return end

    def forget(self, request_id: str) -> None:
        """The request ended: its keys and run go."""
        self._keys.pop(request_id, None)
        self._runs.pop(request_id, None)

    def _run_end(self, per_rank: list[list[ChunkKey]], computed: int) -> int:
        end = computed
        for chunks in zip(*per_rank, strict=True):
            if chunks[0].end <= computed:
                continue
            if not all(chunk.key in keys for chunk, keys in zip(chunks, self._sets, strict=True)):
                break
            end = chunks[0].end
        return end

    def close(self) -> None:
        for reader in self._readers:
            reader.close()
