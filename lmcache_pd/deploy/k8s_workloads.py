"""The workloads of ``lmcache-pd k8s``'s manifests: the StatefulSets of vLLM pods and the
proxy's Deployment, each pod with its ConfigMap, the model folder, probes on ``/health``,
resource requests from the pools file and the deployment's keys from its Secret. ``k8s.py`` says
what is deployed and how it is wired."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_pd import auth
from lmcache_pd.auth import SECRET_ENV
from lmcache_pd.config import ENV_PREFIX
from lmcache_pd.deploy.instance import (
    Role,
    connector_config,
    instance_args,
    instance_env,
    kv_events_args,
)
from lmcache_pd.deploy.instance_guard import KEY_ENV
from lmcache_pd.deploy.pools import InstanceSpec, KubernetesSpec, PoolsConfig
from lmcache_pd.deploy.vllm_server import DRAIN_EXIT_MARGIN_S, server_env, vllm_command
from lmcache_pd.proxy.config import INSTANCE_API_KEY_ENV, KVEventsAddress

Manifest = dict[str, Any]

CONFIG_DIR = "/etc/lmcache-pd"
TRACE_DIR = "/var/log/lmcache-pd"
POD_PYTHON = "python3"
RECEIVER_HOST_ENV = f"{ENV_PREFIX}RECEIVER_HOST"
# The deployment's Secret (``PREFIX-secrets``) and its items: the instances' key, which vLLM pods
# want from their callers and the proxy sends, and each role's share of the deployment secret
# that authenticates the KV channel between them all (``lmcache_pd/auth.py``), which only that
# role's pods read.
SECRETS = "secrets"
INSTANCE_KEY_ITEM = "instance-api-key"
KV_SHARE_ITEMS = {
    auth.Role.PRODUCER: "kv-producer",
    auth.Role.CONSUMER: "kv-consumer",
    auth.Role.PROXY: "kv-proxy",
}
# A vLLM pod's own address (the downward API's status.podIP): vLLM and decode's KV ports bind it,
# not every interface of the pod.
POD_IP_ENV = "POD_IP"
# A vLLM pod's named ports for its KV events (with the proxy's ``routing: kv``).
EVENTS_PORT_NAME = "kv-events"
REPLAY_PORT_NAME = "kv-events-rep"
# Where a vLLM pod's memory volume is mounted: its ranks share tensors there, and a decode pod's
# vLLM puts its IPC sockets and our landed boards there.
SHARED_MEMORY_MOUNT = "/dev/shm"
# The proxy's port for first-token notices from prefill pods (fixed: its NetworkPolicy names it).
PROXY_NOTICE_PORT = 5557
# vLLM loads a model for seconds to minutes: the startup probe (KubernetesSpec.startup_timeout_s)
# covers that; after it, a pod that stops answering /health for a minute is restarted, and one
# that fails it three times in a row (15 s) takes no traffic until it answers again.
PROBE_PERIOD_S = 10
READY_PERIOD_S = 5
READY_FAILURES = 3
PROBE_TIMEOUT_S = 5
LIVENESS_FAILURES = 6
# The proxy asks for little; the pools file says nothing of it (an asyncio process that streams).
PROXY_CPU = "500m"
PROXY_MEMORY = "512Mi"


@dataclass(frozen=True, slots=True)
class Names:
    """The objects' names and the pods' DNS names of one deployment."""

    spec: KubernetesSpec

    def of(self, component: str) -> str:
        """The name of a component's objects (StatefulSet, Service, ConfigMap share it)."""
        return f"{self.spec.name_prefix}-{component}"

    def service_domain(self, component: str) -> str:
        """The DNS domain of a component's headless Service, under which its pods are named."""
        return f"{self.of(component)}.{self.spec.namespace}.svc.{self.spec.cluster_domain}"

    def pod_host(self, component: str, index: int) -> str:
        """The stable DNS name of pod ``index`` of a component's StatefulSet."""
        return f"{self.of(component)}-{index}.{self.service_domain(component)}"

    def labels(self, component: str) -> dict[str, str]:
        """Labels of a component's objects; its Services select its pods by them."""
        return {
            "app.kubernetes.io/name": "lmcache-pd",
            "app.kubernetes.io/instance": self.spec.name_prefix,
            "app.kubernetes.io/component": component,
        }

    def metadata(self, component: str) -> Manifest:
        """An object's metadata: its component's name, the namespace, the labels."""
        return {
            "name": self.of(component),
            "namespace": self.spec.namespace,
            "labels": self.labels(component),
        }


def model_mount_path(pools: PoolsConfig) -> str:
    """Where the pods see the model folder."""
    return pools.kubernetes.model_mount_path or f"/models/{Path(pools.model).name}"


