"""Kubernetes manifests for a pools file (``lmcache-pd k8s``): the instances ``serve`` would
start, as objects a cluster runs, each a plain dict ready for YAML.

- Decode: a StatefulSet behind a headless Service, as LMCache's Kubernetes example and llm-d
  do. Each pod has a stable DNS name, ``PREFIX-decode-N.PREFIX-decode.NAMESPACE.svc.DOMAIN``,
  which prefill's ``warm_peers`` and the proxy's decode list name with its KV ports; the name
  resolves to the pod's IP, on which the pod binds those ports (its ``receiver_host``, from the
  downward API) and vLLM's HTTP port, not on every interface.
- Prefill: a StatefulSet behind a headless Service too, though nothing pushes to it: the proxy
  then sees each pod, so it keeps least-outstanding routing and health per pod, and retries a
  failed prefill on another; one Service in front of a Deployment would hide them all behind one
  address.
- The proxy: a Deployment of ``lmcache-pd proxy`` with a Service in front.
- The transfer YAMLs and the proxy's YAML: ConfigMaps, mounted read-only at /etc/lmcache-pd.
- A Secret (drawn afresh each time the manifests are written) holding the instances' key
  (vLLM pods answer only /health and /metrics without it; the proxy sends it) and each role's
  share of one deployment secret (``lmcache_pd/auth.py``; ``LMCACHE_PD_SECRET`` in each pod:
  prefill's the producer's share, decode's the consumer's, the proxy's its own): the KV channel
  admits no process without one, and each door only the roles that use it. The secret itself is
  in no object.
- NetworkPolicies (``k8s_policy.py``): the KV ports and vLLM's take only the pools' own pods and
  the proxy; the proxy's HTTP port takes anyone.
- With the proxy's ``routing: kv``, every vLLM pod publishes its KV events (``--kv-events-config``,
  bound to the pod's IP, CURVE, admitting the proxy's key alone) on ``kv_events_port`` and replays
  them on the next port; the proxy's list names each pod's, and follows them.

A StatefulSet's pods are alike, so every instance of a pool must be, except in its cores
(``cpus``, ``thread_cpus``, ``process_cpus``) and ``port``, which are not used: they name one
host's cores and ports, while the kubelet places pods and each pod has a network of its own.
Replicas are the pool's instance count, and the proxy's list is the pods named then: to scale,
edit the pools file and generate again.
"""

from __future__ import annotations

import secrets
from typing import Any

import msgspec
import yaml

from lmcache_pd.auth import generate_secret, role_shares
from lmcache_pd.deploy.instance import transfer_settings
from lmcache_pd.deploy.k8s_policy import PortRange, deployment_policies
from lmcache_pd.deploy.k8s_workloads import (
    EVENTS_PORT_NAME,
    INSTANCE_KEY_ITEM,
    KV_SHARE_ITEMS,
    PROXY_NOTICE_PORT,
    RECEIVER_HOST_ENV,
    REPLAY_PORT_NAME,
    SECRETS,
    TRACE_DIR,
    Manifest,
    Names,
    decode_ports,
    model_mount_path,
    proxy_deployment,
    stateful_set,
)
from lmcache_pd.deploy.launcher import INSTANCE_KEY_BYTES, peer_text
from lmcache_pd.deploy.pools import InstanceSpec, KubernetesSpec, PoolsConfig
from lmcache_pd.errors import ConfigError
from lmcache_pd.proxy.config import (
    DecodeInstance,
    KVEventsAddress,
    PrefillInstance,
    ProxyConfig,
    Timeouts,
)

# UCX's TCP listening ports per decode rank (``UCX_TCP_PORT_RANGE``; one per network interface,
# with room: UCX picks one at random in the range and tries another where one is taken).
UCX_PORTS_PER_RANK = 16
UCX_PORT_RANGE_ENV = "UCX_TCP_PORT_RANGE"


