"""An LMCache PD deployment's configuration, as its users wrote it, read onto ours: every
generation's keys, LMCache's order of sources, and what is refused with the key named."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmcache_pd.config import load_config
from lmcache_pd.errors import ConfigError
from lmcache_pd.lmcache_config import (
    CLAIM_TIMEOUT_S,
    CONFIG_FILE_ENV,
    LANDED_WAIT_S,
    configured,
    load_lmcache_config,
)

# LMCache's disagg_prefill examples (xpyd, TP 2 decode), today's keys.
RECEIVER = {
    "local_cpu": False,
    "max_local_cpu_size": 0,
    "enable_pd": True,
    "pd_role": "receiver",
    "pd_buffer_size": 1073741824,
    "pd_buffer_device": "cpu",
    "pd_peer_host": "10.0.0.7",
    "pd_peer_init_port": [7300, 7301],
    "pd_peer_alloc_port": [7400, 7401],
    "transfer_channel": "nixl",
    "nixl_backends": ["UCX"],
    "chunk_size": 256,
}
SENDER = {
    "enable_pd": True,
    "pd_role": "sender",
    "pd_buffer_size": 268435456,
    "pd_buffer_device": "cpu",
    "pd_proxy_host": "127.0.0.1",
    "pd_proxy_port": 7500,
    "transfer_channel": "nixl",
}


def from_file(tmp_path: Path, keys: dict[str, Any], role: str, **environ: str) -> Any:
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(keys))
    return load_lmcache_config({}, role, {CONFIG_FILE_ENV: str(path), **environ})


def test_todays_receiver_maps_onto_our_consumer(tmp_path: Path) -> None:
    config = from_file(tmp_path, RECEIVER, "kv_consumer")
    assert (config.receiver_host, config.init_port, config.alloc_port) == (
        "10.0.0.7",
        [7300, 7301],
        [7400, 7401],
    )
    assert (config.buffer_size_bytes, config.buffer_device) == (1073741824, "cpu")
    assert (config.chunk_size, config.nixl_backends) == (256, ["UCX"])
    # LMCache names a GPU "cuda" or "cuda:N"; ours is "cuda" (refused here: no CUDA device).
    with pytest.raises(ConfigError, match="buffer_device is cuda"):
        from_file(tmp_path, RECEIVER | {"pd_buffer_device": "cuda:1"}, "kv_consumer")


def test_a_sender_maps_onto_our_producer_and_warms_its_configured_peer(tmp_path: Path) -> None:
    config = from_file(tmp_path, SENDER, "kv_producer")
    assert (config.kv_role, config.buffer_size_bytes, config.buffer_device) == (
        "kv_producer",
        268435456,
        "cpu",
    )
    peered = SENDER | {"pd_peer_host": "h", "pd_peer_init_port": 1, "pd_peer_alloc_port": 2}
    assert from_file(tmp_path, peered, "kv_producer").warm_peers == ["h:1:2"]


def test_a_senders_proxy_is_sent_notices_tagged_for_its_generation(tmp_path: Path) -> None:
    """Today's ``pd_proxy_*`` and the xpyd era's ``nixl_proxy_*``, each proxy decoding its own
    generation's message; a sender without a proxy sends none."""
    config = from_file(tmp_path, SENDER, "kv_producer")
    assert (config.lmcache_proxy_host, config.lmcache_proxy_port) == ("127.0.0.1", 7500)
    assert config.lmcache_proxy_tag == "ProxyNotif"
    xpyd = {
        "enable_nixl": True,  # the xpyd era's files set both flags
        "enable_xpyd": True,
        "nixl_role": "sender",
        "nixl_proxy_host": "localhost",
        "nixl_proxy_port": 7500,
        "nixl_buffer_size": 1073741824,
        "nixl_buffer_device": "cpu",
    }
    config = from_file(tmp_path, xpyd, "kv_producer")
    assert (config.lmcache_proxy_host, config.lmcache_proxy_port) == ("localhost", 7500)
    assert config.lmcache_proxy_tag == "NixlProxyNotif"
    quiet = {k: v for k, v in SENDER.items() if not k.startswith("pd_proxy")}
    assert from_file(tmp_path, quiet, "kv_producer").lmcache_proxy_host is None


