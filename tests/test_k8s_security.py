"""The trust boundary of ``lmcache-pd k8s``'s manifests, checked offline: the NetworkPolicies
read as a cluster enforces them (``admitted``: a pod selected by an Ingress policy takes only
what some rule of it admits), against the flows the deployment's own configs need (``needed``);
and the deployment secret's reach. Each check has a negative control: a mutated manifest it must
catch."""

from __future__ import annotations

import asyncio
import copy
import itertools
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import msgspec
import pytest
import yaml

from lmcache_pd.auth import SECRET_ENV
from lmcache_pd.deploy.k8s import UCX_PORT_RANGE_ENV, manifests
from lmcache_pd.deploy.pools import KubernetesSpec
from lmcache_pd.errors import ConfigError
from lmcache_pd.first_token import NoticeBoard
from lmcache_pd.peers import rank_peer
from lmcache_pd.proxy.config import ProxyConfig, proxy_config
from tests.test_k8s import SHIPPED, Manifest, container_of, one, shipped

COMPONENTS = ("prefill", "decode", "proxy")
# The instances' key, and each role's share of the deployment secret (no item holds the secret).
SECRET_ITEMS = {"instance-api-key", "kv-producer", "kv-consumer", "kv-proxy"}


@dataclass(frozen=True)
class Pod:
    """A pod that may send: its namespace and labels."""

    namespace: str
    labels: tuple[tuple[str, str], ...]

    def label_map(self) -> dict[str, str]:
        return dict(self.labels)


def workload(objects: list[Manifest], component: str) -> Manifest:
    kind = "Deployment" if component == "proxy" else "StatefulSet"
    return one(objects, kind, component)


def pod_of(objects: list[Manifest], component: str) -> Pod:
    found = workload(objects, component)
    labels = found["spec"]["template"]["metadata"]["labels"]
    return Pod(found["metadata"]["namespace"], tuple(sorted(labels.items())))


