"""A consumer rank's receive buffer cut into pages of one part each, so that a decode fed in
parts (fan-in: prefill at a larger TP size) holds as many chunks as its buffer's size says.

The consumer's allocator gives one page per chunk key, and at fan-in each part of a chunk is a
key of its own (``tp_parts.py``). Pages of a whole chunk would leave each part a page k times
its size: the buffer, the pages reserved ahead and the landed-chunk cache would hold 1/k of the
chunks their bytes suggest, and pushes would be refused k times sooner. Pages of the rank's
largest part, as many as ``buffer_size_bytes`` in whole chunks takes, hold exactly that many
chunks. Where a rank's parts are of one size (every fan-in where one TP size divides the other)
that is the buffer asked, to the byte; where they differ (12 heads from TP 3 to 2 come as 4 + 2
heads), a page of the larger part holds the smaller with room to spare, and the rank allocates
more than asked, saying so at start.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from lmcache_pd.config import PDConfig, replace
from lmcache_pd.errors import ConfigError

logger = logging.getLogger(__name__)


def receive_config(config: PDConfig, part_bytes: Sequence[int], rank: int) -> PDConfig:
    """``config`` for the consumer process of a rank whose every chunk arrives as parts of
    ``part_bytes`` (one: the whole chunk): pages of the largest part, as many as
    ``buffer_size_bytes`` holds whole chunks of the rank's times the parts of each.
    ``ConfigError`` if the buffer holds no whole chunk."""
    chunk_bytes, page_bytes = sum(part_bytes), max(part_bytes)
    chunks = config.buffer_size_bytes // chunk_bytes
    if chunks < 1:
        raise ConfigError(
            f"buffer_size_bytes ({config.buffer_size_bytes}) holds no chunk of this rank's "
            f"cache ({chunk_bytes} bytes: chunk_size {config.chunk_size} tokens)"
        )
    pages = chunks * len(part_bytes)
    if len(part_bytes) > 1:
        allocated = pages * page_bytes
        logger.info(
            "rank %d: each chunk comes as %d parts (prefill_tp_size %s), so the receive buffer "
            "is %d pages of %d bytes, one a part: %d chunks of %d tokens in %d bytes "
            "(buffer_size_bytes asked %d)%s",
            rank,
            len(part_bytes),
            config.prefill_tp_size,
            pages,
            page_bytes,
            chunks,
            config.chunk_size,
            allocated,
            config.buffer_size_bytes,
            ""
            if allocated <= config.buffer_size_bytes
            else f"; more, as its parts differ in size ({sorted(set(part_bytes))} bytes)",
        )
    return replace(config, page_bytes=page_bytes, buffer_size_bytes=pages * page_bytes)
