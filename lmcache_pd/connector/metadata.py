"""What the scheduler-side connector tells the worker-side one each step.

vLLM runs the two halves in different processes and ships this object from one to the other
with every step, so it carries plain data only: prompts, block ids, progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from lmcache_pd.protocol import DisaggSpec


@dataclass(frozen=True, slots=True)
class SaveRequest:
    """Producer: after this step the KV of ``prompt[:computed_end]`` is in ``block_ids``."""

    req_id: str
    spec: DisaggSpec
    prompt: list[int]
    block_ids: list[int]
    computed_end: int


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """Consumer: fill ``block_ids`` with the KV of ``prompt[start:]``, pushed under
    ``disagg_req_id``, then report ``req_id`` as received."""

    req_id: str
    disagg_req_id: str
    prompt: list[int]
    block_ids: list[int]
    start: int


@dataclass
class PDConnectorMetadata(KVConnectorMetadata):
    """One step's saves (producer) or loads (consumer), and the requests that finished."""

    saves: list[SaveRequest] = field(default_factory=list)
    loads: list[LoadRequest] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
