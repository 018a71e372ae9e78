"""The proxy's settings: which prefill and decode instances exist, and every deadline it keeps.

Validated by msgspec like the transfer config: unknown keys, wrong types and bad ranges are
refused with the key's name before a socket opens. The two keys (the clients', the instances')
may come from the environment instead (``LMCACHE_PD_PROXY_API_KEY``,
``LMCACHE_PD_PROXY_INSTANCE_API_KEY``) or from a file, so that no secret has to sit in YAML.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

import msgspec
import yaml

from lmcache_pd.affinity import CPU_LIST
from lmcache_pd.auth import DeploymentKeys, Role, load_keys
from lmcache_pd.errors import ConfigError
from lmcache_pd.protocol import Port, RankPorts
from lmcache_pd.request_body import MAX_BODY_BYTES

# Measured 2026-11-24 (benchmarks/selective.py, results/selective.json; 3 runs recommended 256,
# 64, 256): below this, decode computing the prompt costs its running streams less than one
# inter-token latency, while PD adds ~3-20 ms to the first token and a transfer.
MIN_DISAGG_TOKENS = 256
# Blocks the proxy's KV index remembers per instance: 256 Ki blocks of 16 tokens are 4 Mi
# tokens, more than a CPU instance caches; ~200 bytes each (``prefix_index.py``).
MAX_INDEX_BLOCKS = 1 << 18
# Requests the proxy serves at once; past it a client gets 503 with Retry-After. vLLM's own
# serving benchmark sends its default 1000 prompts at once, which must all be taken.
MAX_IN_FLIGHT = 1024
# ``lmcache_pd.config.PROXY_ENV_PREFIX``, which the transfer config leaves alone (that module
# loads torch on some paths, which the proxy never does; a test keeps the two equal).
PROXY_ENV_PREFIX = "LMCACHE_PD_PROXY_"
API_KEY_ENV = f"{PROXY_ENV_PREFIX}API_KEY"
INSTANCE_API_KEY_ENV = f"{PROXY_ENV_PREFIX}INSTANCE_API_KEY"
Seconds = Annotated[float, msgspec.Meta(gt=0, le=3600)]
Url = Annotated[str, msgspec.Meta(pattern=r"^https?://[^/]+$")]
# What an HTTP Bearer token may hold here: visible ASCII, no spaces.
ApiKey = Annotated[str, msgspec.Meta(pattern=r"^[\x21-\x7e]+$", max_length=1024)]


class KVEventsAddress(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where an instance publishes its KV events (vLLM's ``--kv-events-config``): the PUB port
    and the replay ROUTER port, both CURVE servers under the deployment secret."""

    host: Annotated[str, msgspec.Meta(min_length=1)]
    port: Port
    replay_port: Port

    def endpoint(self, port: int) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{port}"


