"""Scheduler-side halves of the connector: decide what to push or load, never touch KV.

Both run in vLLM's engine-core process and only describe work for the worker (see
``metadata.py``); they hold no NIXL. The producer's half holds one socket per proxy that asks
for first-token notices (``first_token.py``), which it sends without blocking.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.v1.request import RequestStatus

from lmcache_pd.auth import DeploymentKeys
from lmcache_pd.connector.adapter_identity import AdapterIdentities, AdapterState
from lmcache_pd.connector.metadata import (
    LoadRequest,
    PDConnectorMetadata,
    PushProgress,
    SaveRequest,
)
from lmcache_pd.errors import ProtocolError
from lmcache_pd.first_token import FirstTokenNotice, NoticeSender
from lmcache_pd.keys import MMItems
from lmcache_pd.peers import peer_spec
from lmcache_pd.protocol import NOTICE_KEY, DisaggSpec, KVTransferParams, KVTransferReturn
from lmcache_pd.transfer import landed_board

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from lmcache_pd.connector.computed_prompts import ComputedPrompts
    from lmcache_pd.connector.landed_chunks import LandedChunks
    from lmcache_pd.connector.landed_events import LandedEvents

logger = logging.getLogger(__name__)


def not_shared(count: Callable[[str], None], request: Request) -> None:
    """Count and log a request whose adapter's files could not be read for its chunk keys: it
    is served without disaggregation (``adapter_identity.py``)."""
    count("adapters_unreadable")
    logger.warning(
        "req %s: LoRA adapter %s unreadable for its chunk keys; served without disaggregation",
        request.request_id,
        request.lora_request.lora_path,
    )


def mm_items(request: Request) -> MMItems:
    """The request's multimodal items (images) at their placeholder positions, by vLLM's hash of
    each (``MultiModalFeatureSpec.identifier``): part of its chunk keys, as they are of vLLM's
    own prefix-cache keys. Prefill and decode hash an image alike when they serve the model
    under the same name."""
    features = getattr(request, "mm_features", None) or ()
    return tuple(
        sorted((f.mm_position.offset, f.mm_position.length, f.identifier) for f in features)
    )


class ParamsDoor:
    """Each request's ``kv_transfer_params``, decoded once, at the first hook that sees it.

    The value comes from a client's JSON (through the proxy, or straight to an instance's HTTP
    port, or smuggled in ``vllm_xargs``) and arrives in hooks that run inside vLLM's scheduler,
    where any exception ends the engine and every request on it. So a value of any type or
    shape is read here and nowhere else: one that is unusable is logged with the request id,
    counted (``bad_transfer_params``), and the request is served without disaggregation
    (prefill computes it and pushes nothing; decode recomputes the prompt), never with wrong
    KV. Owned by the scheduler thread, like the half that holds it."""

    def __init__(self, count: Callable[[str], None]) -> None:
        self._count = count
        self._params: dict[str, KVTransferParams] = {}

    def of(self, request: Request) -> KVTransferParams:
        params = self._params.get(request.request_id)
        if params is None:
            params = self._params[request.request_id] = self._decode(request)
        return params

    def forget(self, request_id: str) -> None:
        """The request ended (``request_finished``)."""
        self._params.pop(request_id, None)

    def refuse_notices(self, request: Request, reason: str) -> KVTransferParams:
        """The request's params with no first-token notice (its address is unusable)."""
        self._bad(request.request_id, reason)
        params = msgspec.structs.replace(self.of(request), first_tok_to=None)
        self._params[request.request_id] = params
        return params

    def _decode(self, request: Request) -> KVTransferParams:
        raw = request.kv_transfer_params
        try:
            params = KVTransferParams.from_dict(raw)
        except ProtocolError as exc:
            self._bad(request.request_id, f"ignoring kv_transfer_params: {exc}")
            return KVTransferParams()
        if KVTransferParams.notice_address_refused(raw):
            self._bad(request.request_id, f"ignoring {NOTICE_KEY} (not tcp://host:port)")
        return params

    def _bad(self, request_id: str, reason: str) -> None:
        self._count("bad_transfer_params")
        logger.warning("req %s: %s", request_id, reason)