def selects(selector: Manifest, labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector  # the only kind of selector we write
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def ucx_range(container: Manifest) -> set[int]:
    """The ports ``UCX_TCP_PORT_RANGE`` in the container's environment names (none unset)."""
    [value] = [e["value"] for e in container["env"] if e["name"] == UCX_PORT_RANGE_ENV] or ["0-"]
    first, _, last = value.partition("-")
    return set(range(int(first), int(last) + 1)) if last else set()


def listening(objects: list[Manifest], component: str) -> set[int]:
    """Every port a component's pods listen on beyond their loopback: those their container
    declares and UCX's range."""
    container = container_of(workload(objects, component))
    return {p["containerPort"] for p in container["ports"]} | ucx_range(container)


def _port_matches(rule_ports: list[Manifest] | None, port: int, container: Manifest) -> bool:
    if not rule_ports:
        return True
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    for entry in rule_ports:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        first = named.get(entry["port"]) if isinstance(entry["port"], str) else entry["port"]
        if first is not None and first <= port <= entry.get("endPort", first):
            return True
    return False


def _source_matches(peers: list[Manifest] | None, source: Pod, namespace: str) -> bool:
    if not peers:
        return True
    for peer in peers:
        assert set(peer) == {"podSelector"}, peer  # no namespaceSelector nor ipBlock written
        if source.namespace == namespace and selects(peer["podSelector"], source.label_map()):
            return True
    return False


def admitted(objects: list[Manifest], source: Pod, component: str, port: int) -> bool:
    """Whether a connection from ``source`` to ``port`` of a ``component`` pod gets through, as
    NetworkPolicy says: a pod no Ingress policy selects takes everything; a selected one takes
    what any rule of any policy selecting it admits."""
    target = workload(objects, component)
    labels = target["spec"]["template"]["metadata"]["labels"]
    namespace = target["metadata"]["namespace"]
    policies = [
        o["spec"]
        for o in objects
        if o["kind"] == "NetworkPolicy"
        and o["metadata"]["namespace"] == namespace
        and "Ingress" in o["spec"]["policyTypes"]
        and selects(o["spec"]["podSelector"], labels)
    ]
    if not policies:
        return True
    return any(
        _port_matches(rule.get("ports"), port, container_of(target))
        and _source_matches(rule.get("from"), source, namespace)
        for policy in policies
        for rule in policy.get("ingress", [])
    )


def needed(objects: list[Manifest]) -> set[tuple[str, str, int]]:
    """(source, target, port) of every connection the deployment makes, read from its own
    configs: the proxy to every instance URL and KV-event ports and decode's alloc ports (KV
    drops), prefill to its warm peers (every decode rank's KV ports) and decode's UCX range,
    prefill to the proxy's notice port. ``*`` is any source (the proxy's clients)."""
    proxy_map = one(objects, "ConfigMap", "proxy")["data"]["proxy.yaml"]
    proxy: ProxyConfig = proxy_config(yaml.safe_load(proxy_map))
    prefill_map = one(objects, "ConfigMap", "prefill")["data"]["prefill.yaml"]
    flows = {("*", "proxy", proxy.port)}
    assert proxy.notice_port is not None
    flows.add(("prefill", "proxy", proxy.notice_port))
    for role, members in (("prefill", proxy.prefill), ("decode", proxy.decode)):
        for member in members:
            flows.add(("proxy", role, urlsplit(member.url).port))
            if member.kv_events is not None:  # routing: kv follows each instance's events
                events = member.kv_events
                flows |= {("proxy", role, port) for port in (events.port, events.replay_port)}
    for member in proxy.decode:
        alloc = member.alloc_port if isinstance(member.alloc_port, list) else [member.alloc_port]
        flows |= {("proxy", "decode", port) for port in alloc}
    for peer in yaml.safe_load(prefill_map)["warm_peers"]:
        ranks = itertools.takewhile(bool, (rank_peer(peer, r) for r in itertools.count()))
        flows |= {("prefill", "decode", p) for a in ranks for p in (a.init_port, a.alloc_port)}
    decode = container_of(workload(objects, "decode"))
    flows |= {("prefill", "decode", port) for port in ucx_range(decode)}
    return flows


def policy_faults(objects: list[Manifest]) -> list[str]:
    """Where the policies admit other than what the deployment needs, among every pod of ours,
    one of another app beside them, and a twin of each of ours in another namespace."""
    flows = needed(objects)
    ours = {c: pod_of(objects, c) for c in COMPONENTS}
    namespace = ours["proxy"].namespace
    strangers = {
        "other app": Pod(namespace, (("app", "other"),)),
        **{f"{c} elsewhere": Pod(f"{namespace}-x", pod.labels) for c, pod in ours.items()},
    }
    faults = []
    for name, source in {**ours, **strangers}.items():
        for component in COMPONENTS:
            for port in sorted(listening(objects, component)):
                want = ("*", component, port) in flows or (name, component, port) in flows
                if admitted(objects, source, component, port) != want:
                    verb = "reaches" if not want else "cannot reach"
                    faults.append(f"{name} {verb} {component}:{port}")
    return faults


def selector_faults(objects: list[Manifest]) -> list[str]:
    """Each policy selects exactly the pods of its own component, and each of its sources
    exactly one component's pods; between them they select every workload's pods."""
    pods = {c: pod_of(objects, c).label_map() for c in COMPONENTS}
    faults = []
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    for policy in policies:
        name = policy["metadata"]["name"]
        chosen = [c for c, labels in pods.items() if selects(policy["spec"]["podSelector"], labels)]
        if [policy["metadata"]["name"]] != [
            workload(objects, c)["metadata"]["name"] for c in chosen
        ]:
            faults.append(f"{name} selects {chosen}")
        for rule in policy["spec"]["ingress"]:
            for peer in rule.get("from", []):
                sources = [c for c, labels in pods.items() if selects(peer["podSelector"], labels)]
                if len(sources) != 1:
                    faults.append(f"{name}: a rule's source selects {sources}")
    covered = {
        c
        for c, labels in pods.items()
        for p in policies
        if selects(p["spec"]["podSelector"], labels)
    }
    if covered != set(COMPONENTS):
        faults.append(f"no policy selects {sorted(set(COMPONENTS) - covered)}")
    return faults


def port_faults(objects: list[Manifest]) -> list[str]:
    """The ports each policy admits (from anyone) are exactly those its pods listen on."""
    faults = []
    for policy in (o for o in objects if o["kind"] == "NetworkPolicy"):
        component = policy["metadata"]["labels"]["app.kubernetes.io/component"]
        opened = set()
        for rule in policy["spec"]["ingress"]:
            for entry in rule["ports"]:
                opened |= set(range(entry["port"], entry.get("endPort", entry["port"]) + 1))
        if opened != listening(objects, component):
            faults.append(f"{policy['metadata']['name']}: admits {sorted(opened)}")
    return faults


def secret_faults(objects: list[Manifest]) -> list[str]:
    """The Secret holds the instances' key and each role's share of the deployment secret;
    every container of ours reads its own role's share (prefill the producer's, decode the
    consumer's, the proxy its own) as ``LMCACHE_PD_SECRET`` and the instances' key as its own
    variable, from that Secret; no other variable reads an item, and no value appears in any
    other object."""
    [secret] = [o for o in objects if o["kind"] == "Secret"]
    items = secret["stringData"]
    faults = [] if set(items) == SECRET_ITEMS else [f"the Secret holds {sorted(items)}"]
    wanted = {
        "prefill": {SECRET_ENV: "kv-producer", "VLLM_API_KEY": "instance-api-key"},
        "decode": {SECRET_ENV: "kv-consumer", "VLLM_API_KEY": "instance-api-key"},
        "proxy": {
            SECRET_ENV: "kv-proxy",
            "LMCACHE_PD_PROXY_INSTANCE_API_KEY": "instance-api-key",
        },
    }
    for component, variables in wanted.items():
        for container in workload(objects, component)["spec"]["template"]["spec"]["containers"]:
            read = {
                e["name"]: e["valueFrom"]["secretKeyRef"]
                for e in container.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})
            }
            named = {
                name: ref["key"]
                for name, ref in read.items()
                if ref["name"] == secret["metadata"]["name"]
            }
            if named != variables or len(read) != len(named):
                faults.append(f"{component}/{container['name']} reads {read}")
    for other in objects:
        if other is not secret and any(v in yaml.safe_dump(other) for v in items.values()):
            faults.append(f"{other['kind']} {other['metadata']['name']} holds a secret's value")
    return faults


