"""What a producer rank's model-runner thread hands its sender threads: the requests being
saved, push, abandon and notice jobs, and the count of jobs not finished yet."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from lmcache_pd.errors import TransferError
from lmcache_pd.kernels.paged_kv import COPIED, Copy
from lmcache_pd.keys import ChunkKey
from lmcache_pd.protocol import AbandonReason, DisaggSpec


@dataclass(slots=True)
class Saving:
    """A producer request whose prompt's KV is being copied out and pushed as prefill goes.

    ``pushed_upto``, ``block_ids`` and ``noticed`` belong to the model-runner thread;
    ``abandoned`` is set by either thread and read by both; ``consumer_told`` belongs to the
    sender thread."""

    spec: DisaggSpec
    keys: list[ChunkKey]
    prompt_tokens: int
    block_ids: list[int] = field(default_factory=list)
    pushed_upto: int = 0
    abandoned: threading.Event = field(default_factory=threading.Event)
    consumer_told: bool = False
    noticed: bool = False  # its NoticeJob was handed over


class Filling:
    """The copy of a push job's chunks into its staging pages, which the model-runner thread
    makes after handing the job over: the sender asks the consumer for pages meanwhile, so that
    the allocation's round trip overlaps the copy, and waits for it (``wait``) before a byte
    goes out.

    Set once by the model-runner thread (``done`` or ``failed``), read by the sender after the
    event. The pages may go back to the pool (a dropped job) while the copy still runs: in the
    connector only the model-runner thread takes pages (its chunks lie in staging, so a push
    copies none in), after its copy, and a GPU's copies run in order."""

    def __init__(self) -> None:
        self._set = threading.Event()
        self._copy: Copy = COPIED
        self._checksums: list[int] | None = None
        self._error = ""

    @classmethod
    def filled(cls, checksums: list[int] | None = None, copy: Copy = COPIED) -> Filling:
        """A job whose chunks were in their pages before it was handed over."""
        filling = cls()
        filling.done(checksums, copy)
        return filling

    def done(self, checksums: list[int] | None, copy: Copy = COPIED) -> None:
        """The copy is made (or queued: ``copy``, the last of a GPU's); ``checksums`` were
        taken in its pass (None: integrity off, or the cache cannot)."""
        self._copy, self._checksums = copy, checksums
        self._set.set()

    def failed(self, detail: str) -> None:
        """The copy failed: the push fails, nothing is written."""
        self._error = detail or "copy failed"
        self._set.set()

    def wait(self, deadline: float) -> list[int] | None:
        """The chunks' checksums once they are in their pages; ``TransferError`` if the copy
        failed or is not done by ``deadline`` (``time.monotonic()``)."""
        if not self._set.wait(max(0.0, deadline - time.monotonic())):
            raise TransferError("the chunks were not copied into staging in time")
        if self._error:
            raise TransferError(f"copying the chunks into staging failed: {self._error}")
        self._copy.wait(deadline)
        return self._checksums


@dataclass(slots=True)
class PushJob:
    """Chunks of one request to copy into their staging pages (``filling``), push and then give
    back."""

    request: Saving
    chunks: list[tuple[bytes, torch.Tensor]]
    pages: contextlib.AbstractContextManager
    staged_at: float  # wall clock, for the trace
    filling: Filling = field(default_factory=Filling.filled)


@dataclass(frozen=True, slots=True)
class AbandonJob:
    """Tell the request's consumer that its KV will not come."""

    request: Saving
    reason: AbandonReason
    detail: str
    write_in_flight: bool = False


@dataclass(frozen=True, slots=True)
class NoticeJob:
    """Once every job of the request queued before it on this consumer rank is done (pushed,
    failed or dropped: a rank's jobs run in order on its one thread), call ``notify`` with
    whether its KV is all there (no push of it failed or was given up)."""

    request: Saving
    notify: Callable[[bool], None]


Job = PushJob | AbandonJob | NoticeJob


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
