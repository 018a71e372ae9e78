"""A GPU buffer shared between a vLLM worker and its consumer process (``buffer_device: cuda``).

The consumer process allocates the receive buffer on the worker's GPU and registers it with NIXL
as VRAM: the process that registers memory owns it, so UCX registers an allocation of its own
and never has to re-export a mapping imported by IPC. The worker, which scatters chunks out of
it into vLLM's cache, opens it by CUDA IPC. The handle is torch's own, the one
``torch.multiprocessing`` sends (``reduce_tensor``), carried here as a typed struct on the
service's msgpack channel (never pickled). The process keeps the tensor while it runs; the
worker stops it only after its copies out of the buffer are done (``ConsumerWorker.close``).
"""

from __future__ import annotations

import msgspec
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor


class CudaBufferHandle(msgspec.Struct, frozen=True):
    """What ``reduce_tensor`` gives for a flat uint8 CUDA tensor, field by field."""

    nbytes: int
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


def share(buffer: torch.Tensor) -> CudaBufferHandle:
    """The handle another process opens ``buffer`` by (flat, contiguous uint8, on a GPU)."""
    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise ValueError(
            f"a shared buffer is flat uint8 on a GPU, got {buffer.dtype} on {buffer.device}"
        )
    if buffer.storage_offset() != 0 or not buffer.is_contiguous():
        raise ValueError("a shared buffer must be a whole contiguous allocation")
    _, args = reduce_tensor(buffer)
    # (tensor class, size, stride, offset, storage class, dtype, then the storage's handle)
    device, handle, storage_bytes, offset_bytes, _, ref_handle, ref_offset, event, sync = args[6:]
    return CudaBufferHandle(
        nbytes=buffer.numel(),
        device=device,
        handle=handle,
        storage_bytes=storage_bytes,
        storage_offset_bytes=offset_bytes,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event,
        event_sync_required=sync,
    )


def open_shared(shared: CudaBufferHandle) -> torch.Tensor:
    """The buffer ``shared`` names, mapped into this process."""
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([shared.nbytes]),
        (1,),
        0,
        torch.UntypedStorage,
        torch.uint8,
        shared.device,
        shared.handle,
        shared.storage_bytes,
        shared.storage_offset_bytes,
        False,
        shared.ref_counter_handle,
        shared.ref_counter_offset,
        shared.event_handle,
        shared.event_sync_required,
    )
