"""``LMCachePDConnector``, the class vLLM loads: a thin facade over the scheduler-side and
worker-side halves.

Load it with ``--kv-transfer-config '{"kv_connector": "LMCachePDConnector",
"kv_connector_module_path": "lmcache_pd.connector", "kv_role": "kv_producer",
"kv_load_failure_policy": "recompute", "kv_connector_extra_config": {"config_path": "..."}}'``.

vLLM makes one instance per process: role SCHEDULER in the engine core, role WORKER in each
worker. The facade builds the half of its role (producer or consumer, scheduler or worker) and
delegates every hook to it; the halves inherit "nothing to do" for hooks they do not use. The
time each hook holds vLLM's thread is counted (``model_thread_microseconds``,
``scheduler_thread_microseconds``): vLLM's step waits for it. Only
the worker half owns sockets, NIXL and buffers. Blocks are never held past a request's end: the
producer copies KV out of the paged cache during the step that computed it. Counters of either
half reach vLLM's own ``/metrics`` through the connector stats hooks (``stats.py``).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)

from lmcache_pd.auth import Role, load_keys
from lmcache_pd.compat import KVProfile
from lmcache_pd.config import CONFIG_PATH_ENV, PDConfig, load_config
from lmcache_pd.connector import kv_event_publisher
from lmcache_pd.connector.computed_prompts import ComputedPrompts
from lmcache_pd.connector.consumer_worker import ConsumerWorker
from lmcache_pd.connector.counters import StatsRecorder, holds_thread
from lmcache_pd.connector.landed_chunks import LandedChunks
from lmcache_pd.connector.landed_events import LandedEvents
from lmcache_pd.connector.metadata import PDConnectorMetadata, PushProgress
from lmcache_pd.connector.scheduler import ConsumerScheduler, ProducerScheduler, SchedulerHalf
from lmcache_pd.connector.stats import PDConnectorStats, PDPromMetrics
from lmcache_pd.connector.vllm_version import check_vllm_version
from lmcache_pd.connector.worker import CacheFacts, ProducerWorker, WorkerHalf
from lmcache_pd.errors import ConfigError
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.lmcache_config import CONNECTOR_NAME as LMCACHE_CONNECTOR
from lmcache_pd.lmcache_config import load_lmcache_config
from lmcache_pd.process_logs import show_our_logs
from lmcache_pd.tp_parts import TPLayout, route
from lmcache_pd.transfer import landed_board, landed_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import PromMetric, PromMetricT
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# The hooks vLLM's model-runner thread calls each step, and its scheduler's.
on_model_thread = holds_thread("model_thread_microseconds")
on_scheduler_thread = holds_thread("scheduler_thread_microseconds")

# metadata.py stays free of vLLM; to vLLM its classes are the kinds of metadata they carry.
KVConnectorMetadata.register(PDConnectorMetadata)
KVConnectorWorkerMetadata.register(PushProgress)


def connector_config(vllm_config: VllmConfig) -> PDConfig:
    """Our settings: the YAML named in ``kv_connector_extra_config.config_path`` (or
    ``$LMCACHE_PD_CONFIG``), with vLLM's ``kv_role`` taking precedence; or, where vLLM asks
    for us as ``LMCacheConnectorV1``, an LMCache PD deployment's own configuration
    (``lmcache_config.py``)."""
    transfer = vllm_config.kv_transfer_config
    role = transfer.kv_role
    if role not in ("kv_producer", "kv_consumer"):
        raise ConfigError(
            f"LMCachePDConnector needs kv_role kv_producer or kv_consumer, got {role}"
        )
    if transfer.kv_connector == LMCACHE_CONNECTOR:
        config = load_lmcache_config(transfer.kv_connector_extra_config or {}, role)
        if role == "kv_consumer" and transfer.kv_load_failure_policy != "recompute":
            # LMCache's connector computes what it cannot load, and their launchers leave
            # vLLM's policy at its default (fail): under that default decode would load no
            # landed chunks for the requests their proxy sends it bare. vLLM's scheduler reads
            # the policy after making this connector.
            logger.warning(
                "%s: kv_load_failure_policy %r set to recompute, as LMCache's connector does",
                LMCACHE_CONNECTOR,
                transfer.kv_load_failure_policy,
            )
            transfer.kv_load_failure_policy = "recompute"
        return config
    path = transfer.get_from_extra_config("config_path", None) or os.environ.get(CONFIG_PATH_ENV)
    return load_config(path, kv_role=role)


def kv_dtype_name(vllm_config: VllmConfig) -> str:
    """The KV cache's dtype as a plain name ("float32", "fp8_e4m3"...): part of every key."""
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype != "auto":
        return cache_dtype
    return str(vllm_config.model_config.dtype).removeprefix("torch.")