class PrefillInstance(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A producer vLLM: its HTTP address, and where it publishes its KV events (None: it does
    not; routing then knows nothing of its cache)."""

    url: Url
    kv_events: KVEventsAddress | None = None


class DecodeInstance(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A consumer vLLM: its HTTP address, and where its connector receives KV (the DisaggSpec
    that prefill is told to push to). A tensor-parallel instance lists a port per rank."""

    url: Url
    receiver_host: Annotated[str, msgspec.Meta(min_length=1)]
    init_port: Port | RankPorts
    alloc_port: Port | RankPorts
    kv_events: KVEventsAddress | None = None

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
    # Upper bound on a client's request body; larger ones are refused before parsing. At most
    # half of what an instance reads (``request_body.MAX_BODY_BYTES``).
    max_body_bytes: Annotated[int, msgspec.Meta(ge=1024, le=MAX_BODY_BYTES // 2)] = 8 << 20
    # Ask prefill's engine to send each request's first token straight to the proxy (a ZMQ
    # socket on ``host``, on a port the system picks), so that decode is asked on it, before
    # prefill's HTTP answer arrives; the answer is still what the client sees. False: decode
    # is asked on the answer only.
    first_token_notices: bool = True
    # The port of that socket (None: one the system picks); fixed where a firewall names it
    # (the Kubernetes manifests' NetworkPolicy).
    notice_port: Port | None = None
    # Where to append one JSON line per request with its phases' times (None: nowhere).
    trace_path: str | None = None
    # Prompts of fewer tokens are served by a decode instance alone, with no transfer (0: every
    # prompt is disaggregated). The default is where PD's first token stops costing more than
    # decode's own on this project's machines (benchmarks/selective.py).
    min_disagg_tokens: Annotated[int, msgspec.Meta(ge=0)] = MIN_DISAGG_TOKENS
    # Times one request's answer may go on on another decode instance after its decode fails
    # under it (proxy/migration.py; 0: the answer ends with an error).
    decode_migrations: Annotated[int, msgspec.Meta(ge=0, le=8)] = 2
    # How instances are chosen: "kv" scores each by the prompt tokens its prefix cache holds
    # (from the KV events of the instances that publish them) against its load, and serves a
    # prompt whose uncached part is under min_disagg_tokens by decode alone; "load": the
    # least-outstanding instance, and the prompt's whole length decides; "cache_aware": decode as
    # vLLM's own router picks it, by a record of the prompts sent to each (proxy/cache_aware.py:
    # for comparison, with no KV events), and the prompt's whole length decides.
    routing: Literal["kv", "load", "cache_aware"] = "kv"
    # Blocks remembered per instance by the KV index, or by cache_aware's record (oldest
    # forgotten first).
    kv_index_max_blocks: Annotated[int, msgspec.Meta(ge=1)] = MAX_INDEX_BLOCKS
    # A model folder whose tokenizer.json counts text prompts near that threshold (None: such
    # texts are disaggregated).
    tokenizer: str | None = None
    # CPUs the proxy runs on, e.g. "1" or "4-5" (None: any), on a host it shares with vLLM.
    cpus: Annotated[str, msgspec.Meta(pattern=f"^{CPU_LIST.pattern}$")] | None = None
    # The key clients must send (``Authorization: Bearer KEY``) on every /v1/* request, or a
    # file holding it (None: no key is asked for). /health and /metrics stay open.
    api_key: ApiKey | None = None
    api_key_file: str | None = None
    # The key the proxy sends to every instance (vLLM's ``--api-key``), or a file holding it;
    # the launcher gives the instances it starts one of their own.
    instance_api_key: ApiKey | None = None
    instance_api_key_file: str | None = None
    # Requests served at once; more get 503 with Retry-After.
    max_in_flight: Annotated[int, msgspec.Meta(ge=1)] = MAX_IN_FLIGHT
    # The file of the deployment secret or the proxy's share of it (``lmcache_pd/auth.py``;
    # None: $LMCACHE_PD_SECRET, or none): first-token notices, KV drops and KV events then pass
    # only between instances of this deployment and the proxy.
    secret_file: str | None = None

    def __post_init__(self) -> None:
        for key in ("api_key", "instance_api_key"):
            if getattr(self, key) is not None and getattr(self, f"{key}_file") is not None:
                raise ValueError(f"{key} and {key}_file: name the key once")

    def client_key(self) -> str | None:
        """The key clients must send; ``ConfigError`` if its file cannot be read."""
        return _key(self.api_key, self.api_key_file, "api_key_file")

    def instance_key(self) -> str | None:
        """The key the instances want; ``ConfigError`` if its file cannot be read."""
        return _key(self.instance_api_key, self.instance_api_key_file, "instance_api_key_file")

    def deployment_keys(self) -> DeploymentKeys | None:
        """The proxy's share of the KV channel's keys (``auth.py``); ``ConfigError`` if the
        secret is unusable or the share another role's."""
        return load_keys(self.secret_file, Role.PROXY)

    def instance_headers(self) -> dict[str, str]:
        """What a call to an instance's /v1/* carries (nothing when the instances want no key)."""
        key = self.instance_key()
        return {} if key is None else {"Authorization": f"Bearer {key}"}


def _key(inline: str | None, path: str | None, name: str) -> str | None:
    """A key given inline, or read from ``path`` (surrounding whitespace dropped)."""
    if path is None:
        return inline
    try:
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}: cannot read {path}: {exc}") from exc
    try:
        return msgspec.convert(text, ApiKey)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{name}: {path} holds no usable key ({exc})") from exc


def with_env_keys(config: ProxyConfig, environ: Mapping[str, str] | None = None) -> ProxyConfig:
    """``config`` with the keys the environment names (``API_KEY_ENV``, ``INSTANCE_API_KEY_ENV``)
    in place of its own; ``ConfigError`` naming the variable for an unusable one."""
    environ = os.environ if environ is None else environ
    changes: dict[str, str | None] = {}
    for key, variable in (("api_key", API_KEY_ENV), ("instance_api_key", INSTANCE_API_KEY_ENV)):
        if not environ.get(variable):
            continue
        try:
            changes |= {key: msgspec.convert(environ[variable], ApiKey), f"{key}_file": None}
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{variable}: not a usable key ({exc})") from exc
    return msgspec.structs.replace(config, **changes) if changes else config


def proxy_config(raw: object, source: str = "<dict>") -> ProxyConfig:
    """Validate a decoded mapping; raises ``ConfigError`` naming ``source`` and the bad key."""
    try:
        return msgspec.convert(raw, ProxyConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid proxy config {source}: {exc}") from exc


def load_proxy_config(path: str | Path, environ: Mapping[str, str] | None = None) -> ProxyConfig:
    """Read and validate a proxy YAML file, with the keys ``environ`` names (by default this
    process's environment) in place of its own."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read proxy config {path}: {exc}") from exc
    return with_env_keys(proxy_config(raw, str(path)), environ)