def decode_ports(k8s: KubernetesSpec, receive: dict[str, int | list[int]]) -> dict[str, int]:
    """A decode pod's named ports: HTTP, then an init and an alloc port per rank."""
    init, alloc = (receive[key] for key in ("init_port", "alloc_port"))
    pairs = zip(*(p if isinstance(p, list) else [p] for p in (init, alloc)), strict=True)
    ports = {"http": k8s.http_port}
    for rank, (init_port, alloc_port) in enumerate(pairs):
        ports |= {f"kv-init-{rank}": init_port, f"kv-alloc-{rank}": alloc_port}
    return ports


def stateful_set(
    names: Names,
    pools: PoolsConfig,
    spec: InstanceSpec,
    component: str,
    replicas: int,
    ports: dict[str, int],
    pod_env: dict[str, str],
) -> Manifest:
    """A pool's pods, each named ``NAME-N`` under its headless Service (of the same name), with
    ``pod_env`` on top of the instance's environment."""
    container = _vllm_container(names, pools, spec, component, ports, pod_env)
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": names.metadata(component),
        "spec": {
            "serviceName": names.of(component),
            "replicas": replicas,
            # Every pod starts at once: in order, each would wait minutes for the one before.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": names.labels(component)},
            "template": {
                "metadata": {"labels": names.labels(component)},
                "spec": _pod_spec(
                    pools,
                    [container],
                    component,
                    names,
                    # vLLM's ranks share tensors through shared memory; a container's own
                    # /dev/shm is 64 MiB.
                    [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
                )
                | {"terminationGracePeriodSeconds": termination_grace_s(pools)},
            },
        },
    }


def termination_grace_s(pools: PoolsConfig) -> int:
    """How long Kubernetes lets a terminating vLLM pod run after it starts stopping it, which
    must be at least its preStop hook's time and the shutdown's: there is no preStop (the drain
    starts on the SIGTERM itself, ``instance_drain.py``; a hook would only delay it), so the
    drain (``drain_timeout_s``) and vLLM's teardown after it. Then SIGKILL ends what is left."""
    return math.ceil(pools.drain_timeout_s) + DRAIN_EXIT_MARGIN_S