def chunk_keyer(vllm_config: VllmConfig, config: PDConfig, rank: int) -> ChunkKeyer:
    """Keys that differ wherever KV bytes would: model (as vLLM was given it), parallel
    layout, rank, KV dtype."""
    return ChunkKeyer(
        model_name=vllm_config.model_config.model,
        world_size=vllm_config.parallel_config.world_size,
        worker_id=rank,
        kv_dtype=kv_dtype_name(vllm_config),
        chunk_size=config.chunk_size,
    )


# vLLM's KV cache specs whose caches hold a prompt's tokens as the chunks move them.
SUPPORTED_LAYERS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})


def unsupported_layers(kv_cache_config: KVCacheConfig | None) -> str | None:
    """The kinds of KV cache spec among the model's layers that are not moved (sliding-window
    layers vLLM kept as such, chunked-local, Mamba...), comma-separated; None if none."""
    kinds: set[str] = set()
    for group in [] if kv_cache_config is None else kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        uniform = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
        kinds |= {type(one).__name__ for one in (uniform.values() if uniform else [spec])}
    return ",".join(sorted(kinds - SUPPORTED_LAYERS)) or None


def kv_profile(
    vllm_config: VllmConfig,
    config: PDConfig,
    rank: int,
    kv_cache_config: KVCacheConfig | None = None,
) -> KVProfile:
    """What a peer's KV must match to be loadable here, compared at handshake; the worker half
    completes it from the cache (chunk format, page bytes: ``worker.rank_profile``)."""
    parallel = vllm_config.parallel_config
    return KVProfile(
        chunk_size=config.chunk_size,
        page_bytes=config.page_bytes,
        model=vllm_config.model_config.model,  # as the chunk keys have it
        kv_dtype=kv_dtype_name(vllm_config),
        block_size=vllm_config.cache_config.block_size,
        tp_size=parallel.tensor_parallel_size,
        tp_rank=rank,
        kv_heads=kv_heads(vllm_config),
        pp_size=parallel.pipeline_parallel_size,
        unsupported_layers=unsupported_layers(kv_cache_config),
        prefill_tp_size=config.prefill_tp_size if config.kv_role == "kv_consumer" else None,
    )


def tp_layout(vllm_config: VllmConfig) -> TPLayout:
    """The model's KV heads and this instance's TP size: what the parts of a request's KV
    between prefill and decode at different TP sizes are worked out from."""
    return TPLayout(kv_heads(vllm_config), vllm_config.parallel_config.tensor_parallel_size)


def parts_per_chunk(layout: TPLayout, config: PDConfig) -> tuple[int, ...]:
    """How many parts each chunk arrives as on each decode rank, rank by rank (1 from a prefill
    at decode's TP size; where neither size divides the other, ranks differ: 6 heads from TP 2
    to 3 come as 1, 2 and 1 parts). ``ConfigError`` at start-up for a ``prefill_tp_size`` that
    cannot shard the model's heads evenly."""
    prefill_tp = config.prefill_tp_size
    if prefill_tp is None or prefill_tp == layout.tp_size:
        return (1,) * layout.tp_size
    try:
        parts = route(layout.kv_heads, prefill_tp, layout.tp_size)
    except ValueError as exc:
        raise ConfigError(f"prefill_tp_size {prefill_tp}: {exc}") from exc
    return tuple(sum(part.dest == rank for part in parts) for rank in range(layout.tp_size))


def kv_heads(vllm_config: VllmConfig) -> int:
    """The model's KV heads over all ranks, as its cache shards them; an MLA latent is one
    head that every rank holds alike."""
    model = vllm_config.model_config
    return 1 if model.use_mla else model.get_total_num_kv_heads()


def cache_facts(vllm_config: VllmConfig) -> CacheFacts:
    """What vLLM says of its cache: the block size, the physical order of a block's interior
    (its resolved layout: ``LBNHC``/``BLNHC`` put a token's heads together, NHD; the others
    HND), and whether its attention backend packs whole blocks (vLLM's CPU engine)."""
    from vllm.platforms import current_platform

    return CacheFacts(
        block_size=vllm_config.cache_config.block_size,
        physical_order=physical_order(vllm_config),
        packed_blocks=current_platform.is_cpu(),
    )


