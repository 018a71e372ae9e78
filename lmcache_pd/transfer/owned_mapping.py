"""A mapping only its owner changes: the chunk store's parts are read as dicts by the store (and
its tests), and changed only through their own methods, which keep their invariants."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class OwnedMapping(Mapping[K, V], Generic[K, V]):
    """Read-only to everyone but the subclass, whose methods change ``_entries``."""

    def __init__(self) -> None:
        self._entries: dict[K, V] = {}

    def __getitem__(self, key: K) -> V:
        return self._entries[key]

    def __iter__(self) -> Iterator[K]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
