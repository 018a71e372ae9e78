"""Room on a GPU for what the connector allocates there after vLLM sized its KV cache.

vLLM fills the GPU up to ``gpu_memory_utilization`` with its KV cache before the connector
registers it; the connector's GPU buffers (a VRAM receive buffer or staging with
``buffer_device: cuda``, the scratch host chunks are staged in) come after. Asking for more than
is free would fail later and far from the cause (in CUDA-graph capture, or a load's first copy):
each is checked when the connector starts, and refused naming what to lower.
"""

from __future__ import annotations

import torch

from lmcache_pd.errors import ConfigError

# Left free beside what is asked: CUDA contexts of the connector's threads and processes, NIXL's
# registrations, the caching allocator's rounding.
HEADROOM_BYTES = 256 << 20


def ensure_room(device: torch.device, nbytes: int, what: str) -> None:
    """Raise ``ConfigError`` unless ``nbytes`` (and the headroom) are free on ``device``."""
    free, total = torch.cuda.mem_get_info(device)
    if nbytes + HEADROOM_BYTES > free:
        raise ConfigError(
            f"{what} needs {nbytes >> 20} MiB of {device} (and {HEADROOM_BYTES >> 20} MiB of "
            f"headroom), but {free >> 20} MiB of its {total >> 20} are free after vLLM's KV "
            "cache: lower buffer_size_bytes, or vLLM's gpu_memory_utilization"
        )
