"""The consumer rank's counters, each named once, with the help text of those that reach vLLM's
``/metrics``.

A consumer's ``stats_snapshot`` holds every counter of ``ConsumerStats``, those of ``CacheCounts``
prefixed ``cache_``, those of ``LimitCounts``, and the buffer's use. Decode's worker reports the
ones in ``EXPORTED_COUNTERS`` and ``EXPORTED_GAUGES`` to vLLM (``connector/consumer_worker.py``),
which shows them as ``lmcache_pd_consumer_<name>`` (``connector/stats.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

_HELP = "help"


def _exported(help_text: str) -> Any:
    """A counter that reaches ``/metrics``, with ``help_text`` as its description there."""
    return field(default=0, metadata={_HELP: help_text})


@dataclass(slots=True)
class ConsumerStats:
    """Counters of one consumer rank since it started."""

    init_requests: int = 0
    alloc_requests: int = 0
    malformed_messages: int = _exported("Malformed or out-of-bounds messages refused.")
    # Of malformed_messages, messages of more than one body frame, refused before any decode.
    refused_extra_frames: int = _exported(
        "Of those, messages of more than one body frame, refused unread."
    )
    version_mismatches: int = 0
    refused_buffer_full: int = _exported(
        "Allocations refused as buffer_full: no room, or one of the consumer's limits."
    )
    refused_too_large: int = 0
    refused_dropped: int = _exported("Pushes refused: their request was let go already.")
    requests_abandoned: int = _exported("KVAbandoned notices the consumer received.")
    chunks_allocated: int = 0
    chunks_already_held: int = 0
    chunks_landed: int = _exported("Chunks whose write the consumer saw confirmed.")
    bytes_landed: int = _exported("Bytes of chunks the consumer saw confirmed.")
    pages_reserved: int = 0  # handed out ahead of any push (ReserveRequest)
    # Of chunks_landed, written into pages reserved ahead.
    chunks_landed_reserved: int = _exported(
        "Of those, chunks written into pages reserved ahead, with no allocation round trip."
    )
    unknown_notifications: int = 0
    allocations_cancelled: int = 0
    internal_errors: int = _exported("Unexpected errors caught in the consumer's process.")
    service_stalls: int = _exported("Times the consumer's service loop stopped turning for 2 s.")
    leases_expired: int = _exported("Allocations whose write never came, taken back.")
    holds_expired: int = _exported("Requests whose pages lapsed unclaimed or unreleased.")
    integrity_failures: int = 0
    handshakes_refused: int = _exported("Producer handshakes refused for incompatible KV.")
    refused_for_role: int = _exported(
        "Alloc-port messages refused: the proxy's key may only let a request go."
    )
    self_tests_landed: int = 0
    chunks_kept: int = _exported(
        "Chunks decode computed itself (a request it served alone) kept in this cache."
    )


@dataclass(slots=True)
class CacheCounts:
    """What the cache of landed chunks saved and cost."""

    hits: int = _exported("Chunks asked for that had landed already: not written again.")
    misses: int = _exported("Chunks given a fresh page of the receive buffer.")
    evictions: int = _exported("Cached chunks nobody held, evicted for room.")
    bytes_not_resent: int = _exported("Bytes of chunks not written again (cache hits).")
    not_needed: int = _exported("Chunks decode's own prefix cache had: not written.")
    local_hits: int = _exported(
        "Chunks landed for earlier requests that a request decode served alone loaded."
    )
    not_kept: int = _exported(
        "Chunks pushed for a request that asked to keep nothing (lmcache.skip_save, "
        "priority_limit), let go with it instead of cached."
    )


@dataclass(slots=True)
class LimitCounts:
    """Times the consumer's bounds on per-peer and per-request state were reached."""

    dropped_forgotten_early: int = _exported(
        "Requests let go that were forgotten before dropped_memory_s: too many remembered."
    )
    refused_holds_full: int = _exported(
        "Allocations refused (buffer_full): too many requests hold pages already."
    )
    refused_producer_share: int = _exported(
        "Allocations refused (buffer_full): their producer held over max_producer_share of the "
        "buffer while another waited for room."
    )


def _help_texts(counters: type, prefix: str = "") -> dict[str, str]:
    return {prefix + f.name: f.metadata[_HELP] for f in fields(counters) if _HELP in f.metadata}


# Snapshot counters that reach /metrics, by name, with their help text.
EXPORTED_COUNTERS: Mapping[str, str] = MappingProxyType(
    {
        **_help_texts(ConsumerStats),
        **_help_texts(CacheCounts, "cache_"),
        **_help_texts(LimitCounts),
        "peers_refused": "CURVE clients refused at the handshake: keys of no role its ports "
        "admit (auth.py).",
    }
)
# Snapshot gauges (the buffer's use now) that reach /metrics, by name, with their help text.
EXPORTED_GAUGES: Mapping[str, str] = MappingProxyType(
    {
        "used_pages": "Pages of the consumer's receive buffer held or being written.",
        "cached_pages": "Pages keeping a landed chunk nobody holds, for reuse.",
        "held_requests": "Requests whose chunks the consumer holds.",
        "unauthenticated": "1 while the consumer listens beyond loopback with no deployment "
        "secret: any process that reaches it can write into its KV cache.",
        "reserved_pages": "Pages reserved ahead for producers, not written yet.",
        "dropped_requests": "Requests let go that the consumer remembers, to refuse their pushes.",
    }
)
