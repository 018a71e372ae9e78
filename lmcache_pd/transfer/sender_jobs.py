"""What a producer rank's model-runner thread hands its sender threads: the requests being
saved, push and abandon jobs, and the count of jobs not finished yet."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field

import torch

from lmcache_pd.kernels.paged_kv import COPIED, Copy
from lmcache_pd.keys import ChunkKey
from lmcache_pd.protocol import AbandonReason, DisaggSpec


@dataclass(slots=True)
class Saving:
    """A producer request whose prompt's KV is being copied out and pushed as prefill goes.

    ``pushed_upto`` and ``block_ids`` belong to the model-runner thread; ``abandoned`` is set by
    either thread and read by both; ``consumer_told`` belongs to the sender thread."""

    spec: DisaggSpec
    keys: list[ChunkKey]
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    pushed_upto: int = 0
    abandoned: threading.Event = field(default_factory=threading.Event)
    consumer_told: bool = False


@dataclass(slots=True)
class PushJob:
    """Chunks of one request gathered into staging pages, to push and then give back;
    ``checksums`` were taken by the gather (None: integrity off)."""

    request: Saving
    chunks: list[tuple[bytes, torch.Tensor]]
    checksums: list[int] | None
    pages: contextlib.AbstractContextManager
    staged_at: float  # wall clock, for the trace
    # The copy into the pages (the last of them: a GPU's copies run in order on one stream);
    # the bytes go out once it is done.
    ready: Copy = COPIED


@dataclass(frozen=True, slots=True)
class AbandonJob:
    """Tell the request's consumer that its KV will not come."""

    request: Saving
    reason: AbandonReason
    detail: str
    write_in_flight: bool = False


Job = PushJob | AbandonJob


class Outstanding:
    """Jobs submitted and not yet finished, across every sender of a producer rank."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._count += n

    @property
    def count(self) -> int:
        with self._lock:
            return self._count
