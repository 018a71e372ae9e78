"""Kubernetes manifests (``lmcache-pd k8s``), checked offline: every object against the
Kubernetes schemas of a pinned version, and the wiring between them (DNS names, pod addresses,
ports, labels, probes, mounts, the Secret's items) by ``wiring_faults``, which reads the objects
as the cluster and our own config loaders would. Each check has a negative control: a broken
manifest that it must catch. The NetworkPolicies and the secret's reach: test_k8s_security.py."""

from __future__ import annotations

import copy
import ipaddress
import json
import re
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import msgspec
import pytest
import yaml
from typer.testing import CliRunner

from lmcache_pd.auth import SECRET_ENV, DeploymentKeys, load_keys
from lmcache_pd.auth import Role as KeyRole
from lmcache_pd.cli import app
from lmcache_pd.config import ENV_PREFIX, PROXY_ENV_PREFIX, PDConfig, load_config
from lmcache_pd.deploy.instance import THREAD_CPUS_ENV, instance_env
from lmcache_pd.deploy.k8s import manifests, to_yaml
from lmcache_pd.deploy.launcher import peer_text
from lmcache_pd.deploy.pools import InstanceSpec, KubernetesSpec, PoolsConfig, load_pools
from lmcache_pd.deploy.vllm_server import DRAIN_EXIT_MARGIN_S, server_env
from lmcache_pd.errors import ConfigError
from lmcache_pd.proxy.config import KVEventsAddress, ProxyConfig, proxy_config

CONFIGS = Path(__file__).parent.parent / "configs"
SHIPPED = ["pools.yaml", "pools-2p1d.yaml", "pools-tp2.yaml", "pools-tp2p-tp1d.yaml"]
# The schemas checked against (kubernetes-validate ships them; strict: unknown fields refused).
KUBERNETES_VERSION = "1.35"
Manifest = dict[str, Any]


def shipped(name: str, **kubernetes: object) -> PoolsConfig:
    """A shipped pools file (its config paths are relative to the repository's root, where the
    tests run), with ``kubernetes`` settings if given."""
    pools = load_pools(CONFIGS / name)
    if kubernetes:
        pools = msgspec.structs.replace(
            pools, kubernetes=msgspec.convert(kubernetes, KubernetesSpec)
        )
    return pools