class SchedulerHalf:
    """What the facade asks of a scheduler-side half; a role does what its half needs and
    inherits "nothing to do" for the rest."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed: int
    ) -> tuple[int | None, bool]:
        """None: ask again next step (the request is not scheduled meanwhile)."""
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, output: SchedulerOutput) -> PDConnectorMetadata:
        return PDConnectorMetadata()

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Called once per request as it ends; what it returns goes back to the client as the
        response's ``kv_transfer_params`` (a ``KVTransferReturn``'s JSON object)."""
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        return None

    def has_pending_push_work(self) -> bool:
        return False

    def take_events(self) -> list[KVCacheEvent]:
        """KV events of what this half knows besides vLLM's prefix cache."""
        return []

    def close(self) -> None:
        return None


@dataclass(slots=True)
class _Push:
    """A producer request whose prompt KV is being pushed as prefill goes."""

    spec: DisaggSpec
    prompt: list[int]
    ret_first_tok: bool
    notice_to: str | None  # the proxy that wants the first token from the engine at once
    cache_salt: str | None  # the request's, part of its chunk keys
    lora: str | None  # its LoRA adapter's name, path and digest, part of its chunk keys too
    tags: tuple[tuple[str, str], ...] = ()  # its LMCache tags, part of its chunk keys too
    mm: MMItems = ()  # its images at their positions, part of its chunk keys too
    announced: bool = False  # the worker has had the prompt


