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
  chunk to the GPU and scatters it. For a synchronous load (read by the coming forward pass) the
  model's stream waits for it. Otherwise it does not: an asynchronous load is reported received
  only once the scatter's event is done (``consumer_worker.py``), and vLLM schedules no work on
  those blocks before that, so running decodes never wait for a prompt's copy (an 8k-token
  prompt of an 8B model is 1 GiB: ~20 ms over PCIe). The chunk's pages go back once its event is
  done.

The model-runner thread never waits for the GPU, and spends microseconds a chunk: block ids are
checked on the host in Python, a request's block table is copied from pinned memory once,
without blocking, and the kernel finds each token through it; the layers' addresses are on the
device once.
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
from lmcache_pd.kernels.chunk_bytes import ChunkBytes
from lmcache_pd.kernels.gpu_memory import ensure_room
from lmcache_pd.kernels.host_runs import stage
from lmcache_pd.kernels.token_layout import KVLayout, TokenKVCache, token_chunk_format
from lmcache_pd.kernels.triton_layout import PlanRow, TritonTokenKV, chunk_blocks
from lmcache_pd.protocol import DEVICE_COPY_TIMEOUT_S

logger = logging.getLogger(__name__)


# GPU memory a launch of host chunks is staged in: a load larger than this goes in several
# launches (vLLM sized its cache to the GPU's memory; an 8k-token prompt of an 8B model is 1 GiB).
STAGING_LAUNCH_BYTES = 256 << 20


def _groups(chunks: Sequence[ChunkBytes], sizes: Sequence[int]) -> list[list[int]]:
    """The chunks' indices in launches: all in one where they are on the device, else in runs
    of at most ``STAGING_LAUNCH_BYTES`` (one chunk at least)."""
    if all(chunk.data.device.type == "cuda" for chunk in chunks):
        return [list(range(len(chunks)))]
    groups: list[list[int]] = [[]]
    total = 0
    for index, size in enumerate(sizes):
        if groups[-1] and total + size > STAGING_LAUNCH_BYTES:
            groups.append([])
            total = 0
        groups[-1].append(index)
        total += size
    return groups


class CudaCopy:
    """A copy queued on the copy stream, done when its event is."""

    # Its bytes are hashed, if at all, apart from the copy (the checksum is of host bytes).
    digest = None

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self._event = event
        self._device = device

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

    def order_model(self) -> None:
        torch.cuda.current_stream(self._device).wait_event(self._event)


