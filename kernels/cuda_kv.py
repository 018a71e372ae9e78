"""A token-layout KV cache on a GPU: chunks gathered and scattered by the Triton kernel on a CUDA
stream of the connector's own, to and from host memory (pinned; NIXL DRAM) or GPU memory (NIXL
VRAM, ``buffer_device: cuda``).

Why each wait (the model's stream is the one current when the connector's hook runs):

- the copy stream waits for the model's stream before it reads the cache: this step's KV is
  written by work queued there;
- the model's stream waits for the gather only (a device-to-device copy), not for the copy to
  the host after it: vLLM may give a finished request's blocks to another at the next step, whose
  forward pass must not overwrite them before they are read. The copy to the host runs on,
  overlapping the next step, and the sender thread waits for its event (with a deadline) before
  the bytes go out (``sender.py``);
- a scatter waits for the model's stream (earlier work may still write those blocks), copies the
  chunk to the GPU and scatters it; the model's stream waits for it before the next forward pass
  reads the blocks, and the chunk's pages go back once its event is done (``consumer_worker.py``).

The model-runner thread never waits for the GPU: slot mappings are checked on the host, and
copied from pinned memory without blocking; the layers' addresses are on the device once.
Scratch buffers are allocated on the copy stream, so the caching allocator hands their memory to
later work of that stream only, after the copies that read it. Nothing here runs without a GPU:
``paged_kv`` imports this module only for a cache on a CUDA device.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence

import torch

from lmcache_pd.backoff import SpinThenBackoff
from lmcache_pd.errors import TransferError
from lmcache_pd.kernels.token_layout import (
    KVLayout,
    TokenKVCache,
    slot_mapping,
    token_chunk_format,
)
from lmcache_pd.kernels.triton_layout import TritonTokenKV
from lmcache_pd.protocol import DEVICE_COPY_TIMEOUT_S

logger = logging.getLogger(__name__)


class CudaCopy:
    """A copy queued on the copy stream, done when its event is."""

    # Its bytes are hashed, if at all, apart from the copy (the checksum is of host bytes).
    digest = None

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event.query()

    def wait(self, deadline: float) -> None:
        """Poll the event (a CUDA synchronize has no deadline); spin briefly, then back off."""
        pace = SpinThenBackoff()
        while not self._event.query():
            now = time.monotonic()
            if now >= deadline:
                raise TransferError(f"GPU copy not done after {now - pace.started:.3f} s")
            pace.pause()


class CudaTokenKV:
    """The GPU path of ``paged_kv.TokenKV``: same chunks, copies on the connector's stream."""

    whole_blocks = False

    def __init__(self, views: Sequence[torch.Tensor], block_size: int) -> None:
        """``views``: the layers in NHD order, on one CUDA device."""
        # The torch path's checks and sizes; the Triton path's copies.
        self._shape = TokenKVCache(views, KVLayout.NHD)
        self._triton = TritonTokenKV(views, KVLayout.NHD)
        self.block_size = block_size
        self.chunk_format = token_chunk_format(self._shape)
        self.device = self._shape.device
        self._stream = torch.cuda.Stream(device=self.device)
        self._pinned: list[torch.Tensor] = []
        logger.info(
            "KV cache on %s: %d layers of %d heads x %d, token chunks (%s), Triton copies",
            self.device,
            self._shape.num_layers,
            self._shape.num_heads,
            self._shape.head_size,
            self.chunk_format,
        )

    def chunk_nbytes(self, num_tokens: int) -> int:
        return self._shape.chunk_nbytes(num_tokens)

    def gather(
        self,
        block_ids: Sequence[int],
        start: int,
        end: int,
        out: torch.Tensor,
        hashed: bool = False,
    ) -> CudaCopy:
        """Queue the copy of tokens ``start .. end`` into ``out`` (pinned host memory or this
        GPU's), ``chunk_nbytes(end - start)`` bytes."""
        nbytes = self._checked_size(out, end - start)
        slots = self._device_slots(block_ids, start, end)
        model = torch.cuda.current_stream(self.device)
        gathered = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(model)
            slots = slots.to(self.device, non_blocking=True)
            if out.device == self.device:
                self._triton.gather(slots, out)
                gathered.record(self._stream)
            else:
                scratch = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                self._triton.gather(slots, scratch)
                gathered.record(self._stream)
                out.copy_(scratch, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        model.wait_event(gathered)
        return CudaCopy(done)

    def scatter(
        self,
        chunk: torch.Tensor,
        block_ids: Sequence[int],
        chunk_start: int,
        chunk_end: int,
        start: int,
        hashed: bool = False,
    ) -> CudaCopy:
        """Queue the chunk's tokens from ``start`` on into the request's blocks; the model's
        stream waits for them."""
        nbytes = self._checked_size(chunk, chunk_end - chunk_start)
        first = max(chunk_start, start)
        slots = self._device_slots(block_ids, first, chunk_end, unique=True)
        model = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(model)
            slots = slots.to(self.device, non_blocking=True)
            if chunk.device != self.device:
                on_device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                on_device.copy_(chunk, non_blocking=True)
                chunk = on_device
            self._triton.scatter(chunk, slots, skip=first - chunk_start)
            done = torch.cuda.Event()
            done.record(self._stream)
        model.wait_event(done)
        return CudaCopy(done)

    def adopt(self, buffer: torch.Tensor) -> None:
        """Page-lock a host receive buffer (a memfd mapping torch did not allocate), so that
        copies from it run without blocking; unlocked in ``close``."""
        if buffer.device.type != "cpu" or buffer.is_pinned():
            return
        nbytes = buffer.numel() * buffer.element_size()
        error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, 0)
        if int(error) != 0:
            logger.warning("could not page-lock the receive buffer (CUDA error %s)", error)
            return
        self._pinned.append(buffer)

    def close(self) -> None:
        """Wait for queued copies (up to a deadline), then unlock what was locked."""
        drained = torch.cuda.Event()
        drained.record(self._stream)
        try:
            CudaCopy(drained).wait(time.monotonic() + DEVICE_COPY_TIMEOUT_S)
        except TransferError as exc:
            logger.error("copies still queued at close, receive buffer left locked: %s", exc)
            return
        for buffer in self._pinned:
            with contextlib.suppress(RuntimeError):
                torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
        self._pinned = []

    def _checked_size(self, chunk: torch.Tensor, num_tokens: int) -> int:
        nbytes = self.chunk_nbytes(num_tokens)
        if chunk.dtype != torch.uint8 or chunk.numel() != nbytes or not chunk.is_contiguous():
            raise ValueError(f"a chunk of {num_tokens} tokens is {nbytes} contiguous bytes")
        if chunk.device != self.device and not chunk.is_cpu:
            raise ValueError(f"a chunk is in host memory or on {self.device}, not {chunk.device}")
        return nbytes

    def _device_slots(
        self, block_ids: Sequence[int], start: int, end: int, *, unique: bool = False
    ) -> torch.Tensor:
        """The slots, checked on the host (on the device a check would wait for the GPU),
        in pinned memory for a copy that does not block."""
        slots = slot_mapping(block_ids, start, end, self.block_size)
        low, high = int(slots.min()), int(slots.max())
        if low < 0 or high >= self._shape.num_slots:
            raise ValueError(
                f"slots {low}..{high} fall outside the cache's {self._shape.num_slots}"
            )
        if unique and torch.unique(slots).numel() != slots.numel():
            raise ValueError("the request's blocks name a slot twice")
        return slots.pin_memory()