def physical_order(vllm_config: VllmConfig) -> str | None:
    """ "NHD" or "HND" from vLLM's resolved KV cache layout (vLLM 0.32:
    ``CacheConfig.get_resolved_kv_cache_layout``; older: ``get_kv_cache_layout``); None if this
    vLLM has neither or has not resolved it yet."""
    try:
        layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    except (AttributeError, ValueError):
        try:
            from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_cache_layout
        except ImportError:
            return None
        name = str(get_kv_cache_layout())
        return name if name in ("NHD", "HND") else None
    # Logical block axes (H, N) = (2, 3) in vLLM's [L, B, H, N, C]: whichever comes first in
    # memory is the outer one.
    order = layout.stride_order
    return "NHD" if order.index(3) < order.index(2) else "HND"


def loads_recompute(policy: str) -> bool:
    """Whether vLLM recomputes the tokens of a KV load that fails (``kv_load_failure_policy``);
    a decode instance whose policy fails the request instead (vLLM's default) is warned of at
    start-up, where an operator reads it."""
    if policy == "recompute":
        return True
    logger.warning(
        "kv_load_failure_policy is %r: a KV load that fails (a push lost, a chunk that fails "
        "its checksum) fails its request instead of recomputing it, and requests decode serves "
        'alone do not load landed chunks; set "kv_load_failure_policy": "recompute" in '
        "--kv-transfer-config",
        policy,
    )
    return False