@pytest.mark.parametrize("name", SHIPPED)
def test_the_policies_admit_exactly_what_the_deployment_needs(name: str) -> None:
    objects = manifests(shipped(name))
    assert policy_faults(objects) == []
    assert selector_faults(objects) == []
    assert port_faults(objects) == []


@pytest.mark.parametrize("name", SHIPPED)
def test_the_secret_reaches_every_container_that_needs_it_and_no_other(name: str) -> None:
    assert secret_faults(manifests(shipped(name))) == []


def test_each_generation_draws_a_fresh_secret() -> None:
    first, second = (
        one(manifests(shipped("pools.yaml")), "Secret", "secrets")["stringData"] for _ in (0, 1)
    )
    assert first.keys() == second.keys() == SECRET_ITEMS
    assert all(first[item] != second[item] for item in SECRET_ITEMS)


def _relabel_decode_pods(objects: list[Manifest]) -> None:
    """Decode's pods, its StatefulSet and Service agree on a new label; the policy is left."""
    decode = workload(objects, "decode")
    for labels in (
        decode["spec"]["template"]["metadata"]["labels"],
        decode["spec"]["selector"]["matchLabels"],
        one(objects, "Service", "decode")["spec"]["selector"],
    ):
        labels["app.kubernetes.io/component"] = "decoder"


def _policy_on_another_instance(objects: list[Manifest]) -> None:
    selector = one(objects, "NetworkPolicy", "prefill")["spec"]["podSelector"]["matchLabels"]
    selector["app.kubernetes.io/instance"] = "other"


def _alloc_port_moved(objects: list[Manifest]) -> None:
    ports = one(objects, "NetworkPolicy", "decode")["spec"]["ingress"][1]["ports"]
    ports[1]["port"] += 100


def _kv_ports_open_to_all(objects: list[Manifest]) -> None:
    del one(objects, "NetworkPolicy", "decode")["spec"]["ingress"][0]["from"]


def _notice_port_from_decode(objects: list[Manifest]) -> None:
    rule = one(objects, "NetworkPolicy", "proxy")["spec"]["ingress"][1]
    rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] = "decode"


def _ucx_range_narrower(objects: list[Manifest]) -> None:
    ports = one(objects, "NetworkPolicy", "decode")["spec"]["ingress"][0]["ports"]
    ports[-1]["endPort"] -= 1


@pytest.mark.parametrize(
    "breaks",
    [
        _relabel_decode_pods,
        _policy_on_another_instance,
        _alloc_port_moved,
        _kv_ports_open_to_all,
        _notice_port_from_decode,
        _ucx_range_narrower,
    ],
)
def test_the_policy_checks_catch_a_mutated_manifest(
    breaks: Callable[[list[Manifest]], None],
) -> None:
    objects = manifests(shipped("pools-2p1d.yaml"))
    breaks(objects)
    assert policy_faults(objects) + selector_faults(objects) + port_faults(objects)


