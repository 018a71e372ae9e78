"""Scheduler-side halves of the connector: decide what to push or load, never touch KV.

Both run in vLLM's engine-core process and only describe work for the worker (see
``metadata.py``); they hold no sockets and no NIXL.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmcache_pd.connector.metadata import LoadRequest, PDConnectorMetadata, SaveRequest
from lmcache_pd.errors import ProtocolError
from lmcache_pd.protocol import DisaggSpec

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def disagg_spec_of(request: Request) -> DisaggSpec | None:
    """The request's DisaggSpec, None if it has none; a malformed one is logged and ignored
    (the request is then served without disaggregation, never with wrong KV)."""
    params = request.kv_transfer_params or {}
    raw = params.get("disagg_spec")
    if raw is None:
        return None
    try:
        return DisaggSpec.from_dict(raw)
    except ProtocolError as exc:
        logger.warning("req %s: ignoring kv_transfer_params: %s", request.request_id, exc)
        return None


@dataclass(slots=True)
class _Push:
    """A producer request whose prompt KV is being pushed as prefill goes."""

    spec: DisaggSpec
    prompt: list[int]
    block_ids: list[int]
    ret_first_tok: bool


class ProducerScheduler:
    """Tracks requests with a DisaggSpec and tells the worker how far their prefill got."""

    def __init__(self) -> None:
        self._pushes: dict[str, _Push] = {}

    def update_state_after_alloc(self, request: Request) -> None:
        spec = disagg_spec_of(request)
        if spec is not None and request.request_id not in self._pushes:
            params = request.kv_transfer_params or {}
            self._pushes[request.request_id] = _Push(
                spec, list(request.prompt_token_ids or []), [], bool(params.get("ret_first_tok"))
            )

    def build_connector_meta(self, output: SchedulerOutput) -> PDConnectorMetadata:
        meta = PDConnectorMetadata(finished=set(output.finished_req_ids) & set(self._pushes))
        scheduled = output.num_scheduled_tokens
        for new in output.scheduled_new_reqs:
            push = self._pushes.get(new.req_id)
            if push is not None:
                push.block_ids = list(new.block_ids[0])
                computed = new.num_computed_tokens + scheduled.get(new.req_id, 0)
                meta.saves.append(self._save(new.req_id, push, computed))
        cached = output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            push = self._pushes.get(req_id)
            if push is None:
                continue
            new_blocks = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:  # after preemption: a fresh set of blocks
                push.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                push.block_ids.extend(new_blocks[0])
            computed = cached.num_computed_tokens[index] + scheduled.get(req_id, 0)
            if computed <= len(push.prompt) or req_id in cached.resumed_req_ids:
                meta.saves.append(self._save(req_id, push, computed))
        return meta

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Blocks are freed at once: the worker copied the KV out during the step."""
        push = self._pushes.pop(request.request_id, None)
        if push is None or not push.ret_first_tok or not request.output_token_ids:
            return None
        return {"first_tok": int(request.output_token_ids[0]), "disagg_req_id": push.spec.req_id}

    @staticmethod
    def _save(req_id: str, push: _Push, computed: int) -> SaveRequest:
        return SaveRequest(
            req_id, push.spec, push.prompt, list(push.block_ids), min(computed, len(push.prompt))
        )


class ConsumerScheduler:
    """Announces a disaggregated request's prompt KV as an asynchronous external hit."""

    def __init__(self, chunk_size: int) -> None:
        self._chunk_size = chunk_size
        self._loads: list[LoadRequest] = []
        # Requests whose load failed: vLLM asks again before recomputing, and must hear "none".
        self._failed: set[str] = set()

    def get_num_new_matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        """All of the prompt but its last token (the producer's first output, computed here),
        if loading starts on a chunk boundary; else nothing and the prompt is computed."""
        spec = disagg_spec_of(request)
        if spec is None or num_computed % self._chunk_size or request.request_id in self._failed:
            return 0, False
        external = len(request.prompt_token_ids or []) - 1 - num_computed
        return (external, True) if external > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        spec = disagg_spec_of(request)
        if spec is None or num_external_tokens <= 0:
            return
        prompt = list(request.prompt_token_ids or [])[:-1]
        start = len(prompt) - num_external_tokens
        self._loads.append(
            LoadRequest(
                request.request_id, spec.req_id, prompt, list(blocks.get_block_ids()[0]), start
            )
        )

    def build_connector_meta(self, output: SchedulerOutput) -> PDConnectorMetadata:
        meta = PDConnectorMetadata(loads=self._loads, finished=set(output.finished_req_ids))
        self._loads = []
        return meta

    def update_connector_output(self, failed_recving: set[str]) -> None:
        """Remember failed loads, so that their prompts are computed instead of awaited again."""
        self._failed |= failed_recving

    def request_finished(self, request: Request) -> None:
        self._failed.discard(request.request_id)