def _vllm_container(
    names: Names,
    pools: PoolsConfig,
    spec: InstanceSpec,
    component: str,
    ports: dict[str, int],
    pod_env: dict[str, str],
) -> Manifest:
    """The vLLM server of a pod: the command ``serve`` would run (``vllm_command``) bound to the
    pod's IP, its environment less ``cpus``'s pinning, which names one host's cores (the pool's
    pod template ``spec`` has no ``cpus``, ``thread_cpus`` nor ``process_cpus``), and both keys
    from the deployment's Secret (never in the command or a ConfigMap): the instances' key and
    its role's share of the deployment secret."""
    k8s = pools.kubernetes
    role: Role = "kv_consumer" if component == "decode" else "kv_producer"
    key_role = auth.Role.CONSUMER if component == "decode" else auth.Role.PRODUCER
    command = vllm_command(
        model_mount_path(pools),
        k8s.http_port,
        host=f"$({POD_IP_ENV})",  # Kubernetes expands it in a command too
        engine_args=pools.engine_args,
        extra_args=[*instance_args(pools, spec), *_events_args(ports)],
        log_stats=True,
        kv_transfer_config=connector_config(role, f"{CONFIG_DIR}/{component}.yaml"),
        python=POD_PYTHON,
        key_guard=True,
        drain_timeout_s=pools.drain_timeout_s,
    )
    # Kubernetes expands $(POD_IP), defined first, in later variables' values.
    env = [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    values = (
        server_env(
            cpu=None,
            env=instance_env(pools, spec),
            args=[*pools.engine_args, *instance_args(pools, spec)],
        )
        | pod_env
    )
    if component == "decode":
        # Its KV ports bind the pod's IP; the proxy and prefill name its DNS name, which is it.
        values[RECEIVER_HOST_ENV] = f"$({POD_IP_ENV})"
        # vLLM's IPC sockets and our landed boards on the pod's memory volume, not the image's
        # disk-backed /tmp: the consumer's serving loop writes its board's pages on every
        # landing, and a page being written back to a disk may keep it waiting
        # (``landed_board.py``). The pod goes with them.
        values.setdefault("VLLM_RPC_BASE_PATH", SHARED_MEMORY_MOUNT)
    env += [{"name": name, "value": value} for name, value in values.items()]
    env += [
        secret_env(names, KEY_ENV, INSTANCE_KEY_ITEM),
        secret_env(names, SECRET_ENV, KV_SHARE_ITEMS[key_role]),
    ]
    requests = {
        "cpu": _cpu_quantity(spec.cores),
        "memory": _memory_quantity((spec.memory_gib or 0) + pools.kv_cache_gib),
    }
    resources: Manifest = {"requests": requests}
    if k8s.gpu_resource is not None:
        resources["limits"] = {k8s.gpu_resource: str(spec.tensor_parallel_size)}
    startup_failures = -(-k8s.startup_timeout_s // PROBE_PERIOD_S)
    return {
        "name": "vllm",
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": command,
        "env": env,
        "ports": [
            {"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ports.items()
        ],
        "resources": resources,
        "startupProbe": _health_probe(PROBE_PERIOD_S, startup_failures),
        "readinessProbe": _health_probe(READY_PERIOD_S, READY_FAILURES),
        "livenessProbe": _health_probe(PROBE_PERIOD_S, LIVENESS_FAILURES),
        "volumeMounts": [
            *_common_mounts(pools, component),
            {"name": "dshm", "mountPath": SHARED_MEMORY_MOUNT},
        ],
    }


def _events_args(ports: dict[str, int]) -> list[str]:
    """vLLM's KV events published on the pod's IP, where its ports name them (none: not)."""
    if EVENTS_PORT_NAME not in ports:
        return []
    here = KVEventsAddress(f"$({POD_IP_ENV})", ports[EVENTS_PORT_NAME], ports[REPLAY_PORT_NAME])
    return kv_events_args(here)


def _health_probe(period_s: int, failures: int) -> Manifest:
    """GET /health on the container's ``http`` port."""
    return {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": period_s,
        "timeoutSeconds": PROBE_TIMEOUT_S,
        "failureThreshold": failures,
    }


def secret_env(names: Names, variable: str, item: str) -> Manifest:
    """An environment variable set from an item of the deployment's Secret."""
    reference = {"name": names.of(SECRETS), "key": item}
    return {"name": variable, "valueFrom": {"secretKeyRef": reference}}


def proxy_deployment(names: Names, pools: PoolsConfig) -> Manifest:
    """``lmcache-pd proxy`` on its ConfigMap, with the instances' key and the proxy's share of
    the deployment secret from the deployment's Secret. Ready
    once its /health says a prefill and a decode pod are up; alive while its port accepts (its
    /health fails whenever they are all down, which is no reason to restart it)."""
    k8s = pools.kubernetes
    container = {
        "name": "proxy",
        "image": k8s.image,
        "imagePullPolicy": k8s.image_pull_policy,
        "command": ["lmcache-pd", "proxy", f"{CONFIG_DIR}/proxy.yaml"],
        "env": [
            secret_env(names, INSTANCE_API_KEY_ENV, INSTANCE_KEY_ITEM),
            secret_env(names, SECRET_ENV, KV_SHARE_ITEMS[auth.Role.PROXY]),
        ],
        "ports": [
            {"name": "http", "containerPort": pools.proxy.port, "protocol": "TCP"},
            {"name": "notice", "containerPort": PROXY_NOTICE_PORT, "protocol": "TCP"},
        ],
        "resources": {"requests": {"cpu": PROXY_CPU, "memory": PROXY_MEMORY}},
        "readinessProbe": _health_probe(READY_PERIOD_S, READY_FAILURES),
        "livenessProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": PROBE_TIMEOUT_S,
        },
        "volumeMounts": _common_mounts(pools, "proxy"),
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": names.metadata("proxy"),
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": names.labels("proxy")},
            "template": {
                "metadata": {"labels": names.labels("proxy")},
                "spec": _pod_spec(pools, [container], "proxy", names, []),
            },
        },
    }


def _pod_spec(
    pools: PoolsConfig,
    containers: list[Manifest],
    component: str,
    names: Names,
    extra_volumes: list[Manifest],
) -> Manifest:
    """A pod with its ConfigMap, the model folder and (with ``trace``) a folder for traces.
    No Service links: Kubernetes would set ``PREFIX_..._PORT`` variables for every Service of
    the namespace, and with the default prefix those read as unknown ``LMCACHE_PD_*``
    settings, which the connector refuses."""
    k8s = pools.kubernetes
    if k8s.model_claim is not None:
        model: Manifest = {
            "persistentVolumeClaim": {"claimName": k8s.model_claim, "readOnly": True}
        }
    else:
        host_path = k8s.model_host_path or str(Path(pools.model).absolute())
        model = {"hostPath": {"path": host_path, "type": "Directory"}}
    volumes = [
        {"name": "config", "configMap": {"name": names.of(component)}},
        {"name": "model", **model},
        *extra_volumes,
    ]
    if pools.trace:
        volumes.append({"name": "traces", "emptyDir": {}})
    return {"enableServiceLinks": False, "containers": containers, "volumes": volumes}


def _common_mounts(pools: PoolsConfig, component: str) -> list[Manifest]:
    model: Manifest = {"name": "model", "mountPath": model_mount_path(pools), "readOnly": True}
    if pools.kubernetes.model_sub_path is not None:
        model["subPath"] = pools.kubernetes.model_sub_path
    mounts = [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}, model]
    if pools.trace:
        mounts.append({"name": "traces", "mountPath": TRACE_DIR})
    return mounts


def _cpu_quantity(cores: float) -> str:
    return str(int(cores)) if cores == int(cores) else f"{round(cores * 1000)}m"


def _memory_quantity(gib: float) -> str:
    return f"{int(gib)}Gi" if gib == int(gib) else f"{round(gib * 1024)}Mi"
