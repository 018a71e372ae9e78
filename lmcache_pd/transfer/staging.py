"""A producer rank's staging buffer: pages that chunks are gathered into and written from.

One buffer per process, shared by every per-peer ``Producer`` (each registers it with its own
NIXL agent). Pages are taken on vLLM's model-runner thread, while a step's KV is copied out, and
given back on a sender thread once their push is over: the lock makes that safe. Past the pages
lie the small slots that handshake self-tests write from: a self-test must not fail for want of a
page while pushes fill the buffer.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

from lmcache_pd import protocol
from lmcache_pd.errors import AllocationError
from lmcache_pd.kernels.gpu_memory import ensure_room
from lmcache_pd.transfer.allocator import PageAllocator


class Staging:
    """``num_pages`` pages of ``page_bytes`` in one zeroed buffer; thread-safe."""

    def __init__(
        self,
        *,
        num_pages: int,
        page_bytes: int,
        device: torch.device | str = "cpu",
    ) -> None:
        """``device``: CPU memory (NIXL's DRAM; a CUDA cache page-locks it, ``PagedKV.adopt``)
        or a GPU's (VRAM, ``buffer_device: cuda``)."""
        self.page_bytes = page_bytes
        self._pages_bytes = num_pages * page_bytes
        size = self._pages_bytes + protocol.PROBE_AREA_BYTES
        if torch.device(device).type == "cuda":
            ensure_room(torch.device(device), size, "the producer's GPU staging")
        # Zeroed now so that every page is faulted in here, not on the first transfers.
        self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
        self._pages = PageAllocator(num_pages=num_pages, page_bytes=page_bytes, lease_s=None)
        self._free_slots = list(range(protocol.PROBE_SLOTS))
        self._lock = threading.Lock()

    @property
    def free_pages(self) -> int:
        with self._lock:
            return self._pages.free_pages

    @contextlib.contextmanager
    def pages(self, count: int) -> Iterator[list[torch.Tensor]]:
        """``count`` page-sized views of the buffer, returned to the pool on exit. Raises
        ``AllocationError`` (``BufferFull`` if only for now) when they do not fit."""
        try:
            with self._lock:
                taken = self._pages.allocate(count, time.monotonic())
        except AllocationError as exc:
            raise AllocationError(
                f"the producer's staging buffer has no room for {count} more chunks ({exc}); "
                "raise buffer_size_bytes"
            ) from exc
        try:
            yield [
                self.buffer[page * self.page_bytes : (page + 1) * self.page_bytes] for page in taken
            ]
        finally:
            with self._lock:
                for page in taken:
                    self._pages.decref(page)

    @contextlib.contextmanager
    def probe_slot(self) -> Iterator[torch.Tensor]:
        """A self-test's source: PROBE_NONCE_BYTES of registered memory, this caller's until
        exit. There are as many slots as the most peers a producer rank serves, each doing one
        handshake at a time, so a lack of them is a bug (``AllocationError``)."""
        with self._lock:
            if not self._free_slots:
                raise AllocationError("every self-test slot of the staging buffer is in use")
            slot = self._free_slots.pop()
        start = self._pages_bytes + slot * protocol.PROBE_NONCE_BYTES
        try:
            yield self.buffer[start : start + protocol.PROBE_NONCE_BYTES]
        finally:
            with self._lock:
                self._free_slots.append(slot)

    def holds(self, data: torch.Tensor, nbytes: int) -> bool:
        """Whether ``nbytes`` from ``data``'s start lie inside the buffer's pages."""
        start = data.data_ptr() - self.buffer.data_ptr()
        return start >= 0 and start + nbytes <= self._pages_bytes