def test_a_sender_with_a_peer_pushes_there_requests_that_name_no_consumer(
    tmp_path: Path,
) -> None:
    """The 1p1d shape: the configured peer is connected ahead and is where a request without a
    ``disagg_spec`` goes; without a peer, such a request goes nowhere."""
    peered = SENDER | {
        "pd_peer_host": "10.0.0.7",
        "pd_peer_init_port": [7300, 7301],
        "pd_peer_alloc_port": "7400,7401",
    }
    config = from_file(tmp_path, peered, "kv_producer")
    assert config.default_peer == "10.0.0.7:7300,7301:7400,7401" == config.warm_peers[0]
    assert from_file(tmp_path, SENDER, "kv_producer").default_peer is None


def test_a_receiver_waits_for_chunks_of_requests_with_no_transfer_parameters(
    tmp_path: Path,
) -> None:
    """Their proxy sends decode the prompt and first token bare, once prefill said the KV
    landed: a request waits briefly for its chunks to show, and unclaimed pushes are the rule
    (held a short while). Our own configuration waits for nothing (the control)."""
    config = from_file(tmp_path, RECEIVER, "kv_consumer")
    assert (config.landed_wait_s, config.claim_timeout_s) == (LANDED_WAIT_S, CLAIM_TIMEOUT_S)
    assert load_config(None, environ={}, kv_role="kv_consumer").landed_wait_s == 0


@pytest.mark.parametrize(
    "keys",
    [
        {  # the xpyd era's
            "enable_xpyd": True,
            "nixl_role": "receiver",
            "nixl_buffer_size": 1073741824,
            "nixl_buffer_device": "cpu",
            "nixl_peer_host": "10.0.0.7",
            "nixl_peer_init_port": "7300,7301",
            "nixl_peer_alloc_port": "7400,7401",
        },
        {  # the oldest examples': one port, ours are it and the next
            "enable_nixl": True,
            "nixl_role": "receiver",
            "nixl_buffer_size": 1073741824,
            "nixl_buffer_device": "cpu",
            "nixl_receiver_host": "10.0.0.7",
            "nixl_receiver_port": 7300,
        },
    ],
    ids=["xpyd", "nixl"],
)
def test_each_older_generation_maps_alike(tmp_path: Path, keys: dict[str, Any]) -> None:
    config = from_file(tmp_path, keys, "kv_consumer")
    assert config.receiver_host == "10.0.0.7" and config.buffer_size_bytes == 1073741824
    if "enable_nixl" in keys:
        assert (config.init_port, config.alloc_port) == (7300, 7301)
    else:
        assert (config.init_port, config.alloc_port) == ([7300, 7301], [7400, 7401])


def test_variables_override_the_file_and_prefixed_extras_override_both(tmp_path: Path) -> None:
    """As LMCache's code applies them; ``LMCACHE_PD_*`` here are LMCache's ``pd_*`` keys, never
    our own overrides."""
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(RECEIVER))
    environ = {CONFIG_FILE_ENV: str(path), "LMCACHE_CHUNK_SIZE": "128", "LMCACHE_PD_PEER_HOST": "v"}
    by_variable = load_lmcache_config({}, "kv_consumer", environ)
    assert (by_variable.chunk_size, by_variable.receiver_host) == (128, "v")
    extras = {"lmcache.chunk_size": 64, "lmcache.pd_peer_host": "x"}
    by_extra = load_lmcache_config(extras, "kv_consumer", environ)
    assert (by_extra.chunk_size, by_extra.receiver_host) == (64, "x")
    only_variables = {f"LMCACHE_{k.upper()}": str(v) for k, v in SENDER.items()}
    assert load_lmcache_config({}, "kv_producer", only_variables).buffer_size_bytes == 268435456
    assert configured({}, only_variables) and not configured({}, {})


def test_keys_that_mean_nothing_here_are_named_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_pd.lmcache_config"):
        path = tmp_path / "lmcache.yaml"
        path.write_text(yaml.safe_dump(RECEIVER))
        extras = {"discard_partial_chunks": False, "lmcache_rpc_port": "consumer1"}
        load_lmcache_config(extras, "kv_consumer", {CONFIG_FILE_ENV: str(path)})
    [warning] = [r.getMessage() for r in caplog.records]
    for key in ("local_cpu", "max_local_cpu_size", "kv_connector_extra_config.lmcache_rpc_port"):
        assert key in warning
    assert "pd_peer_host" not in warning


