"""An LMCache PD deployment's configuration, read as LMCache reads it and mapped onto ours.

A vLLM started for LMCache PD names ``"kv_connector": "LMCacheConnectorV1"``; pointed at
``"kv_connector_module_path": "lmcache_pd.connector"`` it gets our connector under that name,
which reads this configuration in place of our own YAML (``connector/facade.py``). Its sources,
each overriding the one before, as LMCache's code applies them: the YAML file named by
``LMCACHE_CONFIG_FILE``, ``LMCACHE_<KEY>`` variables (``LMCACHE_PD_ROLE`` is LMCache's
``pd_role`` here, never one of our ``LMCACHE_PD_*`` overrides), and the keys of vLLM's
``kv_connector_extra_config`` that start with ``lmcache.``.

Three generations of keys are still in users' hands: today's (``enable_pd``, ``pd_*``), the
xpyd era's (``enable_xpyd``, ``nixl_role``, ``nixl_peer_*``, ``nixl_proxy_*``, which LMCache
now reads as aliases of today's; their files set ``enable_nixl`` too), and the oldest
examples' (``enable_nixl``, ``nixl_receiver_host``, ``nixl_receiver_port``). One
configuration speaks one of them: keys of two are refused, naming them. What maps onto ours
(``MAPPED``) does; the keys of LMCache's own storage and features that mean nothing here are
named once in a warning; a missing required key or a value that contradicts vLLM's ``kv_role``
fails the start, naming the key.

Its request options are read per request (``protocol.KVTransferParams``): ``lmcache.tag.*``
becomes part of chunk keys, ``lmcache.skip_save`` and ``priority_limit`` (mapped here) keep a
request's KV out of decode's cache of landed chunks. ``save_decode_cache: true`` is named in a
warning of its own: decode keeps the KV it generates in vLLM's prefix cache only.

Their proxy's protocol: a sender with a proxy address (``pd_proxy_host``/``pd_proxy_port``;
the xpyd era's ``nixl_proxy_*``) sends it a ``ProxyNotif`` per decode rank once that rank's KV
landed (``lmcache_proxy.py``, tagged as that generation's proxy decodes it); a sender with a
peer (``pd_peer_*``) pushes a request that names no ``disagg_spec`` there (the 1p1d shape) and
connects to it ahead; a receiver serves requests that name no transfer parameters (their proxy
sends decode the prompt and first token bare) from the chunks landed for them, waiting briefly
for the last to show (``LANDED_WAIT_S``), and expects no push to be claimed
(``CLAIM_TIMEOUT_S``).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from lmcache_pd.config import PDConfig, load_config
from lmcache_pd.errors import ConfigError
from lmcache_pd.peers import format_peer

logger = logging.getLogger(__name__)

CONFIG_FILE_ENV = "LMCACHE_CONFIG_FILE"
ENV_PREFIX = "LMCACHE_"
EXTRA_PREFIX = "lmcache."
# The connector name an LMCache deployment's vLLM asks for.
CONNECTOR_NAME = "LMCacheConnectorV1"

# Each generation's names for the settings that matter here (None: it has none).
_SETTINGS = (
    "enabled",
    "role",
    "buffer_size",
    "buffer_device",
    "host",
    "init",
    "alloc",
    "proxy",
    "proxy_port",
)
GENERATIONS: dict[str, dict[str, str | None]] = {
    "pd": {
        "enabled": "enable_pd",
        "role": "pd_role",
        "buffer_size": "pd_buffer_size",
        "buffer_device": "pd_buffer_device",
        "host": "pd_peer_host",
        "init": "pd_peer_init_port",
        "alloc": "pd_peer_alloc_port",
        "proxy": "pd_proxy_host",
        "proxy_port": "pd_proxy_port",
    },
    "xpyd": {
        "enabled": "enable_xpyd",
        "role": "nixl_role",
        "buffer_size": "nixl_buffer_size",
        "buffer_device": "nixl_buffer_device",
        "host": "nixl_peer_host",
        "init": "nixl_peer_init_port",
        "alloc": "nixl_peer_alloc_port",
        "proxy": "nixl_proxy_host",
        "proxy_port": "nixl_proxy_port",
    },
    "nixl": {
        "enabled": "enable_nixl",
        "role": "nixl_role",
        "buffer_size": "nixl_buffer_size",
        "buffer_device": "nixl_buffer_device",
        "host": "nixl_receiver_host",
        "init": "nixl_receiver_port",  # its one port; our alloc port is the next one
        "alloc": None,
        "proxy": None,
        "proxy_port": None,
    },
}
# Keys only one generation has: what tells them apart. ``enable_nixl`` is not one: the xpyd
# era's files set it beside ``enable_xpyd``.
_OWN_KEYS = {
    "pd": {"enable_pd", *(k for k in GENERATIONS["pd"].values() if k)},
    "xpyd": {"enable_xpyd", "nixl_peer_host", "nixl_peer_init_port", "nixl_peer_alloc_port"}
    | {"nixl_proxy_host", "nixl_proxy_port"},
    "nixl": {"nixl_receiver_host", "nixl_receiver_port", "nixl_peer_port"},
}
# The message each generation's proxy decodes (``lmcache_proxy.py``).
PROXY_TAGS = {"pd": "ProxyNotif", "xpyd": "NixlProxyNotif"}
# Keys mapped whatever the generation.
COMMON = {"chunk_size": "chunk_size", "nixl_backends": "nixl_backends"}
# Every key this module reads (the rest are named in the warning).
MAPPED = frozenset(
    {k for g in GENERATIONS.values() for k in g.values() if k}
    | set(COMMON)
    | {"pd_allocation_timeout_sec", "transfer_channel", "save_unfull_chunk"}
    | {"priority_limit", "save_decode_cache"}
)
ROLES = {"sender": "kv_producer", "receiver": "kv_consumer"}
# A receiver: how long a request with no transfer parameters waits for its chunks to show
# landed (``PDConfig.landed_wait_s``). Their proxy asks decode once every notice came; what
# decode's scheduler sees of its consumer lags a landing by up to 50 ms, and a loaded host more.
LANDED_WAIT_S = 0.5
# A receiver: its pushes are never claimed (their proxy sends decode no transfer parameters),
# so a push's pages are held this long for the request that loads them, then join the cache.
CLAIM_TIMEOUT_S = 5.0


def configured(extra: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> bool:
    """Whether an LMCache configuration is given at all (its file, a variable of one of its
    keys, an ``lmcache.`` extra)."""
    environ = os.environ if environ is None else environ
    return bool(_raw(extra, environ, warn=False))


def load_lmcache_config(
    extra: Mapping[str, Any], kv_role: str, environ: Mapping[str, str] | None = None
) -> PDConfig:
    """Our settings from the LMCache configuration in effect; ``ConfigError`` naming the key at
    fault."""
    environ = os.environ if environ is None else environ
    raw = _raw(extra, environ, warn=True)
    generation = _generation(raw)
    names = GENERATIONS[generation]

    def get(setting: str) -> Any:
        key = names[setting]
        return None if key is None else raw.get(key)

    if not _flag(get("enabled")):
        raise ConfigError(
            f"{names['enabled']} is not true: this connector serves disaggregated prefill only"
        )
    role = _required(get("role"), names["role"])
    if str(role).lower() not in ROLES:
        raise ConfigError(f"{names['role']}: {role!r} is neither sender nor receiver")
    if ROLES[str(role).lower()] != kv_role:
        raise ConfigError(f"{names['role']} {role!r} contradicts vLLM's kv_role {kv_role!r}")
    if str(raw.get("transfer_channel") or "nixl").lower() != "nixl":
        raise ConfigError(f"transfer_channel {raw['transfer_channel']!r}: only nixl is served")
    settings: dict[str, Any] = {
        "buffer_size_bytes": _int(_required(get("buffer_size"), names["buffer_size"])),
    }
    device = get("buffer_device")
    if device is not None:
        settings["buffer_device"] = "cuda" if str(device).startswith("cuda") else str(device)
    for key, ours in COMMON.items():
        if raw.get(key) is not None:
            settings[ours] = _int(raw[key]) if key == "chunk_size" else _strings(raw[key])
    limit = raw.get("priority_limit")
    if limit is not None:
        try:
            settings["priority_limit"] = int(limit)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"priority_limit: {limit!r} is not a whole number") from exc
    if _flag(raw.get("save_decode_cache")):
        logger.warning(
            "save_decode_cache: true is not supported: decode keeps the KV it generates in "
            "vLLM's prefix cache only (published to the KV-aware router as vLLM's own KV "
            "events), never in lmcache-pd's cache of landed chunks"
        )
    timeout = raw.get("pd_allocation_timeout_sec")
    if timeout is not None and math.isfinite(float(timeout)):
        settings["alloc_timeout_s"] = float(timeout)
    host = get("host")
    if kv_role == "kv_consumer":
        init = _ports(_required(get("init"), names["init"] or ""), names["init"] or "")
        alloc = (
            [port + 1 for port in init]
            if names["alloc"] is None
            else _ports(_required(get("alloc"), names["alloc"]), names["alloc"])
        )
        if len(init) != len(alloc):
            raise ConfigError(f"{names['init']} and {names['alloc']} name different rank counts")
        settings |= {
            "receiver_host": str(_required(host, names["host"] or "")),
            "init_port": init[0] if len(init) == 1 else init,
            "alloc_port": alloc[0] if len(alloc) == 1 else alloc,
            "landed_wait_s": LANDED_WAIT_S,
            "claim_timeout_s": CLAIM_TIMEOUT_S,
        }
    else:
        settings |= _sender_settings(get, names, generation)
    return load_config(None, environ={}, kv_role=kv_role, **settings)


def _sender_settings(
    get: Callable[[str], Any], names: Mapping[str, str | None], generation: str
) -> dict[str, Any]:
    """A sender's peer (pushed to unasked, connected ahead) and proxy (sent notices)."""
    settings: dict[str, Any] = {}
    host = get("host")
    if host is not None and get("init") is not None and (names["alloc"] is None or get("alloc")):
        init = _ports(get("init"), names["init"] or "")
        alloc = [p + 1 for p in init] if names["alloc"] is None else _ports(get("alloc"), "")
        ports = (init[0], alloc[0]) if len(init) == 1 else (init, alloc)
        peer = format_peer(str(host), *ports)
        settings |= {"warm_peers": [peer], "default_peer": peer}
    proxy_host = get("proxy")
    if proxy_host is not None:
        key = names["proxy_port"] or ""
        port = _ports(_required(get("proxy_port"), key), key)
        if len(port) != 1:
            raise ConfigError(f"{names['proxy_port']}: {get('proxy_port')!r} is not one port")
        settings |= {
            "lmcache_proxy_host": str(proxy_host),
            "lmcache_proxy_port": port[0],
            "lmcache_proxy_tag": PROXY_TAGS[generation],
        }
    elif get("proxy_port") is not None:
        raise ConfigError(f"{names['proxy_port']} without {names['proxy']}")
    return settings