class LMCachePDConnector(KVConnectorBase_V1):
    """Producer pushes prompt KV to the consumer its request names; consumer loads it."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._config = connector_config(vllm_config)
        check_vllm_version(vllm.__version__, self._config.allow_untested_vllm)
        show_our_logs(self._config.log_level)
        producer = self._config.kv_role == "kv_producer"
        side = Role.PRODUCER if producer else Role.CONSUMER  # not `role`: vLLM's, below
        # The worker half needs the paged cache: it is made in register_kv_caches.
        self._worker: WorkerHalf = WorkerHalf()
        self._scheduler: SchedulerHalf = SchedulerHalf()
        if role == KVConnectorRole.SCHEDULER:
            self._stats = StatsRecorder("scheduler")
            events = vllm_config.kv_events_config
            publishes = events is not None and events.enable_kv_cache_events
            if publishes:
                # Before vLLM's scheduler, which makes its publisher after this connector.
                endpoints = (events.endpoint, events.replay_endpoint)
                if kv_event_publisher.install(load_keys(self._config.secret_file, side), endpoints):
                    self._stats.set_gauge("kv_events_unauthenticated", 1)
            layout = tp_layout(vllm_config)
            parts = () if producer else parts_per_chunk(layout, self._config)
            # Chunks landed under keys of the instance's own ranks: not parts of another TP's.
            resharded = self._config.prefill_tp_size not in (None, layout.tp_size)
            landed = self._landed_chunks() if not producer and not resharded else None
            recomputes = producer or loads_recompute(
                vllm_config.kv_transfer_config.kv_load_failure_policy
            )
            self._scheduler = (
                ProducerScheduler(
                    self._stats.add,
                    load_keys(self._config.secret_file, side),
                    self._config.default_peer,
                )
                if producer
                else ConsumerScheduler(
                    self._stats.add,
                    chunk_size=self._config.chunk_size,
                    boards=[
                        self._board(rank) for rank in range(vllm_config.parallel_config.world_size)
                    ]
                    if self._config.sync_loads
                    else [],
                    parts_per_chunk=parts,
                    # A local load that fails must recompute, never fail a request that
                    # asked for no transfer (vLLM's default policy fails it).
                    landed_chunks=landed if recomputes else None,
                    landed=self._landed_events(landed) if publishes else None,
                    # Kept where later requests load them: the second tier, cached chunks.
                    computed=ComputedPrompts(self._config.chunk_size)
                    if landed is not None and recomputes and self._config.cache_share > 0
                    else None,
                    block_size=vllm_config.cache_config.block_size,
                    priority_limit=self._config.priority_limit,
                    landed_wait_s=self._config.landed_wait_s,
                )
            )
        else:
            from vllm.distributed.parallel_state import get_world_group

            self._rank = get_world_group().rank
            # Tensor parallelism: this rank's own receive ports, and the warm peers it pushes to.
            self._config = self._config.for_rank(self._rank)
            # Named by rank: gauges of several ranks are summed, not replaced.
            self._stats = StatsRecorder(f"rank{self._rank}")
        logger.info("LMCachePDConnector %s as %s", role.name, self._config.kv_role)

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Called once the paged cache exists: the worker half starts here, moving whole
        blocks (vLLM's CPU engine) or tokens (GPU layouts) as the cache is (``paged_kv.py``)."""
        keyer = chunk_keyer(self._vllm_config, self._config, self._rank)
        profile = kv_profile(self._vllm_config, self._config, self._rank, self._kv_cache_config)
        facts = cache_facts(self._vllm_config)
        layout = tp_layout(self._vllm_config)
        if self._config.kv_role == "kv_producer":
            self._worker = ProducerWorker(
                self._config, keyer, kv_caches, self._stats, profile, self._rank, facts, layout
            )
            return
        board = self._board(self._rank) if self._config.sync_loads else None
        self._worker = ConsumerWorker(
            self._config, keyer, kv_caches, self._stats, profile, self._rank, facts, board, layout
        )

    def _landed_events(self, landed: LandedChunks | None) -> LandedEvents | None:
        """Rank 0's landed chunks published as KV events (``landed_events.py``)."""
        return None if landed is None else LandedEvents(landed, self._config.num_pages)

    def _landed_chunks(self) -> LandedChunks | None:
        """What each consumer rank holds landed (``landed_chunks.py``), from the keys boards
        its consumer posts with its landed board (so only with ``sync_loads``)."""
        if not self._config.sync_loads:
            return None
        ranks = range(self._vllm_config.parallel_config.world_size)
        return LandedChunks(
            [chunk_keyer(self._vllm_config, self._config, rank) for rank in ranks],
            [landed_keys.keys_path(self._board(rank)) for rank in ranks],
        )

    def _board(self, rank: int) -> Path:
        """Where ``rank``'s consumer process posts landed chunks (``landed_board.py``)."""
        return landed_board.board_path(
            Path(envs.VLLM_RPC_BASE_PATH), self._vllm_config.instance_id, rank
        )

    @on_model_thread
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Consumer: do this step's synchronous loads (their KV has landed) and queue the
        others; they complete as their chunks land."""
        self._worker.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request, done in ``start_load_kv`` or asynchronously; nothing
        waits per layer."""

    @on_model_thread
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Consumer: blocks of this step's synchronous loads that failed; vLLM recomputes
        them (and drops what this step computed from them)."""
        return self._worker.load_errors()

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        """Nothing per layer: the whole step's KV is gathered in ``wait_for_save``."""

    @on_model_thread
    def wait_for_save(self) -> None:
        """Producer: copy out the chunks this step completed and queue their push."""
        self._worker.wait_for_save(self._meta())

    @on_model_thread
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Consumer: the loads that completed or failed since the last step."""
        received, failed = self._worker.finished_loads()
        return KVConnectorTransferResults(finished_recving=received, failed_recving=failed)

    def get_kv_connector_stats(self) -> PDConnectorStats | None:
        """This half's counters since the last call (either process; vLLM adds them up)."""
        taken = self._stats.take()
        return None if taken is None else PDConnectorStats(data=taken)

    def shutdown(self) -> None:
        self._worker.close()
        self._scheduler.close()

    def _meta(self) -> PDConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PDConnectorMetadata)
        return meta

    # ---- scheduler side ----

    def get_finished_count(self) -> int:
        """Every worker reports each load (received, and failed where it failed): vLLM counts a
        request received only once all ``world_size`` ranks have its KV, and failed if any one
        rank's load failed (``KVOutputAggregator``), so the request is then recomputed."""
        return self._vllm_config.parallel_config.world_size

    @on_scheduler_thread
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @on_scheduler_thread
    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @on_scheduler_thread
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    @on_scheduler_thread
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Never delays the free (the KV was copied out); returns ``first_tok`` if asked (a
        ``KVTransferReturn`` as a dict: vLLM passes it on in the response)."""
        return False, self._scheduler.request_finished(request)

    @on_scheduler_thread
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    @on_scheduler_thread
    def has_pending_push_work(self) -> bool:
        """Producer: pushes still running; vLLM keeps stepping (their counters flush)."""
        return self._scheduler.has_pending_push_work()

    @on_scheduler_thread
    def take_events(self) -> list[KVCacheEvent]:
        """Consumer: the chunks landed or gone since the last step, as KV events that vLLM
        publishes after its own (``landed_events.py``)."""
        return self._scheduler.take_events()

    @on_model_thread
    def build_connector_worker_meta(self) -> PushProgress | None:
        return self._worker.progress()

    # ---- metrics (API-server process) ----

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PDConnectorStats:
        return PDConnectorStats(data=data) if data is not None else PDConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PDPromMetrics:
        return PDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
