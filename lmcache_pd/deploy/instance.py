"""What one instance of a pools file runs, wherever it runs: its transfer settings (the YAML its
spec names, with its role's own on top), the ``--kv-transfer-config`` that loads our connector
with them, and the arguments and environment its vLLM gets. ``serve``'s launcher starts child
processes with these and ``lmcache-pd k8s`` writes them into pods, so that an instance is the
same instance whichever of them runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec
import yaml

from lmcache_pd.config import ENV_PREFIX, PDConfig
from lmcache_pd.deploy.pools import InstanceSpec, PoolsConfig
from lmcache_pd.errors import ConfigError
from lmcache_pd.proxy.config import KVEventsAddress

THREAD_CPUS_ENV = f"{ENV_PREFIX}THREAD_CPUS"  # read by the instance's transfer config

Role = Literal["kv_producer", "kv_consumer"]


def transfer_settings(
    pools: PoolsConfig, name: str, spec: InstanceSpec, role: Role, of_role: dict[str, Any]
) -> dict[str, Any]:
    """``spec.config`` with ``kv_role`` and ``of_role`` (a decode's receive ports, a prefill's
    warm peers) on top, the pools' ``chunk_size`` if they set one, and a decode's
    ``prefill_tp_size`` where the prefill pool's TP size differs from its own, checked as the
    connector will check it, so that a bad file fails here, naming instance ``name``, rather
    than minutes later inside vLLM."""
    try:
        settings = yaml.safe_load(Path(spec.config).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{name}: cannot read its config {spec.config}: {exc}") from exc
    if not isinstance(settings, dict):
        raise ConfigError(f"{name}: its config {spec.config} is not a mapping")
    settings |= {"kv_role": role, **of_role}
    if pools.chunk_size is not None:
        settings["chunk_size"] = pools.chunk_size
    prefill_tp = prefill_tp_size(pools)
    if role == "kv_consumer" and prefill_tp not in (None, spec.tensor_parallel_size):
        settings["prefill_tp_size"] = prefill_tp
    try:
        msgspec.convert(settings, PDConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{name}: invalid config {spec.config}: {exc}") from exc
    return settings


def prefill_tp_size(pools: PoolsConfig) -> int | None:
    """The prefill pool's TP size, which decode instances of another size take KV from in
    parts (``tp_parts.py``); None for a pool of mixed sizes (a decode then takes KV only from
    prefill instances of its own size: the others' are refused at handshake and recomputed)."""
    sizes = {spec.tensor_parallel_size for spec in pools.prefill}
    return sizes.pop() if len(sizes) == 1 else None


def connector_config(role: Role, config_path: str) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for our connector reading ``config_path``. A load that
    fails is recomputed, never an error to the client."""
    return {
        "kv_connector": "LMCachePDConnector",
        "kv_connector_module_path": "lmcache_pd.connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config_path": config_path},
    }


def instance_args(pools: PoolsConfig, spec: InstanceSpec) -> list[str]:
    """vLLM arguments after the engine's: the pool-wide ones, the instance's ranks, its own."""
    ranks = (
        ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
        if spec.tensor_parallel_size > 1
        else []
    )
    return [*pools.vllm_args, *ranks, *spec.vllm_args]


def instance_env(pools: PoolsConfig, spec: InstanceSpec) -> dict[str, str]:
    """The instance's environment on top of a vLLM server's: the CPU KV cache's size, where our
    threads run, its own."""
    threads = {} if spec.thread_cpus is None else {THREAD_CPUS_ENV: spec.thread_cpus}
    return {"VLLM_CPU_KVCACHE_SPACE": str(pools.kv_cache_gib), **threads, **spec.env}


def kv_events_args(address: KVEventsAddress) -> list[str]:
    """vLLM's ``--kv-events-config`` publishing the prefix cache's events where the proxy
    follows them (the connector makes the publisher's sockets authenticated ones:
    ``connector/kv_event_publisher.py``)."""
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": address.endpoint(address.port),
        "replay_endpoint": address.endpoint(address.replay_port),
    }
    return ["--kv-events-config", json.dumps(config)]