def test_priority_limit_maps_and_save_decode_cache_true_is_named_unsupported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``priority_limit`` is ours too (requests above it keep nothing in decode's cache of
    landed chunks); ``save_decode_cache: true`` gets a warning of its own, ``false`` (LMCache's
    default, and what decode does) none."""
    with caplog.at_level(logging.WARNING, logger="lmcache_pd.lmcache_config"):
        config = from_file(tmp_path, RECEIVER | {"priority_limit": 3}, "kv_consumer")
        assert config.priority_limit == 3
        assert from_file(tmp_path, RECEIVER, "kv_consumer").priority_limit is None
        quiet = {k: v for k, v in RECEIVER.items() if k not in ("local_cpu", "max_local_cpu_size")}
        caplog.clear()
        from_file(tmp_path, quiet | {"save_decode_cache": False}, "kv_consumer")
        assert not caplog.records
        from_file(tmp_path, quiet | {"save_decode_cache": True}, "kv_consumer")
    [warning] = [r.getMessage() for r in caplog.records]
    assert "save_decode_cache: true is not supported" in warning
    with pytest.raises(ConfigError, match="priority_limit"):
        from_file(tmp_path, RECEIVER | {"priority_limit": "high"}, "kv_consumer")


@pytest.mark.parametrize(
    ("change", "role", "names"),
    [
        ({"nixl_peer_host": "y"}, "kv_consumer", "nixl_peer_host"),  # two generations
        ({"pd_role": "sender"}, "kv_consumer", "pd_role"),  # contradicts vLLM's kv_role
        ({"pd_role": "decoder"}, "kv_consumer", "pd_role"),
        ({"pd_buffer_size": None}, "kv_consumer", "pd_buffer_size"),
        ({"pd_peer_alloc_port": None}, "kv_consumer", "pd_peer_alloc_port"),
        ({"pd_peer_alloc_port": [7400]}, "kv_consumer", "pd_peer_alloc_port"),
        ({"pd_peer_init_port": "7300,x"}, "kv_consumer", "pd_peer_init_port"),
        ({"enable_pd": False}, "kv_consumer", "enable_pd"),
        ({"transfer_channel": "mooncake"}, "kv_consumer", "transfer_channel"),
        ({"pd_role": "sender", "pd_proxy_host": "p"}, "kv_producer", "pd_proxy_port"),
        ({"pd_role": "sender", "pd_proxy_port": 7500}, "kv_producer", "pd_proxy_host"),
        (
            {"pd_role": "sender", "pd_proxy_host": "p", "pd_proxy_port": "1,2"},
            "kv_producer",
            "pd_proxy_port",
        ),
    ],
)
def test_a_mixed_conflicting_or_incomplete_configuration_fails_naming_the_key(
    tmp_path: Path, change: dict[str, Any], role: str, names: str
) -> None:
    keys = {k: v for k, v in (RECEIVER | change).items() if v is not None}
    with pytest.raises(ConfigError, match=names):
        from_file(tmp_path, keys, role)


@pytest.mark.processes  # importing vLLM starts a process
def test_the_name_lmcache_users_give_vllm_is_our_connector_reading_their_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their command line changes in one place (``kv_connector_module_path``): the class named
    ``LMCacheConnectorV1`` is ours, and under that name it reads their configuration; under
    ours, our YAML (the control)."""
    from types import SimpleNamespace

    import lmcache_pd.connector as connector
    from lmcache_pd.connector.facade import LMCachePDConnector, connector_config

    assert connector.LMCacheConnectorV1 is LMCachePDConnector
    path = tmp_path / "lmcache.yaml"
    path.write_text(yaml.safe_dump(RECEIVER))
    monkeypatch.setenv(CONFIG_FILE_ENV, str(path))

    def vllm_config(name: str) -> SimpleNamespace:
        transfer = SimpleNamespace(
            kv_connector=name,
            kv_role="kv_consumer",
            kv_connector_extra_config={},
            kv_load_failure_policy="fail",  # vLLM's default, which their launchers leave
            get_from_extra_config=lambda key, default: default,
        )
        return SimpleNamespace(kv_transfer_config=transfer)

    theirs, ours = vllm_config("LMCacheConnectorV1"), vllm_config("LMCachePDConnector")
    assert connector_config(theirs).init_port == [7300, 7301]
    assert connector_config(ours).init_port == 55555
    # Under their name decode computes what it cannot load, as LMCache's connector does (and
    # loads landed chunks, which it does only under that policy); under ours, vLLM's is kept.
    assert theirs.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert ours.kv_transfer_config.kv_load_failure_policy == "fail"