def _raw(extra: Mapping[str, Any], environ: Mapping[str, str], warn: bool) -> dict[str, Any]:
    """The merged keys: file, then variables, then ``lmcache.`` extras."""
    raw: dict[str, Any] = {}
    path = environ.get(CONFIG_FILE_ENV)
    if path:
        try:
            loaded = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read {CONFIG_FILE_ENV} {path}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
        raw |= {str(k): v for k, v in loaded.items()}
    known = MAPPED | raw.keys()
    for key in sorted(known | _every_key()):
        value = environ.get(f"{ENV_PREFIX}{key.upper()}")
        if value is not None:
            raw[key] = yaml.safe_load(value) if value.strip() else None
    for key, value in extra.items():
        if key.startswith(EXTRA_PREFIX) and not key.startswith(f"{EXTRA_PREFIX}tag."):
            raw[key[len(EXTRA_PREFIX) :]] = value
    if warn:
        ignored = sorted(set(raw) - MAPPED)
        unprefixed = sorted(k for k in extra if not k.startswith(EXTRA_PREFIX))
        if ignored or unprefixed:
            logger.warning(
                "LMCache settings that mean nothing to lmcache-pd, ignored: %s",
                ", ".join(ignored + [f"kv_connector_extra_config.{k}" for k in unprefixed]),
            )
    return raw


