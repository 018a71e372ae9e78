"""One typed configuration for a producer or consumer, from YAML with ``LMCACHE_PD_*`` overrides.

Validation is msgspec's (the same library as the wire protocol): unknown keys, wrong types and
out-of-range values are refused with the key's name, before any socket or buffer exists.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml

from lmcache_pd import protocol
from lmcache_pd.affinity import CPU_LIST
from lmcache_pd.auth import SECRET_ENV
from lmcache_pd.errors import ConfigError
from lmcache_pd.peers import PeerText, format_peer, rank_peer

ENV_PREFIX = "LMCACHE_PD_"
# Names the YAML file itself; never an override of a field (nor is the secret, ``SECRET_ENV``).
CONFIG_PATH_ENV = "LMCACHE_PD_CONFIG"
# The proxy's own variables (its keys, ``proxy/config.py``): never a transfer setting, so a
# vLLM started from the same shell as ``serve`` is not refused for them.
PROXY_ENV_PREFIX = f"{ENV_PREFIX}PROXY_"

Seconds = Annotated[float, msgspec.Meta(gt=0, le=3600)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class PDConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Settings of one producer or consumer instance. Ports are the consumer's own (a list
    indexed by rank for a tensor-parallel consumer: rank r binds ``init_port[r]`` and
    ``alloc_port[r]``), or, on a producer, unused: a producer learns where to send from each
    request's DisaggSpec. ``for_rank`` gives one rank's settings."""

    kv_role: Literal["kv_producer", "kv_consumer"]
    chunk_size: PositiveInt = 256
    page_bytes: Annotated[int, msgspec.Meta(ge=1, le=protocol.MAX_PAGE_BYTES)] = 1 << 20
    buffer_size_bytes: PositiveInt = 1 << 30
    # Where the staging (producer) or receive (consumer) buffer lives: CPU memory (NIXL
    # DRAM; pinned when the KV cache is on a GPU), or the KV cache's GPU memory (NIXL VRAM,
    # chunks never cross to the host; needs a CUDA torch and integrity_checksums off, since
    # the checksum is computed over host bytes).
    buffer_device: Literal["cpu", "cuda"] = "cpu"
    receiver_host: protocol.HostName = "127.0.0.1"
    init_port: protocol.Port | protocol.RankPorts = 55555
    alloc_port: protocol.Port | protocol.RankPorts = 55556
    handshake_timeout_s: Seconds = protocol.HANDSHAKE_TIMEOUT_S
    alloc_timeout_s: Seconds = protocol.ALLOC_TIMEOUT_S
    # Producer: the longest a write may take; it is shortened to end before the consumer's
    # lease (stated in the handshake) does.
    transfer_timeout_s: Seconds = protocol.TRANSFER_TIMEOUT_S
    # Consumer: an allocated page waits this long for its write, then is taken back.
    alloc_lease_s: Seconds = protocol.ALLOC_LEASE_S
    # Consumer: pages pushed for a request no decode has claimed go back after this...
    claim_timeout_s: Seconds = protocol.CLAIM_TIMEOUT_S
    # ... and pages of a claimed request nobody released, after this.
    hold_timeout_s: Seconds = protocol.HOLD_TIMEOUT_S
    # Consumer: the share of the receive buffer that landed chunks no request holds any more
    # may keep, as a cache for later prompts that share them (evicted least recently used
    # first, and whenever an allocation needs their room); 0 turns the cache off.
    cache_share: Annotated[float, msgspec.Meta(ge=0, le=1)] = 1.0
    # Consumer: a request of a vLLM priority above this (vLLM serves lower values first) keeps
    # none of its KV in that cache once loaded, as under LMCache's priority_limit (its KV is
    # still pushed and loaded); None: every request keeps its KV there, unless it asks not to
    # (``lmcache.skip_save`` in its kv_transfer_params).
    priority_limit: int | None = None
    # Consumer: while another producer waits for room (it was refused an allocation for a full
    # buffer within the last few seconds), no one producer may hold more than this share of
    # the receive buffer (pages it waits to write, reserved ahead, or pushed for requests no
    # decode claimed yet); beyond it, its allocations are refused as buffer_full. Alone, a
    # producer may use the whole buffer.
    max_producer_share: Annotated[float, msgspec.Meta(gt=0, le=1)] = protocol.MAX_PRODUCER_SHARE
    # Producer: consumer ranks to shake hands with ahead of their first request (the launcher
    # names every decode rank here), so that no request waits for NIXL's connect.
    warm_peers: list[PeerText] = msgspec.field(default_factory=list)
    # Producer: the consumer a request that names no DisaggSpec is pushed to, under a req_id of
    # the producer's own (LMCache's 1p1d shape, whose proxy names none: the sender's configured
    # peer); None: such a request is computed and pushed nowhere.
    default_peer: PeerText | None = None
    # Producer: LMCache's proxy (its pd_proxy_host/pd_proxy_port), sent a ProxyNotif per
    # decode rank once that rank's KV has landed (``lmcache_proxy.py``), tagged as its
    # generation decodes it; None: no notices.
    lmcache_proxy_host: protocol.HostName | None = None
    lmcache_proxy_port: protocol.Port | None = None
    lmcache_proxy_tag: Literal["ProxyNotif", "NixlProxyNotif"] = "ProxyNotif"
    max_alloc_retries: Annotated[int, msgspec.Meta(ge=0, le=100)] = protocol.MAX_ALLOC_RETRIES
    # Producer: a push of at most this many chunks writes at once into pages its consumer rank
    # reserved for it ahead (asked for, a few pushes' worth at a time, while a write is in
    # flight), with no allocation round trip, but also writes a chunk the consumer may hold
    # already (larger pushes ask first and skip those). 0: every push asks first.
    reserved_pages: Annotated[int, msgspec.Meta(ge=0, le=protocol.MAX_RESERVED_PAGES)] = 1
    load_timeout_s: Seconds = protocol.LOAD_TIMEOUT_S
    # Consumer: the tensor-parallel size of the prefill instances it takes KV from, where it
    # differs from decode's own (None: the same). Each decode rank then receives its KV heads
    # from the prefill ranks that hold them (``tp_parts.py``); the launcher sets it from the
    # pools file. A prefill of another size is refused at handshake, naming both.
    prefill_tp_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] | None = None
    # Consumer: load a request whose KV has landed on every rank before the step that computes
    # its last token (vLLM's synchronous load), not in a step of its own first: its second token
    # comes a step sooner. False: every load asynchronous.
    sync_loads: bool = True
    # Consumer: a request that names no transfer parameters and whose prompt's chunks have not
    # all shown landed waits up to this long after it arrived for them (LMCache's proxy sends
    # decode the prompt and first token, with no parameters, once prefill said the KV landed;
    # decode's view of its consumer's chunks lags a landing by up to 50 ms), then loads what
    # landed and computes the rest; and a push no decode claims is no fault (such requests
    # never claim one): its hold lapsing is logged at debug. 0: no wait (lmcache-pd's proxy,
    # whose requests served alone have nothing coming).
    landed_wait_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 0.0
    integrity_checksums: bool = True
    # Where a vLLM worker's connector appends one JSON line per push or load (None: nowhere).
    trace_path: str | None = None
    # Load under a vLLM of a minor version the suite never ran (connector/vllm_version.py), with
    # a warning, instead of refusing to.
    allow_untested_vllm: bool = False
    # Level of lmcache-pd's own log lines inside processes it does not own (vLLM, children).
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    nixl_backends: Annotated[list[str], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: ["UCX"]
    )
    # Measured on one host (see benchmarks/transfer.py): error mode "none" with no progress
    # thread is several times faster for small writes than UCX's defaults. A cut link is then
    # never reported by UCX, which is why every wait of ours has a deadline.
    ucx_error_handling_mode: Literal["none", "peer"] = "none"
    nixl_progress_thread: bool = False
    # Exported as UCX_TLS before a NIXL agent exists; None leaves UCX's own choice. A consumer's
    # one agent uses it for every producer; a producer uses it for consumers on its own network
    # stack (same kernel and network, IPC and PID namespaces: see transport.py)...
    ucx_tls: str | None = None
    # ... and this for consumers on any other (another host, pod or network namespace), where
    # UCX's own choice moves no notification (measured). "all" or None: UCX's own choice.
    ucx_tls_remote: str | None = "tcp"
    # Producer: prove the chosen transports at handshake with one small WRITE whose notification
    # must reach the consumer within self_test_timeout_s; if it does not and
    # transport_fallback is on, try TCP; if nothing passes, the handshake fails naming the peer
    # and what was tried (the request is recomputed by its decode).
    transport_self_test: bool = True
    transport_fallback: bool = True
    self_test_timeout_s: Seconds = protocol.PROBE_TIMEOUT_S
    # CPUs lmcache-pd's own threads (service, senders, watchdog) run on, e.g. "2-3"; None: every
    # CPU. Not vLLM's inference core, which they would otherwise inherit (see affinity.py).
    thread_cpus: Annotated[str, msgspec.Meta(pattern=f"^{CPU_LIST.pattern}$")] | None = None
    # A file holding the deployment secret (``auth.py``), or this role's share of it, from which
    # every ZMQ socket of ours authenticates and encrypts and NIXL notifications are sealed;
    # None: $LMCACHE_PD_SECRET,
    # and with neither, no authentication (a consumer listening beyond loopback warns).
    secret_file: str | None = None

    def __post_init__(self) -> None:
        if _count(self.init_port) != _count(self.alloc_port):
            raise ValueError(
                f"init_port lists {_count(self.init_port)} rank(s), alloc_port "
                f"{_count(self.alloc_port)}"
            )
        if self.claim_timeout_s > self.hold_timeout_s:
            raise ValueError(
                f"claim_timeout_s ({self.claim_timeout_s}) must not exceed hold_timeout_s "
                f"({self.hold_timeout_s})"
            )
        if self.buffer_device == "cuda":
            _check_cuda_buffer(self.integrity_checksums)
        if (self.lmcache_proxy_host is None) != (self.lmcache_proxy_port is None):
            raise ValueError("lmcache_proxy_host and lmcache_proxy_port go together")
        if self.buffer_size_bytes < self.page_bytes:
            raise ValueError(
                f"buffer_size_bytes ({self.buffer_size_bytes}) is smaller than one page "
                f"(page_bytes={self.page_bytes})"
            )

    def for_rank(self, rank: int) -> PDConfig:
        """Rank ``rank``'s settings: its own receive ports (single ones: a one-rank instance
        uses the first), and of each warm peer only the consumer rank it pushes to (peers
        with no port for ``rank`` are left out). ``ConfigError`` if a consumer rank has no
        ports of its own."""
        init, alloc = _as_list(self.init_port), _as_list(self.alloc_port)
        own = rank
        if rank >= len(init):
            if self.kv_role == "kv_consumer":
                raise ConfigError(
                    f"consumer rank {rank} has no receive ports: init_port and alloc_port list "
                    f"{len(init)} rank(s); give one port per tensor-parallel rank"
                )
            own = 0  # a producer binds none: any listed value stays valid
        peers = [format_peer(*peer) for text in self.warm_peers if (peer := rank_peer(text, rank))]
        return replace(self, init_port=init[own], alloc_port=alloc[own], warm_peers=peers)

    @property
    def num_pages(self) -> int:
        """Pages of ``page_bytes`` that fit in the buffer."""
        return self.buffer_size_bytes // self.page_bytes

    @property
    def cache_pages(self) -> int:
        """The most pages that idle cached chunks keep."""
        return int(self.num_pages * self.cache_share)


