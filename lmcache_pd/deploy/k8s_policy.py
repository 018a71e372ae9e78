"""The NetworkPolicies of ``lmcache-pd k8s``'s manifests: which pods may reach which ports of a
deployment's pods.

One policy per component selects its pods by their labels and lists what they take (ingress
only: what pods send is not limited); anything else sent to them is dropped:

| to | ports | from |
| --- | --- | --- |
| decode | KV init (per rank), UCX's TCP ports | prefill pods |
| decode | KV alloc (per rank) | prefill pods, the proxy (KV drops) |
| decode, prefill | vLLM's HTTP, KV events (``routing: kv``: publisher, replay) | the proxy |
| proxy | HTTP | anyone (its clients) |
| proxy | first-token notices | prefill pods |

UCX's TCP transport, NIXL's path between pods, listens on ports of its own beside the KV ports,
one per network interface and rank; prefill connects to decode's and never the other way (only
a producer adds peers), so decode pods pin theirs to a range (``UCX_TCP_PORT_RANGE``) that
their policy names. Kubelet probes come from the node, which a NetworkPolicy always admits;
RDMA bypasses the kernel, and so every NetworkPolicy. The policies only hold where the cluster's
network plugin enforces NetworkPolicy (Calico, Cilium, ...); the deployment secret holds
everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmcache_pd.deploy.k8s_workloads import Manifest, Names

# A range of ports: first and last, both included.
PortRange = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Admit:
    """One ingress rule: ``ports`` of a component's pods, from the pods of the ``sources``
    components (None: from anywhere)."""

    ports: tuple[int | PortRange, ...]
    sources: tuple[str, ...] | None


def deployment_policies(
    names: Names,
    *,
    http_port: int,
    init_ports: list[int],
    alloc_ports: list[int],
    ucx_ports: PortRange,
    proxy_port: int,
    notice_port: int,
    events_ports: list[int],
) -> list[Manifest]:
    """The policies of decode's, prefill's and the proxy's pods, in that order."""
    return [
        network_policy(
            names,
            "decode",
            [
                Admit((*init_ports, *alloc_ports, ucx_ports), ("prefill",)),
                Admit((http_port, *alloc_ports, *events_ports), ("proxy",)),
            ],
        ),
        network_policy(names, "prefill", [Admit((http_port, *events_ports), ("proxy",))]),
        network_policy(
            names, "proxy", [Admit((proxy_port,), None), Admit((notice_port,), ("prefill",))]
        ),
    ]


def network_policy(names: Names, component: str, rules: list[Admit]) -> Manifest:
    """A component's pods take only what ``rules`` admit."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": names.metadata(component),
        "spec": {
            "podSelector": {"matchLabels": names.labels(component)},
            "policyTypes": ["Ingress"],
            "ingress": [_rule(names, rule) for rule in rules],
        },
    }


def _rule(names: Names, rule: Admit) -> Manifest:
    entry: Manifest = {"ports": [_port(port) for port in rule.ports]}
    if rule.sources is not None:
        # A podSelector alone selects pods of the policy's own namespace: the deployment's.
        entry["from"] = [{"podSelector": {"matchLabels": names.labels(s)}} for s in rule.sources]
    return entry


def _port(port: int | PortRange) -> Manifest:
    if isinstance(port, tuple):
        return {"protocol": "TCP", "port": port[0], "endPort": port[1]}
    return {"protocol": "TCP", "port": port}
