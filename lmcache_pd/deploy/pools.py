"""The pools file: which prefill and decode instances ``lmcache-pd serve`` runs, on which engine,
and what the proxy in front of them is told.

One schema for every engine: the embedded launcher (``engine: local``, one host, child
processes), Ray (``engine: ray``, instances as actors placed on the cluster's nodes) and the
Kubernetes manifests ``lmcache-pd k8s`` writes from the same file. Validated by msgspec: unknown
keys, wrong types and bad ranges are refused with the key's name before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml

from lmcache_pd.affinity import CPU_LIST
from lmcache_pd.deploy.vllm_server import TINY_MODEL_ARGS
from lmcache_pd.errors import ConfigError
from lmcache_pd.protocol import MAX_TP_RANKS, Port
from lmcache_pd.proxy.config import MAX_IN_FLIGHT, MIN_DISAGG_TOKENS

Seconds = Annotated[float, msgspec.Meta(gt=0, le=3600)]


class InstanceSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One vLLM instance of a pool."""

    # lmcache-pd transfer config (producer or consumer YAML); ports in it are replaced.
    config: str
    # Cores for vLLM's CPU threads (VLLM_CPU_OMP_THREADS_BIND), e.g. "0" or "2-3"; with
    # tensor parallelism one set per rank, separated by "|" (e.g. "0|1").
    cpus: str | None = None
    # Ranks of this instance (``--tensor-parallel-size``). A decode instance gets a pair of KV
    # receive ports per rank; each prefill rank pushes its shard to the decode rank of its index.
    tensor_parallel_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_RANKS)] = 1
    # Cores for lmcache-pd's own threads in it (its transfer config's ``thread_cpus``), e.g. a
    # core outside ``cpus``: on a host without spare cores, decode's rather than prefill's.
    thread_cpus: Annotated[str, msgspec.Meta(pattern=f"^{CPU_LIST.pattern}$")] | None = None
    # Cores for every process of it (None: any), its API server and engine core too: vLLM's
    # engine core spins between steps, and on a host without spare cores, left anywhere, it
    # takes time from the other instance's inference (``cpus``, within these, stays vLLM's).
    process_cpus: Annotated[str, msgspec.Meta(pattern=f"^{CPU_LIST.pattern}$")] | None = None
    port: int | None = None
    env: dict[str, str] = msgspec.field(default_factory=dict)
    # Arguments for this instance only, after the pool-wide ``vllm_args``.
    vllm_args: list[str] = msgspec.field(default_factory=list)
    # What the instance reserves on a cluster engine (Ray's actor resources, Kubernetes'
    # requests): cores (None: one per rank) and memory (None: none reserved).
    num_cpus: Annotated[float, msgspec.Meta(gt=0)] | None = None
    memory_gib: Annotated[float, msgspec.Meta(gt=0)] | None = None
    # Ray only: custom resources a node must offer (``ray start --resources``) and node labels
    # it must carry (``ray start --labels``); together they say on which nodes it may run.
    ray_resources: dict[str, Annotated[float, msgspec.Meta(gt=0)]] = msgspec.field(
        default_factory=dict
    )
    ray_labels: dict[str, str] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.cpus is not None and self.cpus.count("|") + 1 != self.tensor_parallel_size:
            raise ValueError(
                f"cpus {self.cpus!r} gives {self.cpus.count('|') + 1} rank(s) cores, "
                f"tensor_parallel_size is {self.tensor_parallel_size} (one set per rank, "
                f'separated by "|", e.g. "0|1")'
            )

    @property
    def cores(self) -> float:
        """Cores it reserves on a cluster engine."""
        return self.num_cpus if self.num_cpus is not None else float(self.tensor_parallel_size)


class ProxySpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: int = 8000
    decode_read_timeout_s: float = 120.0
    # Prompts shorter than this go to decode alone (0: every prompt is disaggregated).
    min_disagg_tokens: Annotated[int, msgspec.Meta(ge=0)] = MIN_DISAGG_TOKENS
    # "kv": route by what each instance's prefix cache holds (every instance publishes its KV
    # events to the proxy); "load": least outstanding requests; "cache_aware": vLLM's own router
    # policy, for comparison. See ``ProxyConfig.routing``.
    routing: Literal["kv", "load", "cache_aware"] = "kv"
    # CPUs the proxy runs on (None: any); see ``ProxyConfig.cpus``.
    cpus: Annotated[str, msgspec.Meta(pattern=f"^{CPU_LIST.pattern}$")] | None = None
    # Decode asked on prefill's first-token notice; see ``ProxyConfig.first_token_notices``.
    first_token_notices: bool = True
    # A file holding the key clients must send (None: none, unless the environment names one);
    # see ``ProxyConfig.api_key_file``.
    api_key_file: str | None = None
    # Requests the proxy serves at once; see ``ProxyConfig.max_in_flight``.
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] = MAX_IN_FLIGHT


class RaySpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How ``engine: ray`` reaches its cluster and looks after the instances on it."""

    # The cluster's GCS address ("HOST:PORT"), or "auto": the cluster this machine is part of
    # (``ray start`` ran here; RAY_ADDRESS also counts).
    address: str = "auto"
    # Ray namespace of this deployment's named actors: two deployments on one cluster need two.
    namespace: str = "lmcache-pd"
    # Times Ray starts an instance again after it dies (-1: always).
    max_restarts: Annotated[int, msgspec.Meta(ge=-1)] = -1
    # A decode instance leaving (``lmcache-pd scale``) takes no new requests and is stopped
    # when its running ones are done, or after this long (None: the pools' ``drain_timeout_s``).
    drain_timeout_s: Seconds | None = None
    # How often the proxy asks who the members are (new, restarted, leaving).
    discovery_interval_s: Seconds = 1.0


# Kubernetes' names: a DNS-1123 label (namespaces), a DNS-1035 label (Services, which must start
# with a letter), a DNS-1123 subdomain (the cluster's domain, volume claims).
DnsLabel = Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)]
# Short enough that "PREFIX-prefill-12" and the StatefulSet's revision label stay within 63.
NamePrefix = Annotated[str, msgspec.Meta(pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", max_length=40)]
DnsName = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
        max_length=253,
    ),
]
PodPath = Annotated[str, msgspec.Meta(pattern=r"^/")]


class KubernetesSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``lmcache-pd k8s`` needs beyond the pools: the image, where the objects go, how the
    model folder reaches the pods, and how the proxy is exposed."""

    # An image with this package installed (vLLM, NIXL and all), ``python3`` and
    # ``lmcache-pd`` on its PATH; the project ships none.
    image: str = "lmcache-pd:latest"
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    namespace: DnsLabel = "default"
    # Every object's name starts with it: two deployments in one namespace need two.
    name_prefix: NamePrefix = "lmcache-pd"
    # The cluster's DNS domain (the kubelet's clusterDomain): decode pods' names end with it.
    cluster_domain: DnsName = "cluster.local"
    # The model folder, read-only in every pod: a PersistentVolumeClaim (ReadOnlyMany when pods
    # run on several nodes) and the folder inside it (None: the whole volume), ...
    model_claim: DnsName | None = None
    model_sub_path: str | None = None
    # ... or a folder on every node (hostPath); with neither, the pools file's ``model`` as an
    # absolute path here (a one-node cluster on this machine).
    model_host_path: PodPath | None = None
    # Where pods see it: vLLM's ``--model`` and the proxy's tokenizer (None: /models/NAME,
    # NAME the last part of the pools file's ``model``).
    model_mount_path: PodPath | None = None
    # vLLM's HTTP port in its pods: each pod has its own network, so one port serves them all.
    http_port: Port = 8000
    # Decode rank r receives KV on kv_port_base + 2r (init) and kv_port_base + 2r + 1 (alloc).
    kv_port_base: Port = 55555
    # With the proxy's ``routing: kv``, every vLLM pod publishes its KV events on this port and
    # replays them on the next one, for the proxy alone (its NetworkPolicy).
    kv_events_port: Port = 5570
    proxy_service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    proxy_service_port: Port = 8000
    # An accelerator each vLLM pod asks for one of per rank (e.g. "nvidia.com/gpu"); None: CPU.
    gpu_resource: str | None = None
    # How long a vLLM pod may take to first answer /health (its startup probe) before it is
    # restarted: a large model loads for minutes.
    startup_timeout_s: Annotated[int, msgspec.Meta(ge=60, le=7200)] = 900

    def __post_init__(self) -> None:
        if self.model_claim is not None and self.model_host_path is not None:
            raise ValueError("model_claim and model_host_path: name one place for the model")
        if self.model_sub_path is not None and self.model_claim is None:
            raise ValueError("model_sub_path is a folder inside model_claim, which is not set")


class PoolsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``lmcache-pd serve`` starts."""

    model: str
    prefill: Annotated[list[InstanceSpec], msgspec.Meta(min_length=1)]
    decode: Annotated[list[InstanceSpec], msgspec.Meta(min_length=1)]
    proxy: ProxySpec = msgspec.field(default_factory=ProxySpec)
    # The model's engine arguments; the defaults suit the project's tiny model (fp32, eager).
    engine_args: list[str] = msgspec.field(default_factory=lambda: list(TINY_MODEL_ARGS))
    # Arguments every instance gets after the engine's (and after the model and its port).
    vllm_args: list[str] = msgspec.field(default_factory=list)
    kv_cache_gib: Annotated[int, msgspec.Meta(ge=1)] = 1
    # An instance told to stop (SIGTERM: ``lmcache-pd restart``, an operator, a pod's
    # termination) answers /health with 503 at once, refuses new requests, and stops when its
    # running ones are done, or after this long (vLLM's ``--shutdown-timeout``, whole seconds).
    drain_timeout_s: Seconds = 120.0
    # Tokens per chunk of every instance, over their configs' (None: theirs). The chunk is the
    # unit a decode reuses from its consumer once vLLM evicted a history, so a smaller one
    # recomputes less after eviction and moves more, smaller chunks; every instance must agree.
    chunk_size: Annotated[int, msgspec.Meta(ge=1)] | None = None
    # Per-request trace lines from the proxy and every connector, in the work folder.
    trace: bool = False
    # Who starts and looks after the instances: ``local``, child processes of ``serve`` on this
    # host; ``ray``, actors on a Ray cluster's nodes (restarted when they die, scalable).
    engine: Literal["local", "ray"] = "local"
    ray: RaySpec = msgspec.field(default_factory=RaySpec)
    # ``lmcache-pd k8s``: the manifests' image, namespace, names, model volume, proxy Service.
    kubernetes: KubernetesSpec = msgspec.field(default_factory=KubernetesSpec)

    @property
    def ray_drain_timeout_s(self) -> float:
        """How long a Ray scale-down waits for a leaving instance's requests."""
        own = self.ray.drain_timeout_s
        return self.drain_timeout_s if own is None else own


def load_pools(path: str | Path) -> PoolsConfig:
    """Read and validate a pools YAML; relative paths in it are relative to the current folder."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
        return msgspec.convert(raw, PoolsConfig)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read pools config {path}: {exc}") from exc
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid pools config {path}: {exc}") from exc