class ProducerScheduler(SchedulerHalf):
    """Tracks requests with a DisaggSpec and tells the worker how far their prefill got."""

    def __init__(
        self,
        count: Callable[[str], None] = lambda _: None,
        keys: DeploymentKeys | None = None,
        default_peer: str | None = None,
        adapters: AdapterIdentities | None = None,
    ) -> None:
        """``count`` takes the name of a counter to bump (``StatsRecorder.add``); ``keys``
        authenticate first-token notices to the proxy (``auth.py``); ``default_peer``: where a
        request that names no DisaggSpec is pushed (``PDConfig.default_peer``; None: nowhere);
        ``adapters``: LoRA adapters' identities (None: its own), closed with this half."""
        self._count = count
        self._adapters = adapters or AdapterIdentities()
        self._door = ParamsDoor(count)
        self._default_peer = default_peer
        self._pushes: dict[str, _Push] = {}
        # Ended since the last step's metadata (vLLM calls request_finished before it lists the
        # request in a step's finished_req_ids): the worker forgets them, or tells their
        # consumer if they were aborted.
        self._ended: set[str] = set()
        self._aborted: set[str] = set()
        # Push jobs the worker has not finished, as of its last report (or this step's saves).
        self._outstanding = 0
        self._notices = NoticeSender(keys)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed: int
    ) -> tuple[int | None, bool]:
        """Nothing to load; None (ask again next step) while the files of the request's LoRA
        adapter are read for the keys its chunks are pushed under."""
        return (None if self._adapters.of(request) is AdapterState.PENDING else 0), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if request.request_id in self._pushes:
            return
        params = self._door.of(request)
        spec = params.disagg_spec or self._to_default_peer(request)
        if spec is None:
            return
        adapter = self._adapters.of(request)
        if isinstance(adapter, AdapterState):  # its decode computes the prompt: none of this KV
            not_shared(self._count, request)
            return
        if params.first_tok_to is not None and not self._notices.connect(params.first_tok_to):
            params = self._door.refuse_notices(request, f"ZMQ refuses {NOTICE_KEY}")
        self._pushes[request.request_id] = _Push(
            spec,
            list(request.prompt_token_ids or []),
            params.ret_first_tok,
            params.first_tok_to,
            request.cache_salt,
            adapter,
            params.tags,
            mm_items(request),
        )

    def _to_default_peer(self, request: Request) -> DisaggSpec | None:
        """LMCache's 1p1d shape: a request that names no consumer is pushed to the configured
        peer, under a req_id of our own (its proxy names none); None without a peer."""
        if self._default_peer is None:
            return None
        spec = peer_spec(self._default_peer, f"peer-{secrets.token_hex(8)}")
        logger.debug(
            "req %s: no disagg_spec, pushed to %s as %s",
            request.request_id,
            self._default_peer,
            spec.req_id,
        )
        return spec

    def build_connector_meta(self, output: SchedulerOutput) -> PDConnectorMetadata:
        meta = PDConnectorMetadata(finished=self._ended, aborted=self._aborted)
        self._ended, self._aborted = set(), set()
        scheduled = output.num_scheduled_tokens
        for new in output.scheduled_new_reqs:
            push = self._pushes.get(new.req_id)
            if push is not None:
                computed = new.num_computed_tokens + scheduled.get(new.req_id, 0)
                meta.saves.append(self._save(new.req_id, push, new.block_ids[0], computed, True))
        cached = output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            push = self._pushes.get(req_id)
            if push is None:
                continue
            new_blocks = cached.new_block_ids[index]
            resumed = req_id in cached.resumed_req_ids  # after preemption: a fresh set of blocks
            computed = cached.num_computed_tokens[index] + scheduled.get(req_id, 0)
            if computed <= len(push.prompt) or resumed:
                blocks = new_blocks[0] if new_blocks else []
                meta.saves.append(self._save(req_id, push, blocks, computed, resumed))
        # The worker may queue pushes in this step: step on until it reports them done.
        self._outstanding += len(meta.saves) + len(meta.aborted)
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        progress = output.kv_connector_worker_meta
        if isinstance(progress, PushProgress):
            self._outstanding = progress.outstanding

    def has_pending_push_work(self) -> bool:
        return self._outstanding > 0

    def close(self) -> None:
        self._notices.close()
        self._adapters.close()

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Blocks are freed at once: the worker copied the KV out during the step. A request
        that ends before its prompt was computed (aborted) is reported to the worker, which
        tells its consumer not to wait."""
        self._door.forget(request.request_id)
        push = self._pushes.pop(request.request_id, None)
        if push is None:
            return None
        self._ended.add(request.request_id)
        if request.num_computed_tokens < len(push.prompt):
            self._aborted.add(request.request_id)
        if not request.output_token_ids:
            return None
        first = int(request.output_token_ids[0])
        if push.notice_to is not None and request.status == RequestStatus.FINISHED_LENGTH_CAPPED:
            # Stopped by its token limit, not by EOS: decode goes on from this token.
            self._notices.send(
                push.notice_to, FirstTokenNotice(push.spec.req_id, push.prompt, first)
            )
        if not push.ret_first_tok:
            return None
        return KVTransferReturn(first_tok=first, disagg_req_id=push.spec.req_id).to_dict()

    @staticmethod
    def _save(
        req_id: str, push: _Push, blocks: Sequence[int], computed: int, replace: bool
    ) -> SaveRequest:
        prompt = None if push.announced else push.prompt
        push.announced = True
        return SaveRequest(
            req_id,
            push.spec,
            prompt,
            list(blocks),
            min(computed, len(push.prompt)),
            replace_blocks=replace,
            cache_salt=push.cache_salt,
            lora=push.lora,
            tags=push.tags,
            mm=push.mm,
        )


class ConsumerScheduler(SchedulerHalf):
    """Announces a disaggregated request's prompt KV, past decode's own prefix-cache hit, as an
    external hit: synchronous if its chunks have all landed on every rank already (it is then
    loaded before the step that computes its last token), else asynchronous (vLLM schedules it
    once its load is done, a step later at least)."""

    def __init__(
        self,
        count: Callable[[str], None] = lambda _: None,
        *,
        chunk_size: int = 256,
        boards: Sequence[Path] = (),
        parts_per_chunk: Sequence[int] = (),
        landed_chunks: LandedChunks | None = None,
        landed: LandedEvents | None = None,
        computed: ComputedPrompts | None = None,
        block_size: int | None = None,
        priority_limit: int | None = None,
        landed_wait_s: float = 0.0,
        adapters: AdapterIdentities | None = None,
    ) -> None:
        """``count`` takes the name of a counter to bump (``StatsRecorder.add``); ``boards``:
        each consumer rank's ``landed_board``, on every one of which a request's chunks must
        all be posted landed for it to be loaded synchronously (none: every load
        asynchronous); ``parts_per_chunk``: what each chunk arrives as on each rank, rank by
        rank (several parts from a prefill of another TP size, and not as many on every rank
        where neither size divides the other, ``tp_parts.py``; none given: one part on every
        rank); ``landed_chunks``: what the
        consumer ranks hold landed, which requests served alone load past decode's own prefix
        cache hit (None: they do not); ``landed``: publishes those chunks as KV events (None:
        they are not published); ``computed``: the prompts of requests served alone, whose
        chunks the worker keeps in the consumer's cache once computed (None: it does not);
        ``block_size``: vLLM's, where a hold that ends inside a chunk may end on a block (None:
        a hold counts in whole chunks); ``priority_limit``: requests of a priority above it keep
        nothing in the consumer's cache (``_keeps``; None: no limit); ``landed_wait_s``: how
        long a request that names no transfer parameters waits for its prompt's chunks to show
        landed (``_awaits_landing``; 0: not at all); ``adapters``: LoRA adapters' identities
        (None: its own), closed with this half."""
        self._count = count
        self._adapters = adapters or AdapterIdentities()
        self._door = ParamsDoor(count)
        self._chunk_size = chunk_size
        self._parts = tuple(parts_per_chunk) or (1,) * len(boards)
        if len(self._parts) != len(boards) and boards:
            raise ValueError(f"parts for {len(self._parts)} ranks, boards for {len(boards)}")
        # Each maps its board once the consumer process made it; a read is memory reads only.
        self._boards = [landed_board.BoardReader(board) for board in boards]
        # Whether each request's load is synchronous, as answered in get_num_new_matched_tokens
        # (the boards may change before update_state_after_alloc in the same pass).
        self._sync: dict[str, bool] = {}
        self._loads: list[LoadRequest] = []
        self._unneeded: set[str] = set()
        # Requests whose KV was loaded once (or failed to load, or was not needed): vLLM asks
        # again after a failed load or a preemption, and must not wait for the pushed chunks
        # again: they are released by then (to the consumer's cache, from which a preempted
        # request reloads what is still there, ``_reload``).
        self._loaded: set[str] = set()
        # Per request reloaded after a preemption, its preemptions then: one reload each, so
        # that a reload that failed is computed, not tried again.
        self._reloaded: dict[str, int] = {}
        self._landed_chunks = landed_chunks
        self._landed = landed
        self._computed = computed
        self._block_size = block_size
        self._priority_limit = priority_limit
        # Of this step's loads and unneeded requests, those whose chunks leave the consumer's
        # cache when released (by disagg_req_id).
        self._uncached: set[str] = set()
        # Per request served alone with chunks landed here past its prefix-cache hit, where
        # their run ends (the answer of get_num_new_matched_tokens, used once its blocks are).
        self._local: dict[str, int] = {}
        # Names of local loads' holds on the consumers: unique across this scheduler's life.
        self._local_ids = (f"local-{secrets.token_hex(4)}-{n}" for n in itertools.count())
        self._landed_wait_s = landed_wait_s
        self._waited: set[str] = set()  # requests counted in landed_waits

    def take_events(self) -> list[KVCacheEvent]:
        return [] if self._landed is None else self._landed.take()

    def close(self) -> None:
        if self._landed_chunks is not None:
            self._landed_chunks.close()
        if self._landed is not None:
            self._landed.close()
        self._adapters.close()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed: int
    ) -> tuple[int | None, bool]:
        """All of the prompt past decode's own hit (``num_computed``, which vLLM ends on a block
        boundary) but its last token, computed here: the client's prompt's last (a request that
        names ``first_tok``: its whole prompt's KV was pushed, and the last token's is loaded
        too, then computed again) or, for a prompt the proxy made of the client's and prefill's
        first token, that token. A hit that ends inside a chunk is fine: only that chunk's
        later blocks are loaded. None (ask again next step) while the files of the request's
        LoRA adapter are read for its chunk keys; nothing if they could not be."""
        adapter = self._adapters.of(request)
        if adapter is AdapterState.PENDING:
            return None, False
        if adapter is AdapterState.UNREADABLE:
            if request.request_id not in self._loaded:
                not_shared(self._count, request)
            return 0, False
        spec = self._door.of(request).disagg_spec
        if request.request_id in self._loaded:
            return self._reload(request, num_computed), False
        if spec is None:
            hit = self._local_hit(request, num_computed)
            return (None if self._awaits_landing(request, num_computed + hit) else hit), False
        external = len(request.prompt_token_ids or []) - 1 - num_computed
        if external <= 0:
            return 0, False
        skipped = self._skipped(spec)
        if num_computed < skipped:
            # Prefill did not push what the proxy saw this cache hold (its whole chunks, and
            # the head of a chunk whose tail alone it pushed); some is gone since (evicted): it
            # will never come, so the prompt is computed here.
            self._count("held_prefix_lost")
            logger.warning(
                "req %s (%s): prefill skipped %d tokens this cache held, %d still held; "
                "computing the prompt",
                request.request_id,
                spec.req_id,
                skipped,
                num_computed,
            )
            return 0, False
        sync = self._all_landed(spec, len(self._pushed_prompt(request)))
        self._sync[request.request_id] = sync
        return external, not sync

    def _pushed_prompt(self, request: Request) -> list[int]:
        """The tokens whose KV prefill pushed for ``request``: its whole prompt where it is the
        client's own (it names ``first_tok``), else all of it but the first token the proxy
        appended."""
        prompt = list(request.prompt_token_ids or [])
        return prompt if self._door.of(request).first_tok is not None else prompt[:-1]

    def _skipped(self, spec: DisaggSpec) -> int:
        """The leading tokens prefill does not push: the whole chunks decode holds, and where
        its hold ends on a block inside a chunk, that chunk's head (its tail alone comes,
        ``worker.held_tail``; a GPU cache, which takes the whole chunk, is held to it too)."""
        held = spec.decode_holds
        if self._block_size is not None and held % self._block_size == 0:
            return held
        return spec.skipped_tokens(self._chunk_size)

    def _reload(self, request: Request, num_computed: int) -> int:
        """A request back after its load: after a failed one, nothing (it is computed); after
        a preemption (vLLM freed its blocks), what its consumer still holds of it, loaded
        again as a request served alone loads landed chunks, once per preemption."""
        return self._local_hit(request, num_computed) if self._preempted_again(request) else 0

    def _preempted_again(self, request: Request) -> bool:
        """Whether vLLM preempted ``request`` since its load, or since its last reload."""
        return request.num_preemptions > self._reloaded.get(request.request_id, 0)

    def _local_hit(self, request: Request, num_computed: int) -> int:
        """Tokens past ``num_computed`` that a request served alone, or preempted, loads from
        chunks landed on every rank (0: none); always a synchronous load (they are here)."""
        if self._landed_chunks is None or self._door.of(request).tags:
            # LandedChunks keys no LMCache tags (yet): a tagged request finds nothing there.
            return 0
        prompt = list(request.prompt_token_ids or [])[:-1]  # its last token is computed here
        end = self._landed_chunks.landed_run(
            request.request_id,
            prompt,
            request.cache_salt,
            num_computed,
            self._adapter(request),
            mm_items(request),
        )
        if end <= num_computed:
            self._local.pop(request.request_id, None)
            return 0
        self._local[request.request_id] = end
        return end - num_computed

    def _awaits_landing(self, request: Request, reached: int) -> bool:
        """Whether a request that names no transfer parameters, its chunks landed up to token
        ``reached`` of its prompt, waits (vLLM asks again next step) for the rest to show: until
        ``landed_wait_s`` after it arrived. LMCache's proxy asks decode so once prefill said
        the KV landed, and the keys board that shows it here lags a landing (up to
        ``landed_keys.POST_INTERVAL_S``)."""
        if self._landed_wait_s <= 0 or self._landed_chunks is None:
            return False
        if reached >= len(request.prompt_token_ids or []) - 1:
            return False
        if time.time() - getattr(request, "arrival_time", 0.0) >= self._landed_wait_s:
            return False
        if request.request_id not in self._waited:
            self._waited.add(request.request_id)
            self._count("landed_waits")
        return True

    def _all_landed(self, spec: DisaggSpec, kv_tokens: int) -> bool:
        """Whether every rank posted every chunk the producer pushes of its prompt
        (``kv_tokens``: ``_pushed_prompt``'s length; less the chunks it skipped) landed."""
        pushed = -(-kv_tokens // self._chunk_size) - spec.skipped_tokens(self._chunk_size) // (
            self._chunk_size
        )
        return bool(self._boards) and all(
            board.read().get(spec.req_id, 0) >= pushed * parts
            for board, parts in zip(self._boards, self._parts, strict=True)
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = self._door.of(request)
        spec, keeps = params.disagg_spec, self._keeps(request)
        if request.request_id in self._loaded:
            if self._preempted_again(request):
                self._after_preemption(request, blocks, num_external_tokens)
        elif spec is None:
            self._load_local(request, blocks, num_external_tokens)
        if spec is None:
            adapter = self._adapters.of(request)
            if self._computed is not None and keeps and not isinstance(adapter, AdapterState):
                self._computed.track(
                    request.request_id,
                    list(request.prompt_token_ids or []),
                    request.cache_salt,
                    adapter,
                    params.tags,
                    mm_items(request),
                )
            return
        if request.request_id in self._loaded:
            return
        self._loaded.add(request.request_id)
        if num_external_tokens <= 0:
            # Decode had the prompt's KV itself: the pushed chunks go back now, and later
            # pushes for it are refused, instead of held until the claim timeout.
            self._unneeded.add(spec.req_id)
            if not keeps:
                self._uncached.add(spec.req_id)
            return
        prompt = self._pushed_prompt(request)
        start = len(request.prompt_token_ids or []) - 1 - num_external_tokens
        if not keeps:
            self._uncached.add(spec.req_id)
        elif self._landed is not None and not self._keyed_past_the_proxy(request):
            # Published under the proxy's keys, which know no adapter, no LMCache tag and no
            # image.
            self._landed.learn(prompt, request.cache_salt)
        sync = self._sync.pop(request.request_id, False)
        block_ids = list(blocks.get_block_ids()[0])
        self._loads.append(
            LoadRequest(
                request.request_id,
                spec.req_id,
                prompt,
                block_ids,
                start,
                sync=sync,
                cache_salt=request.cache_salt,
                held=spec.decode_holds,
                lora=self._adapter(request),
                tags=params.tags,
                mm=mm_items(request),
            )
        )

    def _keyed_past_the_proxy(self, request: Request) -> bool:
        """Whether ``request``'s chunk keys hold what the proxy's block keys cannot (a LoRA
        adapter, LMCache tags, images): its chunks are not published to the proxy."""
        return bool(self._adapter(request) or self._door.of(request).tags or mm_items(request))

    def _adapter(self, request: Request) -> str | None:
        """``request``'s adapter where it loads KV: ``get_num_new_matched_tokens`` found it
        none, or its name, path and digest (a request of an adapter in any other state loads
        nothing). Asked in the same scheduling pass as that, with no other request's adapter
        read between: its answer stands."""
        adapter = self._adapters.of(request)
        assert not isinstance(adapter, AdapterState), (request.request_id, adapter)
        return adapter

    def _keeps(self, request: Request) -> bool:
        """Whether ``request``'s KV stays in the consumer's cache for later prompts: not if it
        asks to keep nothing (``lmcache.skip_save``) or its priority is past the limit (as
        LMCache's ``priority_limit``: vLLM serves lower values first)."""
        if self._door.of(request).skip_save:
            return False
        limit = self._priority_limit
        return limit is None or getattr(request, "priority", 0) <= limit

    def _after_preemption(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """A request loaded before and preempted since is scheduled again: reloaded from what
        ``_reload`` found, or computed."""
        self._reloaded[request.request_id] = request.num_preemptions
        reloaded = self._load_local(request, blocks, num_external_tokens)
        self._count("preemption_reloads" if reloaded else "preemption_recomputes")
        logger.info(
            "req %s: preempted after loading its KV; %s",
            request.request_id,
            f"{num_external_tokens} tokens loaded again" if reloaded else "computing its prompt",
        )

    def _load_local(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> bool:
        """Load a request served alone, or preempted, from the chunks ``_local_hit`` found
        landed; whether it is loaded."""
        end = self._local.pop(request.request_id, None)
        if end is None or num_external_tokens <= 0:
            return False
        self._loaded.add(request.request_id)
        self._count("loads_local")
        self._loads.append(
            LoadRequest(
                request.request_id,
                next(self._local_ids),
                list(request.prompt_token_ids or [])[:end],
                list(blocks.get_block_ids()[0]),
                end - num_external_tokens,
                sync=True,
                cache_salt=request.cache_salt,
                local=True,
                lora=self._adapter(request),
                tags=self._door.of(request).tags,
                mm=mm_items(request),
            )
        )
        return True

    def build_connector_meta(self, output: SchedulerOutput) -> PDConnectorMetadata:
        meta = PDConnectorMetadata(
            loads=self._loads,
            finished=set(output.finished_req_ids),
            unneeded=self._unneeded,
            uncached=self._uncached,
        )
        self._loads, self._unneeded, self._uncached = [], set(), set()
        if self._computed is not None:
            meta.keeps = self._computed.keeps(output)
            if self._landed is not None:
                for keep in meta.keeps:  # published once they land, under the proxy's keys
                    if keep.lora is None and not keep.tags and not keep.mm:  # which know none
                        self._landed.learn(keep.prompt, keep.cache_salt)
        return meta

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        self._door.forget(request.request_id)
        self._loaded.discard(request.request_id)
        self._reloaded.pop(request.request_id, None)
        self._sync.pop(request.request_id, None)
        self._local.pop(request.request_id, None)
        self._waited.discard(request.request_id)
        if self._landed_chunks is not None:
            self._landed_chunks.forget(request.request_id)
        if self._computed is not None:
            self._computed.forget(request.request_id)
        return None