def one(objects: list[Manifest], kind: str, component: str) -> Manifest:
    [found] = [
        o
        for o in objects
        if o["kind"] == kind and o["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    return found


def container_of(workload: Manifest) -> Manifest:
    return workload["spec"]["template"]["spec"]["containers"][0]


def argument(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def pod_ip(pod_name: str) -> str:
    """The address the cluster gives pod ``pod_name`` here (one of its own, as a CNI would)."""
    return str(ipaddress.IPv4Address((10 << 24) + zlib.crc32(pod_name.encode()) % (1 << 24)))


def expand(text: str, env: dict[str, str]) -> str:
    """``$(VAR)`` of a variable defined in ``env`` replaced, as Kubernetes does in env values
    and commands."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m[1], m[0]), text)


def secret_items(objects: list[Manifest]) -> dict[str, dict[str, str]]:
    """Each Secret's items, by the Secret's name."""
    return {o["metadata"]["name"]: o["stringData"] for o in objects if o["kind"] == "Secret"}


def pod_env(container: Manifest, pod_name: str, objects: list[Manifest]) -> dict[str, str]:
    """The container's environment as the kubelet makes it: the pod's name and IP through the
    downward API, a Secret's item read from ``objects`` (a missing one leaves the variable
    unset, as a pod that never starts would), and ``$(VAR)`` of a variable defined earlier
    expanded."""
    downward = {"metadata.name": pod_name, "status.podIP": pod_ip(pod_name)}
    secrets = secret_items(objects)
    env: dict[str, str] = {}
    for item in container.get("env", []):
        source = item.get("valueFrom", {})
        if "secretKeyRef" in source:
            reference = source["secretKeyRef"]
            value = secrets.get(reference["name"], {}).get(reference["key"])
            if value is not None:
                env[item["name"]] = value
        elif "fieldRef" in source:
            env[item["name"]] = downward[source["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = expand(item["value"], env)
    return env


def mounted_file(workload: Manifest, objects: list[Manifest], path: str) -> str | None:
    """The text a pod of ``workload`` reads at ``path``, if a ConfigMap mount puts it there."""
    volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
    maps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
    folder, _, key = path.rpartition("/")
    for mount in container_of(workload)["volumeMounts"]:
        source = volumes.get(mount["name"], {}).get("configMap")
        if mount["mountPath"] == folder and source and source["name"] in maps:
            return maps[source["name"]].get(key)
    return None


def model_mount(workload: Manifest) -> str | None:
    mounts = container_of(workload)["volumeMounts"]
    return next((m["mountPath"] for m in mounts if m["name"] == "model"), None)


def _events_faults(
    command: list[str],
    env: dict[str, str],
    listed: KVEventsAddress | None,
    pod: str,
    resolve: dict[str, str],
    exposed: set[int],
) -> list[str]:
    """Where a pod's KV events and the proxy's entry for them disagree: vLLM publishes on the
    pod's IP, at the ports the proxy follows, which the pod exposes; neither or both."""
    published = "--kv-events-config" in command
    if listed is None or not published:
        return [] if listed is None and not published else [f"{pod}: published {published}"]
    config = json.loads(expand(argument(command, "--kv-events-config"), env))
    ip = resolve.get(listed.host)
    wanted = {
        "endpoint": f"tcp://{ip}:{listed.port}",
        "replay_endpoint": f"tcp://{ip}:{listed.replay_port}",
    }
    if ip != pod_ip(pod) or {k: config.get(k) for k in wanted} != wanted:
        return [f"{pod}: publishes at {config}, the proxy follows {listed}"]
    if not {listed.port, listed.replay_port} <= exposed:
        return [f"{pod}: its KV-event ports are not container ports"]
    return []


def wiring_faults(objects: list[Manifest], tmp_path: Path) -> list[str]:
    """What in ``objects`` would not connect once applied; empty when all of it does."""
    faults: list[str] = []
    workloads = [o for o in objects if o["kind"] in ("StatefulSet", "Deployment")]
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    for workload in workloads:
        spec = workload["spec"]
        labels = spec["template"]["metadata"]["labels"]
        name = workload["metadata"]["name"]
        if any(labels.get(k) != v for k, v in spec["selector"]["matchLabels"].items()):
            faults.append(f"{name}: its selector does not match its pods")
        if spec["template"]["spec"].get("enableServiceLinks") is not False:
            faults.append(f"{name}: Service variables would reach {ENV_PREFIX}* settings")
        for env in container_of(workload).get("env", []):
            key = env["name"].removeprefix(ENV_PREFIX).lower()
            setting = (
                env["name"].startswith(ENV_PREFIX)
                and not env["name"].startswith(PROXY_ENV_PREFIX)
                and env["name"] != SECRET_ENV
            )
            if setting and key not in PDConfig.__struct_fields__:
                faults.append(f"{name}: {env['name']} is no setting")
        if workload["kind"] == "StatefulSet":
            service = services.get(spec["serviceName"], {}).get("spec", {})
            if service.get("clusterIP") != "None":
                faults.append(f"{name}: no headless Service {spec['serviceName']}")
    for service in services.values():
        selector = service["spec"]["selector"]
        chosen = [
            w
            for w in workloads
            if all(
                w["spec"]["template"]["metadata"]["labels"].get(k) == v for k, v in selector.items()
            )
        ]
        if len(chosen) != 1:
            faults.append(f"Service {service['metadata']['name']} selects {len(chosen)} workloads")
            continue
        exposed = {p["name"]: p["containerPort"] for p in container_of(chosen[0])["ports"]}
        for port in service["spec"]["ports"]:
            if port["targetPort"] not in exposed or len(port["name"]) > 15:
                faults.append(f"Service {service['metadata']['name']}: port {port['name']}")
            headless = service["spec"].get("clusterIP") == "None"
            if headless and exposed.get(port["targetPort"]) != port["port"]:
                faults.append(f"Service {service['metadata']['name']}: {port['name']} number")
    for workload in workloads:
        container = container_of(workload)
        exposed = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            check = container.get(probe, {}).get("httpGet")
            if check and (check["path"] != "/health" or check["port"] not in exposed):
                faults.append(f"{workload['metadata']['name']}: {probe} misses /health")
    faults += _instance_faults(objects, tmp_path)
    return faults


def _instance_faults(objects: list[Manifest], tmp_path: Path) -> list[str]:
    """The proxy's list against the pods, each pod's config as its connector loads it."""
    faults: list[str] = []
    proxy_deployment = one(objects, "Deployment", "proxy")
    proxy_path = proxy_deployment_config_path(proxy_deployment)
    text = mounted_file(proxy_deployment, objects, proxy_path)
    if text is None:
        return [f"proxy: nothing mounted at {proxy_path}"]
    proxy: ProxyConfig = proxy_config(yaml.safe_load(text))
    proxy_pod = f"{proxy_deployment['metadata']['name']}-0"
    proxy_keys = _keys_or_fault(
        load_keys(
            proxy.secret_file,
            KeyRole.PROXY,
            pod_env(container_of(proxy_deployment), proxy_pod, objects),
        ),
        "proxy",
        faults,
    )
    if {p["containerPort"] for p in container_of(proxy_deployment)["ports"]} != {
        proxy.port,
        proxy.notice_port,
    }:
        faults.append("proxy: its container ports are not the ports it listens on")
    if model_mount(proxy_deployment) != proxy.tokenizer:
        faults.append("proxy: its tokenizer is not the model mount")
    members = {"prefill": [m.url for m in proxy.prefill], "decode": [m.url for m in proxy.decode]}
    for component, urls in members.items():
        workload = one(objects, "StatefulSet", component)
        name, service = workload["metadata"]["name"], workload["spec"]["serviceName"]
        namespace = workload["metadata"]["namespace"]
        container = container_of(workload)
        command = container["command"]
        pods = [f"{name}-{i}" for i in range(workload["spec"]["replicas"])]
        domain = f"{service}.{namespace}.svc.cluster.local"
        # The cluster's DNS: each pod's name under its headless Service is its IP.
        resolve = {f"{pod}.{domain}": pod_ip(pod) for pod in pods}
        port = argument(command, "--port")
        events = [m.kv_events for m in (proxy.prefill if component == "prefill" else proxy.decode)]
        if {p["containerPort"] for p in container["ports"] if p["name"] == "http"} != {int(port)}:
            faults.append(f"{component}: its http port is not vLLM's --port")
        if urls != [f"http://{pod}.{domain}:{port}" for pod in pods]:
            faults.append(f"proxy: {component} URLs {urls} are not the pods {pods}")
        if argument(command, "--model") != model_mount(workload):
            faults.append(f"{component}: --model is not the model mount")
        config_path = json.loads(argument(command, "--kv-transfer-config"))[
            "kv_connector_extra_config"
        ]["config_path"]
        config_text = mounted_file(workload, objects, config_path)
        if config_text is None:
            faults.append(f"{component}: nothing mounted at {config_path}")
            continue
        local = tmp_path / f"{component}.yaml"
        local.write_text(config_text)
        exposed = {p["containerPort"] for p in container["ports"]}
        for index, pod in enumerate(pods):
            env = pod_env(container, pod, objects)
            if expand(argument(command, "--host"), env) != pod_ip(pod):
                faults.append(f"{pod}: vLLM binds {argument(command, '--host')}, not the pod's IP")
            listed = events[index] if index < len(events) else None
            faults += _events_faults(command, env, listed, pod, resolve, exposed)
            try:
                settings = load_config(local, environ=env)
                role = KeyRole.PRODUCER if component == "prefill" else KeyRole.CONSUMER
                keys = load_keys(settings.secret_file, role, env)
            except ConfigError as exc:
                faults.append(f"{pod}: its connector refuses its config: {exc}")
                continue
            if _keys_or_fault(keys, pod, faults) != proxy_keys:
                faults.append(f"{pod}: its deployment secret is not the proxy's")
            if component == "prefill":
                if settings.warm_peers != [peer_text(d) for d in proxy.decode]:
                    faults.append(f"{pod}: warm_peers {settings.warm_peers} are not decode's")
                continue
            entry = proxy.decode[index] if index < len(proxy.decode) else None
            if entry is None or entry.receiver_host != f"{pod}.{domain}":
                faults.append(f"{pod}: the proxy names {entry and entry.receiver_host}, not it")
                continue
            if {settings.receiver_host, resolve.get(entry.receiver_host)} != {pod_ip(pod)}:
                faults.append(f"{pod}: binds its KV ports on {settings.receiver_host}, not its IP")
                continue
            listed = list(zip(ports_of(entry.init_port), ports_of(entry.alloc_port), strict=True))
            own = [settings.for_rank(r) for r in range(len(ports_of(settings.init_port)))]
            if listed != [(r.init_port, r.alloc_port) for r in own]:
                faults.append(f"{pod}: the proxy lists ports {listed}, its ranks bind others")
            if not {port for pair in listed for port in pair} <= exposed:
                faults.append(f"{pod}: KV ports {listed} are not all container ports")
    return faults


def _keys_or_fault(keys: DeploymentKeys | None, who: str, faults: list[str]) -> str | None:
    """The deployment a process's share of the secret is of (None: none given)."""
    if keys is None:
        faults.append(f"{who}: no deployment secret reaches it")
        return None
    return keys.deployment


def ports_of(ports: int | list[int]) -> list[int]:
    return ports if isinstance(ports, list) else [ports]


def proxy_deployment_config_path(deployment: Manifest) -> str:
    command = container_of(deployment)["command"]
    assert command[:2] == ["lmcache-pd", "proxy"]
    return command[2]


@pytest.mark.parametrize("name", SHIPPED)
def test_every_object_of_the_shipped_pools_is_valid_kubernetes(name: str) -> None:
    objects = manifests(shipped(name))
    assert [o["kind"] for o in objects].count("ConfigMap") == 3
    for manifest in objects:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)


def test_the_validator_refuses_a_broken_object() -> None:
    service = one(manifests(shipped("pools.yaml")), "Service", "proxy")
    broken = copy.deepcopy(service)
    broken["spec"]["ports"][0]["port"] = "eighty"
    with pytest.raises(kubernetes_validate.ValidationError, match="eighty"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = copy.deepcopy(service)
    broken["spec"]["colour"] = "blue"  # strict: an unknown field is refused too
    with pytest.raises(kubernetes_validate.ValidationError, match="colour"):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("name", SHIPPED)
def test_the_shipped_pools_are_wired_together(name: str, tmp_path: Path) -> None:
    assert wiring_faults(manifests(shipped(name)), tmp_path) == []


@pytest.mark.parametrize(
    ("name", "expected"), [("pools-tp2p-tp1d.yaml", {"prefill_tp_size": 2}), ("pools-tp2.yaml", {})]
)
def test_a_decode_pod_knows_the_prefills_tp_size_where_it_differs(
    name: str, expected: dict[str, int]
) -> None:
    data = one(manifests(shipped(name)), "ConfigMap", "decode")["data"]
    settings = yaml.safe_load(data["decode.yaml"])
    assert {k: v for k, v in settings.items() if k == "prefill_tp_size"} == expected


def _decode(objects: list[Manifest]) -> Manifest:
    return container_of(one(objects, "StatefulSet", "decode"))


def _break_kv_port(objects: list[Manifest]) -> None:
    _decode(objects)["ports"][1]["containerPort"] += 100


def _break_selector(objects: list[Manifest]) -> None:
    one(objects, "Service", "proxy")["spec"]["selector"]["app.kubernetes.io/component"] = "x"


def _break_service_name(objects: list[Manifest]) -> None:
    one(objects, "StatefulSet", "decode")["spec"]["serviceName"] = "elsewhere"


def _break_receiver_host(objects: list[Manifest]) -> None:
    [env] = [e for e in _decode(objects)["env"] if e["name"].endswith("RECEIVER_HOST")]
    env["value"] = "0.0.0.0"


def _break_vllm_host(objects: list[Manifest]) -> None:
    command = container_of(one(objects, "StatefulSet", "prefill"))["command"]
    command[command.index("--host") + 1] = "0.0.0.0"


def _break_events_port(objects: list[Manifest]) -> None:
    command = _decode(objects)["command"]
    at = command.index("--kv-events-config") + 1
    command[at] = command[at].replace(":5570", ":5580")  # publishes where nobody follows


def _break_secret_item(objects: list[Manifest]) -> None:
    [env] = [e for e in _decode(objects)["env"] if e["name"] == SECRET_ENV]
    env["valueFrom"]["secretKeyRef"]["key"] = "instance-api-key"  # a secret, not the deployment's


def _break_share_role(objects: list[Manifest]) -> None:
    [env] = [e for e in _decode(objects)["env"] if e["name"] == SECRET_ENV]
    env["valueFrom"]["secretKeyRef"]["key"] = "kv-producer"  # decode given a producer's share


def _break_proxy_secret(objects: list[Manifest]) -> None:
    container = container_of(one(objects, "Deployment", "proxy"))
    container["env"] = [e for e in container["env"] if e["name"] != SECRET_ENV]


def _break_warm_peers(objects: list[Manifest]) -> None:
    data = one(objects, "ConfigMap", "prefill")["data"]
    data["prefill.yaml"] = data["prefill.yaml"].replace(":55556", ":55600")


def _break_config_mount(objects: list[Manifest]) -> None:
    _decode(objects)["volumeMounts"][0]["mountPath"] = "/etc/elsewhere"


def _break_probe(objects: list[Manifest]) -> None:
    _decode(objects)["readinessProbe"]["httpGet"]["port"] = "metrics"


def _break_replicas(objects: list[Manifest]) -> None:
    one(objects, "StatefulSet", "prefill")["spec"]["replicas"] += 1


def _break_service_links(objects: list[Manifest]) -> None:
    del one(objects, "StatefulSet", "decode")["spec"]["template"]["spec"]["enableServiceLinks"]


@pytest.mark.parametrize(
    "breaks",
    [
        _break_kv_port,
        _break_selector,
        _break_service_name,
        _break_receiver_host,
        _break_vllm_host,
        _break_events_port,
        _break_secret_item,
        _break_share_role,
        _break_proxy_secret,
        _break_warm_peers,
        _break_config_mount,
        _break_probe,
        _break_replicas,
        _break_service_links,
    ],
)
def test_the_wiring_check_catches_a_broken_manifest(
    breaks: Callable[[list[Manifest]], None], tmp_path: Path
) -> None:
    objects = manifests(shipped("pools-2p1d.yaml"))
    breaks(objects)
    assert wiring_faults(objects, tmp_path)


def test_kubernetes_settings_reach_every_object(tmp_path: Path) -> None:
    pools = shipped(
        "pools-tp2.yaml",
        image="registry.example/lmcache-pd:0.1",
        namespace="llm",
        name_prefix="pd",
        model_claim="models",
        model_sub_path="tiny-llama",
        model_mount_path="/models/tiny",
        http_port=8100,
        kv_port_base=40000,
        kv_events_port=41000,
        proxy_service_type="NodePort",
        proxy_service_port=80,
        gpu_resource="nvidia.com/gpu",
    )
    objects = manifests(pools)
    for manifest in objects:
        kubernetes_validate.validate(manifest, KUBERNETES_VERSION, strict=True)
        assert manifest["metadata"]["namespace"] == "llm"
        assert manifest["metadata"]["name"].startswith("pd-")
    assert wiring_faults(objects, tmp_path) == []
    decode = _decode(objects)
    assert decode["image"] == "registry.example/lmcache-pd:0.1"
    assert decode["resources"]["limits"] == {"nvidia.com/gpu": "2"}
    ports = [8100, 40000, 40001, 40002, 40003, 41000, 41001]
    assert [p["containerPort"] for p in decode["ports"]] == ports
    volumes = one(objects, "StatefulSet", "decode")["spec"]["template"]["spec"]["volumes"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    } in volumes
    assert {
        "name": "model",
        "mountPath": "/models/tiny",
        "readOnly": True,
        "subPath": "tiny-llama",
    } in decode["volumeMounts"]
    proxy = one(objects, "Service", "proxy")["spec"]
    assert proxy["type"] == "NodePort" and proxy["ports"][0]["port"] == 80


def test_requests_come_from_the_pools_file() -> None:
    pools = shipped("pools.yaml")
    spec = pools.decode[0]
    bigger = InstanceSpec(config=spec.config, num_cpus=1.5, memory_gib=2.5)
    pools = msgspec.structs.replace(pools, decode=[bigger, bigger], kv_cache_gib=2)
    decode = _decode(manifests(pools))
    assert decode["resources"] == {"requests": {"cpu": "1500m", "memory": "4608Mi"}}
    prefill = container_of(one(manifests(pools), "StatefulSet", "prefill"))
    assert prefill["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "2"} in decode["env"]


@pytest.mark.parametrize(
    "args", [["--kv-cache-memory-bytes", "134217728"], ["--kv-cache-memory-bytes=134217728"]]
)
def test_a_kv_cache_sized_in_bytes_is_not_overridden_by_the_gib_variable(args: list[str]) -> None:
    """vLLM on CPU lets ``VLLM_CPU_KVCACHE_SPACE`` override ``--kv-cache-memory-bytes``
    whenever it is set: an instance whose arguments size its cache in bytes gets none. Control:
    without them, ``kv_cache_gib``'s value."""
    pools = shipped("pools.yaml")
    sized = msgspec.structs.replace(pools, vllm_args=[*pools.vllm_args, *args])
    names = {entry["name"] for entry in _decode(manifests(sized))["env"]}
    assert "VLLM_CPU_KVCACHE_SPACE" not in names
    assert "VLLM_CPU_KVCACHE_SPACE" not in server_env(cpu=None, args=args)
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "1"} in _decode(manifests(pools))["env"]
    assert server_env(cpu=None)["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_decodes_landed_boards_live_on_the_pods_memory_volume() -> None:
    """The consumer's serving loop writes its landed board's pages on every landing: they must
    not be on the image's disk-backed /tmp (``landed_board.py``)."""
    decode = _decode(manifests(shipped("pools.yaml")))
    [base] = [e["value"] for e in decode["env"] if e["name"] == "VLLM_RPC_BASE_PATH"]
    assert {"name": "dshm", "mountPath": base} in decode["volumeMounts"]


def test_one_hosts_cores_stay_out_of_the_pods() -> None:
    """``cpus`` and ``thread_cpus`` name cores of the host ``serve`` runs on; a pod has its own.
    Control: the same instance's environment on that host pins our threads."""
    pools = shipped("pools.yaml")
    assert pools.decode[0].thread_cpus is not None
    assert instance_env(pools, pools.decode[0])[THREAD_CPUS_ENV] == "1"
    for component in ("decode", "prefill"):
        container = container_of(one(manifests(pools), "StatefulSet", component))
        names = {variable["name"] for variable in container["env"]}
        assert not names & {THREAD_CPUS_ENV, "VLLM_CPU_OMP_THREADS_BIND"}, names


def test_instances_of_a_pool_that_differ_in_their_pods_are_refused() -> None:
    pools = shipped("pools-2p1d.yaml")  # its prefill instances differ in cpus only: allowed
    assert one(manifests(pools), "StatefulSet", "prefill")["spec"]["replicas"] == 2
    other = msgspec.structs.replace(pools.prefill[1], env={"X": "1"})
    with pytest.raises(ConfigError, match=r"prefill\[1\] differs from prefill\[0\] in env"):
        manifests(msgspec.structs.replace(pools, prefill=[pools.prefill[0], other]))


def test_the_command_prints_the_stream_or_writes_a_file_per_object(tmp_path: Path) -> None:
    runner = CliRunner()
    printed = runner.invoke(app, ["k8s", str(CONFIGS / "pools.yaml")])
    assert printed.exit_code == 0, printed.output
    objects = list(yaml.safe_load_all(printed.stdout))
    assert to_yaml(objects) == printed.stdout
    written = runner.invoke(app, ["k8s", str(CONFIGS / "pools.yaml"), "--output", str(tmp_path)])
    assert written.exit_code == 0, written.output
    files = sorted(tmp_path.glob("*.yaml"))
    # Each run writes a fresh instance key and secret: the same objects, but for their values.
    for secret in (o for o in objects if o["kind"] == "Secret"):
        secret["stringData"] = {item: "<fresh>" for item in secret["stringData"]}
    generated = manifests(load_pools(CONFIGS / "pools.yaml"))
    for secret in (o for o in generated if o["kind"] == "Secret"):
        secret["stringData"] = {item: "<fresh>" for item in secret["stringData"]}
    assert objects == generated
    in_files = [yaml.safe_load(f.read_text()) for f in files]
    for secret in (o for o in in_files if o["kind"] == "Secret"):
        secret["stringData"] = {item: "<fresh>" for item in secret["stringData"]}
    assert in_files == objects
    assert files[0].name == "00-lmcache-pd-prefill-configmap.yaml"


@pytest.mark.parametrize("drain_timeout_s", [120.0, 7.5])
def test_a_terminating_vllm_pod_has_the_grace_its_drain_needs(drain_timeout_s: float) -> None:
    """Kubernetes' rule: the grace period covers the preStop hook (none) and the shutdown, which
    is vLLM's ``--shutdown-timeout`` (the drain, whole seconds) and its teardown after it."""
    pools = msgspec.structs.replace(shipped("pools.yaml"), drain_timeout_s=drain_timeout_s)
    objects = manifests(pools)
    for component in ("prefill", "decode"):
        workload = one(objects, "StatefulSet", component)
        pod = workload["spec"]["template"]["spec"]
        container = container_of(workload)
        shutdown_s = int(argument(container["command"], "--shutdown-timeout"))
        assert shutdown_s >= drain_timeout_s
        assert "preStop" not in container.get("lifecycle", {})
        assert pod["terminationGracePeriodSeconds"] >= shutdown_s + DRAIN_EXIT_MARGIN_S