def manifests(
    pools: PoolsConfig, instance_key: str | None = None, kv_secret: str | None = None
) -> list[Manifest]:
    """Every object of ``pools``, in an order to apply them: ConfigMaps, the Secret, Services,
    NetworkPolicies, then what runs; the instances' key is ``instance_key`` and the deployment
    secret ``kv_secret``, whose roles' shares the Secret holds (None: fresh random ones). Reads
    the pools' transfer YAMLs; ``ConfigError`` if a pool's instances differ where pods must be
    alike, or a decode pod's ports would pass 65535 or meet another."""
    k8s = pools.kubernetes
    names = Names(k8s)
    model = model_mount_path(pools)
    prefill_spec = _pool_spec(pools.prefill, "prefill")
    decode_spec = _pool_spec(pools.decode, "decode")
    receive = receive_ports(k8s, decode_spec.tensor_parallel_size)
    ucx = ucx_port_range(k8s, decode_spec.tensor_parallel_size)
    if pools.proxy.port == PROXY_NOTICE_PORT:
        raise ConfigError(
            f"proxy.port {PROXY_NOTICE_PORT} is the proxy pod's port for first-token notices: "
            "pick another"
        )
    taken = {k8s.http_port, *_listed_ports(receive), *range(ucx[0], ucx[1] + 1)}
    events = kv_events_ports(pools, taken)

    def events_of(component: str, index: int) -> KVEventsAddress | None:
        host = names.pod_host(component, index)
        return KVEventsAddress(host, *events.values()) if events else None

    decode = [
        DecodeInstance(
            f"http://{names.pod_host('decode', index)}:{k8s.http_port}",
            names.pod_host("decode", index),
            **receive,
            kv_events=events_of("decode", index),
        )
        for index in range(len(pools.decode))
    ]
    prefill = [
        PrefillInstance(
            f"http://{names.pod_host('prefill', index)}:{k8s.http_port}",
            kv_events=events_of("prefill", index),
        )
        for index in range(len(pools.prefill))
    ]
    trace = pools.trace
    decode_settings = transfer_settings(pools, "decode", decode_spec, "kv_consumer", dict(receive))
    decode_settings.pop("receiver_host", None)  # each pod's own IP: RECEIVER_HOST_ENV
    prefill_settings = transfer_settings(
        pools,
        "prefill",
        prefill_spec,
        "kv_producer",
        {"warm_peers": [peer_text(d) for d in decode]},
    )
    proxy = ProxyConfig(
        model=model,
        prefill=prefill,
        decode=decode,
        host="0.0.0.0",  # reached through its Service, from other pods
        port=pools.proxy.port,
        notice_port=PROXY_NOTICE_PORT,
        timeouts=Timeouts(decode_read_s=pools.proxy.decode_read_timeout_s),
        trace_path=f"{TRACE_DIR}/proxy.trace.jsonl" if trace else None,
        tokenizer=model,
        min_disagg_tokens=pools.proxy.min_disagg_tokens,
        routing=pools.proxy.routing,
    )
    configs = {
        "prefill": _with_trace(prefill_settings, "prefill", trace),
        "decode": _with_trace(decode_settings, "decode", trace),
        "proxy": msgspec.to_builtins(proxy),
    }
    keys = {
        INSTANCE_KEY_ITEM: instance_key or secrets.token_urlsafe(INSTANCE_KEY_BYTES),
        **{
            KV_SHARE_ITEMS[role]: share
            for role, share in role_shares(kv_secret or generate_secret()).items()
        },
    }
    policies = deployment_policies(
        names,
        http_port=k8s.http_port,
        init_ports=_listed(receive["init_port"]),
        alloc_ports=_listed(receive["alloc_port"]),
        ucx_ports=ucx,
        proxy_port=pools.proxy.port,
        notice_port=PROXY_NOTICE_PORT,
        events_ports=list(events.values()),
    )
    decode_env = {UCX_PORT_RANGE_ENV: f"{ucx[0]}-{ucx[1]}"}
    prefill_ports = {"http": k8s.http_port} | events
    decode_pod_ports = decode_ports(k8s, receive) | events
    return [
        *(_config_map(names, component, text) for component, text in configs.items()),
        _secret(names, keys),
        _headless_service(names, "prefill", prefill_ports),
        _headless_service(names, "decode", decode_pod_ports),
        _proxy_service(names, k8s),
        *policies,
        stateful_set(names, pools, prefill_spec, "prefill", len(prefill), prefill_ports, {}),
        stateful_set(
            names, pools, decode_spec, "decode", len(decode), decode_pod_ports, decode_env
        ),
        proxy_deployment(names, pools),
    ]


def receive_ports(k8s: KubernetesSpec, ranks: int) -> dict[str, int | list[int]]:
    """A decode pod's KV receive ports: fixed, one pair per rank from ``kv_port_base``."""
    init = [k8s.kv_port_base + 2 * rank for rank in range(ranks)]
    alloc = [port + 1 for port in init]
    if alloc[-1] > 65535:
        raise ConfigError(
            f"kubernetes.kv_port_base {k8s.kv_port_base} leaves no room for {ranks} rank(s) "
            f"of KV ports (two each) below 65536"
        )
    if ranks == 1:
        return {"init_port": init[0], "alloc_port": alloc[0]}
    return {"init_port": init, "alloc_port": alloc}


