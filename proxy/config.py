"""The proxy's settings: which prefill and decode instances exist, and every deadline it keeps.

Validated by msgspec like the transfer config: unknown keys, wrong types and bad ranges are
refused with the key's name before a socket opens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
import yaml

from lmcache_pd.affinity import CPU_LIST
from lmcache_pd.errors import ConfigError
from lmcache_pd.protocol import Port, RankPorts

# Measured 2026-11-24 (benchmarks/selective.py, results/selective.json; 3 runs recommended 256,
# 64, 256): below this, decode computing the prompt costs its running streams less than one
# inter-token latency, while PD adds ~3-20 ms to the first token and a transfer.
MIN_DISAGG_TOKENS = 256
Seconds = Annotated[float, msgspec.Meta(gt=0, le=3600)]
Url = Annotated[str, msgspec.Meta(pattern=r"^https?://[^/]+$")]


class PrefillInstance(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A producer vLLM: only its HTTP address matters to the proxy."""

    url: Url


class DecodeInstance(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A consumer vLLM: its HTTP address, and where its connector receives KV (the DisaggSpec
    that prefill is told to push to). A tensor-parallel instance lists a port per rank."""

    url: Url
    receiver_host: Annotated[str, msgspec.Meta(min_length=1)]
    init_port: Port | RankPorts
    alloc_port: Port | RankPorts

    def __post_init__(self) -> None:
        ranks = [len(p) if isinstance(p, list) else 1 for p in (self.init_port, self.alloc_port)]
        if ranks[0] != ranks[1]:
            raise ValueError(f"init_port lists {ranks[0]} rank(s), alloc_port {ranks[1]}")


class Timeouts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Upstream deadlines. Decode's read timeout is the longest gap allowed between two events of
    its stream, so it must cover the consumer's own wait for KV (``load_timeout_s``) plus the
    recompute that may follow."""

    # Generous: a refused connection fails at once anyway; this bounds a host that is gone
    # silently, and a loaded 2-core machine was seen taking over 3 s to accept one.
    connect_s: Seconds = 10.0
    prefill_read_s: Seconds = 120.0
    decode_read_s: Seconds = 120.0
    health_s: Seconds = 2.0


class ProxyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One proxy in front of prefill and decode pools serving one model."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    prefill: Annotated[list[PrefillInstance], msgspec.Meta(min_length=1)]
    decode: Annotated[list[DecodeInstance], msgspec.Meta(min_length=1)]
    host: str = "127.0.0.1"
    port: Port = 8000
    timeouts: Timeouts = msgspec.field(default_factory=Timeouts)
    # How often every instance's /health is asked; one failure marks it down, one success up.
    health_interval_s: Seconds = 2.0
    # Upper bound on a client's request body; larger ones are refused before parsing.
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024)] = 8 << 20
    # Ask prefill's engine to send each request's first token straight to the proxy (a ZMQ
    # socket on ``host``, on a port the system picks), so that decode is asked on it, before
    # prefill's HTTP answer arrives; the answer is still what the client sees. False: decode
    # is asked on the answer only.
    first_token_notices: bool = True
    # Where to append one JSON line per request with its phases' times (None: nowhere).
    trace_path: str | None = None
    # Prompts of fewer tokens are served by a decode instance alone, with no transfer (0: every
    # prompt is disaggregated). The default is where PD's first token stops costing more than
    # decode's own on this project's machines (benchmarks/selective.py).
    min_disagg_tokens: Annotated[int, msgspec.Meta(ge=0)] = MIN_DISAGG_TOKENS
    # A model folder whose tokenizer.json counts text prompts near that threshold (None: such
    # texts are disaggregated).
    tokenizer: str | None = None
    # CPUs the proxy runs on, e.g. "1" or "4-5" (None: any), on a host it shares with vLLM.
    cpus: Annotated[str, msgspec.Meta(pattern=f"^{CPU_LIST.pattern}$")] | None = None


def proxy_config(raw: object, source: str = "<dict>") -> ProxyConfig:
    """Validate a decoded mapping; raises ``ConfigError`` naming ``source`` and the bad key."""
    try:
        return msgspec.convert(raw, ProxyConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid proxy config {source}: {exc}") from exc


def load_proxy_config(path: str | Path) -> ProxyConfig:
    """Read and validate a proxy YAML file."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read proxy config {path}: {exc}") from exc
    return proxy_config(raw, str(path))
