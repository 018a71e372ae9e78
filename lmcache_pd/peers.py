"""A consumer rank's receive address, and its text in a producer's ``warm_peers``.

The text is ``host:init_port:alloc_port``, or for a tensor-parallel consumer ``host:i0,i1:a0,a1``
(one port per rank, indexed by rank). Deployment writes it (``format_peer``), the config keeps each
producer rank's own (``rank_peer``), and the producer's senders parse it (``parse_peer``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, NamedTuple

import msgspec

from lmcache_pd.protocol import DisaggSpec

PeerText = Annotated[
    str, msgspec.Meta(pattern=r"^[A-Za-z0-9.-]+:[0-9]{1,5}(,[0-9]{1,5})*:[0-9]{1,5}(,[0-9]{1,5})*$")
]


class PeerAddress(NamedTuple):
    """Where one consumer rank receives: its host, init port and alloc port."""

    host: str
    init_port: int
    alloc_port: int

    @classmethod
    def of(cls, spec: DisaggSpec) -> PeerAddress:
        """The consumer rank ``spec`` names (single ports: ``DisaggSpec.for_rank``)."""
        assert isinstance(spec.receiver_init_port, int)
        assert isinstance(spec.receiver_alloc_port, int)
        return cls(spec.receiver_host, spec.receiver_init_port, spec.receiver_alloc_port)


def format_peer(host: str, init_port: int | Sequence[int], alloc_port: int | Sequence[int]) -> str:
    """The text of a consumer's receive address; ports listed per rank are comma-separated."""

    def joined(ports: int | Sequence[int]) -> str:
        return str(ports) if isinstance(ports, int) else ",".join(str(p) for p in ports)

    return f"{host}:{joined(init_port)}:{joined(alloc_port)}"


def rank_peer(text: str, rank: int) -> PeerAddress | None:
    """Rank ``rank``'s address in ``text``; None if the text lists no port for that rank."""
    host, init_ports, alloc_ports = text.rsplit(":", 2)
    init, alloc = init_ports.split(","), alloc_ports.split(",")
    if rank >= len(init) or rank >= len(alloc):
        return None
    return PeerAddress(host, int(init[rank]), int(alloc[rank]))


def parse_peer(text: str) -> PeerAddress:
    """The address in the text of one consumer rank (``host:init_port:alloc_port``)."""
    host, init_port, alloc_port = text.rsplit(":", 2)
    return PeerAddress(host, int(init_port), int(alloc_port))


def peer_spec(text: str, req_id: str) -> DisaggSpec:
    """A DisaggSpec naming the consumer of ``text`` (a port per rank where it lists several)
    for the request ``req_id``: what a producer pushes to unasked (its ``default_peer``)."""
    host, init_ports, alloc_ports = text.rsplit(":", 2)
    init = [int(port) for port in init_ports.split(",")]
    alloc = [int(port) for port in alloc_ports.split(",")]
    return DisaggSpec(
        req_id,
        host,
        init[0] if len(init) == 1 else init,
        alloc[0] if len(alloc) == 1 else alloc,
    )