def _secret_in_a_config_map(objects: list[Manifest]) -> None:
    value = one(objects, "Secret", "secrets")["stringData"]["kv-consumer"]
    data = one(objects, "ConfigMap", "decode")["data"]
    data["decode.yaml"] += f"# {value}\n"


def _secret_read_into_another_variable(objects: list[Manifest]) -> None:
    env = container_of(workload(objects, "prefill"))["env"]
    [key] = [e for e in env if e["name"] == "VLLM_API_KEY"]
    key["valueFrom"]["secretKeyRef"]["key"] = "kv-producer"


def _secret_left_out_of_prefill(objects: list[Manifest]) -> None:
    container = container_of(workload(objects, "prefill"))
    container["env"] = [e for e in container["env"] if e["name"] != SECRET_ENV]


def _producer_share_given_to_the_proxy(objects: list[Manifest]) -> None:
    env = container_of(one(objects, "Deployment", "proxy"))["env"]
    [share] = [e for e in env if e["name"] == SECRET_ENV]
    share["valueFrom"]["secretKeyRef"]["key"] = "kv-producer"


@pytest.mark.parametrize(
    "breaks",
    [
        _secret_in_a_config_map,
        _secret_read_into_another_variable,
        _secret_left_out_of_prefill,
        _producer_share_given_to_the_proxy,
    ],
)
def test_the_secret_check_catches_a_mutated_manifest(
    breaks: Callable[[list[Manifest]], None],
) -> None:
    objects = manifests(shipped("pools.yaml"))
    breaks(objects)
    assert secret_faults(objects)


def test_the_admitted_check_is_the_cluster_s_rule() -> None:
    """Without policies a pod takes everything; with them, a stranger reaches the proxy's HTTP
    port and none of decode's."""
    objects = manifests(shipped("pools.yaml"))
    stranger = Pod("default", (("app", "other"),))
    assert not admitted(objects, stranger, "decode", 55555)
    assert admitted(objects, stranger, "proxy", 8000)
    bare = [o for o in copy.deepcopy(objects) if o["kind"] != "NetworkPolicy"]
    assert admitted(bare, stranger, "decode", 55555)


def test_decode_ports_that_would_meet_are_refused() -> None:
    def with_kubernetes(**settings: object) -> None:
        pools = shipped("pools-tp2.yaml")
        kubernetes = msgspec.convert(settings, KubernetesSpec)
        manifests(msgspec.structs.replace(pools, kubernetes=kubernetes))

    with pytest.raises(ConfigError, match="http_port 55570 is among"):
        with_kubernetes(http_port=55570)
    with pytest.raises(ConfigError, match="below 65536"):
        with_kubernetes(kv_port_base=65501)  # its last UCX port would be 65536
    with_kubernetes(http_port=55555 + 4 + 32)  # the first port after decode's: allowed
    with pytest.raises(ConfigError, match="kv_events_port 7999"):
        with_kubernetes(kv_events_port=7999)  # its replay port would be vLLM's HTTP port
    with pytest.raises(ConfigError, match="kv_events_port 55570"):
        with_kubernetes(kv_events_port=55570)  # among decode's UCX ports
    with pytest.raises(ConfigError, match="below 65536"):
        with_kubernetes(kv_events_port=65535)
    with_kubernetes(kv_events_port=7998)  # right below vLLM's: allowed
    pools = shipped("pools.yaml")
    proxy = msgspec.structs.replace(pools.proxy, port=5557)
    with pytest.raises(ConfigError, match="first-token notices"):
        manifests(msgspec.structs.replace(pools, proxy=proxy))


def test_the_proxy_listens_for_notices_on_the_port_its_policy_names() -> None:
    """``notice_port`` fixes the port (the manifests' proxy names one); None leaves the system's
    choice, as before."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    fixed = NoticeBoard("127.0.0.1", None, free)
    chosen = NoticeBoard("127.0.0.1", None)
    try:
        assert fixed.port == free
        assert fixed.address_for("http://127.0.0.1:8100") == f"tcp://127.0.0.1:{free}"
        assert chosen.port != free
    finally:
        asyncio.run(fixed.close())
        asyncio.run(chosen.close())
