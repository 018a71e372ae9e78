"""What the scheduler-side connector tells the worker-side one each step.

vLLM runs the two halves in different processes and ships this object from one to the other
with every step, so it carries plain data only, and only what changed: a request's prompt goes
once, with its first save or its load; later saves carry the blocks added since.

Free of vLLM, as the worker halves that read it are: ``facade.py`` registers these classes as
the vLLM metadata kinds they are (virtual subclasses of its abstract bases).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lmcache_pd.keys import MMItems
from lmcache_pd.protocol import DisaggSpec


@dataclass(frozen=True, slots=True)
class SaveRequest:
    """Producer: after this step the KV of the prompt's first ``computed_end`` tokens is in the
    request's blocks: those it had, plus ``block_ids`` (or only ``block_ids`` if
    ``replace_blocks``, after a preemption). ``prompt`` is set on the request's first save only.
    ``cache_salt`` and ``lora`` (its LoRA adapter's name): the request's (vLLM's
    ``Request.cache_salt``, ``Request.lora_request``), part of its chunk keys; ``tags`` (its
    LMCache tags, ``KVTransferParams.tags``) and ``mm`` (its images, ``keys.MMItems``) too."""

    req_id: str
    spec: DisaggSpec
    prompt: list[int] | None
    block_ids: list[int]
    computed_end: int
    replace_blocks: bool = False
    cache_salt: str | None = None
    lora: str | None = None
    tags: tuple[tuple[str, str], ...] = ()
    mm: MMItems = ()


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """Consumer: fill ``block_ids`` with the KV of ``prompt[start:]``, pushed under
    ``disagg_req_id``, then report ``req_id`` as received. ``start`` is where decode's own
    prefix-cache hit ends: a block boundary, not necessarily a chunk boundary (the blocks of
    the prompt before it are decode's, shared with other requests, and never written).
    ``sync``: its chunks had all landed on every rank when vLLM scheduled it, so it is loaded
    before this step's forward pass, which computes its last token (vLLM's synchronous load),
    instead of in a step of its own. ``cache_salt``: the request's, part of its chunk keys, so
    that it never loads a chunk pushed for a request of another salt; ``lora`` alike, for
    another adapter or the base model, ``tags``, for other LMCache tags, and ``mm``, for
    other images in the same places. ``local``: decode
    serves the request alone and loads ``prompt`` (its tokens up to the end of the chunks it found
    landed) from chunks pushed for earlier requests, held under ``disagg_req_id`` for the load.
    ``held``: the leading tokens the DisaggSpec told prefill decode holds (its ``decode_holds``):
    the chunk that ends inside them may come as its tail alone (``worker.held_tail``)."""

    req_id: str
    disagg_req_id: str
    prompt: list[int]
    block_ids: list[int]
    start: int
    sync: bool = False
    cache_salt: str | None = None
    local: bool = False
    held: int = 0
    lora: str | None = None
    tags: tuple[tuple[str, str], ...] = ()
    mm: MMItems = ()


@dataclass(frozen=True, slots=True)
class KeepRequest:
    """Consumer: decode computed the KV of ``prompt`` (whole chunks, from ``start``, a chunk
    boundary) into ``block_ids`` for a request it serves alone; copy those chunks into its
    consumer's cache, beside the chunks pushed to it, so that a later request continuing the
    prompt loads them once vLLM has evicted the blocks (``landed_chunks.py``). ``cache_salt``,
    ``lora``, ``tags`` and ``mm``: the request's, part of its chunk keys."""

    req_id: str
    prompt: list[int]
    block_ids: list[int]
    start: int
    cache_salt: str | None = None
    lora: str | None = None
    tags: tuple[tuple[str, str], ...] = ()
    mm: MMItems = ()


@dataclass
class PDConnectorMetadata:
    """One step's saves (producer) or loads and keeps (consumer), the requests that finished,
    the producer's requests that finished before their prompt was computed (aborted), and the
    consumer's disaggregated requests that load nothing (``unneeded``, by ``disagg_req_id``:
    decode's own prefix cache had all of the prompt it would load). ``uncached``: of this
    step's loads and unneeded requests, by ``disagg_req_id``, those whose pushed chunks leave
    the consumer's cache when released instead of staying for later prompts (the request asked
    to keep nothing: ``lmcache.skip_save``, or a priority past ``priority_limit``)."""

    saves: list[SaveRequest] = field(default_factory=list)
    loads: list[LoadRequest] = field(default_factory=list)
    keeps: list[KeepRequest] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)
    unneeded: set[str] = field(default_factory=set)
    uncached: set[str] = field(default_factory=set)


@dataclass
class PushProgress:
    """Producer worker -> scheduler, every step: push jobs not finished yet. While any are,
    the scheduler asks vLLM to keep stepping (``has_pending_push_work``), so that the pushes'
    counters reach ``/metrics`` and nothing waits on an idle engine."""

    outstanding: int = 0

    def aggregate(self, other: PushProgress) -> PushProgress:
        return PushProgress(self.outstanding + other.outstanding)