class CudaTokenKV:
    """The GPU path of ``paged_kv.TokenKV``: same chunks, copies on the connector's stream."""

    whole_blocks = False
    hashes_in_pass = False

    def __init__(self, views: Sequence[torch.Tensor], block_size: int) -> None:
        """``views``: the layers in NHD order, on one CUDA device."""
        # The torch path's checks and sizes; the Triton path's copies.
        self._shape = TokenKVCache(views, KVLayout.NHD)
        self._triton = TritonTokenKV(views, KVLayout.NHD)
        self.block_size = block_size
        self.chunk_format = token_chunk_format(self._shape)
        self.device = self._shape.device
        self._stream = torch.cuda.Stream(device=self.device)
        self._num_blocks = self._shape.num_slots // block_size
        # The last request's block ids, and its table on the device.
        self._request: tuple[list[int], torch.Tensor] | None = None
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
        _, first = chunk_blocks(block_ids, start, end, self.block_size, self._num_blocks)
        row = PlanRow(start // self.block_size, first, end - start, 0)
        model = torch.cuda.current_stream(self.device)
        gathered = torch.cuda.Event()
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(model)
            table = self._table(block_ids)
            on_device = out
            if out.device != self.device:
                on_device = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self._triton.run(self._triton.plan([on_device], [row]), table, to_cache=False)
            gathered.record(self._stream)
            if on_device is not out:
                out.copy_(on_device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        model.wait_event(gathered)
        return CudaCopy(done, self.device)

    def scatter(
        self,
        chunk: torch.Tensor,
        block_ids: Sequence[int],
        chunk_start: int,
        chunk_end: int,
        start: int,
        hashed: bool = False,
        model_waits: bool = True,
    ) -> CudaCopy:
        """Queue the chunk's tokens from ``start`` on into the request's blocks; with
        ``model_waits`` the model's stream waits for them (see the module's doc)."""
        chunks = [ChunkBytes(chunk, chunk_start, chunk_end)]
        return self.scatter_chunks(chunks, block_ids, start, hashed, model_waits)[0]

    def scatter_chunks(
        self,
        chunks: Sequence[ChunkBytes],
        block_ids: Sequence[int],
        start: int,
        hashed: bool = False,
        model_waits: bool = True,
    ) -> tuple[CudaCopy, list[int | None]]:
        """Queue every chunk of a load into the request's blocks, in one launch (per chunk, a
        plan row, and a copy to the GPU where it is in host memory: one per run of chunks end
        to end there); with ``model_waits`` the model's stream waits for them (see the
        module's doc)."""
        rows, sizes = [], []
        for chunk in chunks:
            sizes.append(self._checked_size(chunk.data, chunk.end - chunk.start))
            begin = max(chunk.start, start)
            _, first = chunk_blocks(block_ids, begin, chunk.end, self.block_size, self._num_blocks)
            rows.append(
                PlanRow(begin // self.block_size, first, chunk.end - begin, begin - chunk.start)
            )
        # Distinct blocks over the whole load, once: two of its tokens never share a slot.
        chunk_blocks(
            block_ids,
            max(chunks[0].start, start),
            chunks[-1].end,
            self.block_size,
            self._num_blocks,
            unique=True,
        )
        model = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            self._stream.wait_stream(model)
            table = self._table(block_ids)
            for group in _groups(chunks, sizes):
                sources = [chunks[i].data for i in group]
                if any(data.device != self.device for data in sources):
                    # Host pages cross by the copy engine, leaving the multiprocessors to the
                    # model (a kernel reading host memory in place held them for the whole
                    # crossing: the model's step waited 23 ms for an 8k-token load).
                    # Chunks end to end on the host cross in one copy (``host_runs.py``).
                    total = sum(sizes[i] for i in group)
                    scratch = torch.empty(total, dtype=torch.uint8, device=self.device)
                    sources = stage(sources, scratch)
                plan = self._triton.plan(sources, [rows[i] for i in group])
                self._triton.run(plan, table, to_cache=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        copy = CudaCopy(done, self.device)
        if model_waits:
            copy.order_model()
        return copy, [None] * len(chunks)

    def adopt(self, buffer: torch.Tensor, *, loads: bool = True) -> None:
        """Page-lock a host buffer torch did not pin (a receive buffer's memfd mapping, the
        producer's staging), so that copies with it run without blocking; unlocked in
        ``close``. Locked here rather than allocated pinned: torch's pinned allocator rounds a
        size up to a power of two, and a staging buffer (pages and a probe area) just past one
        would take twice its memory. Loads from it are staged on the GPU: with ``loads``, the
        room for that is checked now (``gpu_memory.py``)."""
        if buffer.device.type != "cpu" or buffer.is_pinned():
            return
        if loads:
            ensure_room(self.device, STAGING_LAUNCH_BYTES, "staging host chunks for loads")
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
            CudaCopy(drained, self.device).wait(time.monotonic() + DEVICE_COPY_TIMEOUT_S)
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

    def _table(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The request's block table on the device. It crosses once per request (its chunks'
        copies come one after another with the same table), from pinned memory, on the copy
        stream (current here), without blocking."""
        if self._request is None or self._request[0] != block_ids:
            on_host = torch.tensor(block_ids, dtype=torch.int64).pin_memory()
            # A copy of the ids (the caller's list may grow): compared, a few microseconds.
            self._request = (list(block_ids), on_host.to(self.device, non_blocking=True))
        return self._request[1]