def _check_cuda_buffer(integrity_checksums: bool) -> None:
    """``buffer_device: cuda`` is refused where it cannot work, before anything is allocated."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError(
            "buffer_device is cuda, but torch here has no CUDA device "
            f"(torch {torch.__version__}); use buffer_device: cpu"
        )
    if integrity_checksums:
        raise ValueError(
            "buffer_device cuda needs integrity_checksums: false (the checksum is computed "
            "over host bytes, and chunks in GPU memory never reach the host)"
        )


def _as_list(ports: int | list[int]) -> list[int]:
    return [ports] if isinstance(ports, int) else ports


def _count(ports: int | list[int]) -> int:
    return len(_as_list(ports))


def replace(config: PDConfig, **changes: object) -> PDConfig:
    """``config`` with ``changes``, validated again like a loaded one."""
    try:
        return msgspec.convert({**msgspec.structs.asdict(config), **changes}, PDConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config after setting {sorted(changes)}: {exc}") from exc


def _env_overrides(environ: Mapping[str, str]) -> dict[str, object]:
    """``LMCACHE_PD_INIT_PORT=6000`` -> ``{"init_port": 6000}``; values are YAML scalars/lists."""
    fields = set(PDConfig.__struct_fields__)
    overrides: dict[str, object] = {}
    for name, raw in environ.items():
        if (
            not name.startswith(ENV_PREFIX)
            or name in (CONFIG_PATH_ENV, SECRET_ENV)
            or name.startswith(PROXY_ENV_PREFIX)
        ):
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in fields:
            raise ConfigError(f"unknown setting {name} (known: {', '.join(sorted(fields))})")
        try:
            overrides[key] = yaml.safe_load(raw)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{name}: cannot parse {raw!r}: {exc}") from exc
    return overrides


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    **overrides: object,
) -> PDConfig:
    """Read ``path`` (or ``$LMCACHE_PD_CONFIG``), apply environment then keyword overrides, and
    validate. Raises ``ConfigError`` naming the file and the key at fault."""
    environ = os.environ if environ is None else environ
    path = path or environ.get(CONFIG_PATH_ENV)
    raw: object = {}
    source = "<defaults>"
    if path:
        source = str(path)
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config {source}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ConfigError(f"{source}: top level must be a mapping, got {type(raw).__name__}")
    merged = {**raw, **_env_overrides(environ), **overrides}
    cpus = merged.get("thread_cpus")
    if isinstance(cpus, int) and not isinstance(cpus, bool):
        merged["thread_cpus"] = str(cpus)  # YAML reads one CPU ("thread_cpus: 1") as a number
    try:
        return msgspec.convert(merged, PDConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid config {source}: {exc}") from exc