def ucx_port_range(k8s: KubernetesSpec, ranks: int) -> PortRange:
    """Where a decode pod's UCX listens (first and last port): right after its KV ports.
    ``ConfigError`` if it would pass 65535 or take vLLM's HTTP port."""
    first = k8s.kv_port_base + 2 * ranks
    last = first + UCX_PORTS_PER_RANK * ranks - 1
    if last > 65535:
        raise ConfigError(
            f"kubernetes.kv_port_base {k8s.kv_port_base} leaves no room for {ranks} rank(s) of "
            f"KV ports and UCX's ({2 + UCX_PORTS_PER_RANK} each) below 65536"
        )
    if k8s.kv_port_base <= k8s.http_port <= last:
        raise ConfigError(
            f"kubernetes.http_port {k8s.http_port} is among a decode pod's KV and UCX ports "
            f"({k8s.kv_port_base}-{last}): move one of them"
        )
    return first, last


def kv_events_ports(pools: PoolsConfig, taken: set[int]) -> dict[str, int]:
    """A vLLM pod's KV-event ports by name, the publisher's then the replay's (none unless the
    proxy routes by KV); ``ConfigError`` if they would pass 65535 or meet one of ``taken``."""
    if pools.proxy.routing != "kv":
        return {}
    first = pools.kubernetes.kv_events_port
    ports = {EVENTS_PORT_NAME: first, REPLAY_PORT_NAME: first + 1}
    clash = sorted(set(ports.values()) & taken)
    if clash:
        raise ConfigError(
            f"kubernetes.kv_events_port {first} (its replay port {first + 1}) meets ports a vLLM "
            f"pod uses already ({clash}: HTTP, decode's KV or UCX ports): move it"
        )
    if first + 1 > 65535:
        raise ConfigError(
            f"kubernetes.kv_events_port {first}: its replay port {first + 1} must be below 65536"
        )
    return ports


def _listed_ports(receive: dict[str, int | list[int]]) -> list[int]:
    return [*_listed(receive["init_port"]), *_listed(receive["alloc_port"])]


def _listed(ports: int | list[int]) -> list[int]:
    return ports if isinstance(ports, list) else [ports]


def _pool_spec(specs: list[InstanceSpec], pool: str) -> InstanceSpec:
    """The one pod template of a pool: its instances, less what pods do not use, must agree."""
    alike = [
        msgspec.structs.replace(
            spec,
            cpus=None,
            thread_cpus=None,
            process_cpus=None,
            port=None,
            ray_resources={},
            ray_labels={},
        )
        for spec in specs
    ]
    for index, spec in enumerate(alike[1:], start=1):
        if spec != alike[0]:
            differ = [
                field
                for field in spec.__struct_fields__
                if getattr(spec, field) != getattr(alike[0], field)
            ]
            raise ConfigError(
                f"{pool}[{index}] differs from {pool}[0] in {', '.join(differ)}: the pods of a "
                f"StatefulSet are alike (cpus, thread_cpus, process_cpus and port may differ; they "
                "are not used there)"
            )
    return alike[0]


def _with_trace(settings: dict[str, Any], component: str, trace: bool) -> dict[str, Any]:
    return {**settings, "trace_path": f"{TRACE_DIR}/{component}.trace.jsonl"} if trace else settings


def _config_map(names: Names, component: str, settings: dict[str, Any]) -> Manifest:
    text = yaml.safe_dump(settings, sort_keys=False)
    if component == "decode":
        text = f"# receiver_host: each pod's own IP, from ${RECEIVER_HOST_ENV}\n{text}"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": names.metadata(component),
        "data": {f"{component}.yaml": text},
    }


def _secret(names: Names, items: dict[str, str]) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": names.metadata(SECRETS),
        "type": "Opaque",
        "stringData": items,
    }


def _headless_service(names: Names, component: str, ports: dict[str, int]) -> Manifest:
    """The Service that gives a StatefulSet's pods their DNS names. Names resolve as soon as a
    pod has an address, ready or not: prefill shakes hands with decode pods while both start,
    and the proxy checks each pod's health itself."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.metadata(component),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": names.labels(component),
            "ports": [
                {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
                for name, port in ports.items()
            ],
        },
    }


def _proxy_service(names: Names, k8s: KubernetesSpec) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": names.metadata("proxy"),
        "spec": {
            "type": k8s.proxy_service_type,
            "selector": names.labels("proxy"),
            "ports": [
                {
                    "name": "http",
                    "port": k8s.proxy_service_port,
                    "targetPort": "http",
                    "protocol": "TCP",
                }
            ],
        },
    }


def file_name(index: int, manifest: Manifest) -> str:
    """``NN-NAME-KIND.yaml``: ``kubectl apply -f DIR`` applies files in name order."""
    name = manifest["metadata"]["name"]
    return f"{index:02d}-{name}-{manifest['kind'].lower()}.yaml"


class _Dumper(yaml.SafeDumper):
    """Plain YAML for people to read: no anchors for repeated values, and multi-line strings
    (the ConfigMaps' files) as literal blocks."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _string(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _string)


def to_yaml(objects: list[Manifest]) -> str:
    """The objects as one multi-document YAML stream."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False)