def _every_key() -> set[str]:
    return {k for keys in _OWN_KEYS.values() for k in keys} | set(MAPPED)


def _generation(raw: Mapping[str, Any]) -> str:
    """The one generation ``raw``'s keys speak; ``ConfigError`` for two, or none."""
    found = {name: sorted(keys & raw.keys()) for name, keys in _OWN_KEYS.items()}
    speaking = [name for name, keys in found.items() if keys]
    if len(speaking) > 1:
        named = "; ".join(f"{', '.join(found[n])} ({n})" for n in speaking)
        raise ConfigError(f"LMCache configuration mixes generations of keys: {named}")
    if not speaking:
        raise ConfigError(
            "no LMCache PD configuration: set enable_pd, pd_role, pd_buffer_size and the "
            f"peer's pd_peer_* keys ({CONFIG_FILE_ENV}, LMCACHE_* variables or lmcache. extras)"
        )
    return speaking[0]


def _required(value: Any, key: str) -> Any:
    if value is None:
        raise ConfigError(f"the LMCache configuration lacks {key}")
    return value


def _flag(value: Any) -> bool:
    return value is True or str(value).lower() in ("true", "1", "yes")


def _int(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{value!r} is not a whole number") from exc


def _ports(value: Any, key: str) -> list[int]:
    """A port per rank: a list, one number, or "a,b" (all of which LMCache takes)."""
    items = value if isinstance(value, list) else str(value).split(",")
    try:
        ports = [int(str(item).strip()) for item in items]
    except ValueError as exc:
        raise ConfigError(f"{key}: {value!r} is not a port or a list of ports") from exc
    if not ports or not all(0 < port < 65536 for port in ports):
        raise ConfigError(f"{key}: {value!r} is not a port or a list of ports")
    return ports


def _strings(value: Any) -> list[str]:
    return value if isinstance(value, list) else [s.strip() for s in str(value).split(",")]
