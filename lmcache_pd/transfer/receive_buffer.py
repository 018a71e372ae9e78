"""The consumer's receive buffer as both of its processes see it: its size, where a landed chunk
lies in it, and the check of that chunk's bytes against the producer's checksum.

The consumer's process lands chunks in the buffer (``consumer.py``); decode's vLLM worker, in
another process, reads them out of the same memory (``connector/consumer_worker.py``). Both import
this module, and neither imports the other's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from lmcache_pd import protocol
from lmcache_pd.config import PDConfig
from lmcache_pd.errors import IntegrityError
from lmcache_pd.kernels.integrity import checksum

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LandedChunk:
    """Where a landed chunk's bytes are and what they should hash to."""

    page: int
    nbytes: int
    checksum: int | None


def receive_buffer_bytes(config: PDConfig) -> int:
    """Size of a consumer's registered buffer: its pages, then the self-test slots."""
    return config.num_pages * config.page_bytes + protocol.PROBE_AREA_BYTES


def landed_view(buffer: torch.Tensor, page_bytes: int, landed: LandedChunk) -> torch.Tensor:
    """The view of ``buffer`` a landed chunk occupies, unchecked: for a caller that checks it
    in the pass that copies it out (``check_landed``)."""
    start = landed.page * page_bytes
    return buffer[start : start + landed.nbytes]


def check_landed(landed: LandedChunk, digest: int | None) -> None:
    """Raise ``IntegrityError`` (logged) unless ``digest``, the hash of the chunk's bytes as
    read, is the producer's checksum (or the producer sent none)."""
    if landed.checksum is not None and digest != landed.checksum:
        logger.error("chunk in page %d fails its checksum", landed.page)
        raise IntegrityError(f"chunk in page {landed.page} fails its checksum")


def landed_bytes(buffer: torch.Tensor, page_bytes: int, landed: LandedChunk) -> torch.Tensor:
    """The view of ``buffer`` a landed chunk occupies, once its bytes match the producer's
    checksum (a pass of its own over them); raises ``IntegrityError`` if they do not."""
    view = landed_view(buffer, page_bytes, landed)
    check_landed(landed, None if landed.checksum is None else checksum(view))
    return view
