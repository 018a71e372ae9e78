"""The pool launcher: its config is checked before anything starts, and an instance that cannot
start fails the launch with its name and its log, leaving no process behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lmcache_pd.auth import DeploymentKeys, Role, generate_secret, load_keys
from lmcache_pd.deploy.instance import transfer_settings
from lmcache_pd.deploy.launcher import KEY_ROLE, LaunchError, PoolLauncher, write_shares
from lmcache_pd.deploy.pools import load_pools
from lmcache_pd.errors import ConfigError

CONFIGS = Path(__file__).parent.parent / "configs"


def write(tmp_path: Path, pools: dict) -> Path:
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump(pools))
    return path


def test_each_role_s_share_of_the_secret_is_a_file_of_its_own(tmp_path: Path) -> None:
    """``serve`` keeps the secret out of every file: each role's share in ``kv.ROLE.key``
    (0600), which only that role's configs name (``PoolLauncher``, ``proxy_config_for``)."""
    secret = generate_secret()
    files = write_shares(tmp_path, secret)
    assert set(files) == set(Role)
    for role, path in files.items():
        assert path == tmp_path / f"kv.{role.value}.key"
        assert path.stat().st_mode & 0o777 == 0o600
        assert secret not in path.read_text()
        assert load_keys(str(path), role, environ={}) == DeploymentKeys.from_secret(secret, role)
    assert KEY_ROLE == {"kv_producer": Role.PRODUCER, "kv_consumer": Role.CONSUMER}
    with pytest.raises(ConfigError, match="fewer than 32"):
        write_shares(tmp_path, "short")


@pytest.mark.parametrize(
    "name", ["pools.yaml", "pools-2p1d.yaml", "pools-tp2.yaml", "pools-ray.yaml"]
)
def test_shipped_pools_configs_are_valid(name: str) -> None:
    pools = load_pools(CONFIGS / name)
    assert pools.proxy.port == 8000 and pools.prefill and pools.decode


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"colour": "blue"}, "colour"),
        ({"prefill": []}, "prefill"),
        ({"decode": [{"cpus": "1"}]}, "config"),
        ({"proxy": {"port": "eighty"}}, "port"),
    ],
)
def test_bad_pools_config_is_refused_naming_the_key(
    tmp_path: Path, change: dict, says: str
) -> None:
    pools = yaml.safe_load((CONFIGS / "pools.yaml").read_text()) | change
    with pytest.raises(ConfigError, match=says):
        load_pools(write(tmp_path, pools))


def test_the_pools_chunk_size_is_every_instances(tmp_path: Path) -> None:
    pools = yaml.safe_load((CONFIGS / "pools-1p2d.yaml").read_text())
    unset = load_pools(write(tmp_path, pools))
    assert (
        transfer_settings(unset, "decode-0", unset.decode[0], "kv_consumer", {})["chunk_size"]
        == yaml.safe_load((CONFIGS / "consumer.yaml").read_text())["chunk_size"]
    )
    chunked = load_pools(write(tmp_path, pools | {"chunk_size": 128}))
    for role, spec in [
        ("kv_producer", chunked.prefill[0]),
        *(("kv_consumer", decode) for decode in chunked.decode),
    ]:
        assert transfer_settings(chunked, "x", spec, role, {})["chunk_size"] == 128
    with pytest.raises(ConfigError, match="chunk_size"):
        load_pools(write(tmp_path, pools | {"chunk_size": 0}))


def test_a_port_named_twice_is_refused_before_anything_starts(tmp_path: Path) -> None:
    pools = yaml.safe_load((CONFIGS / "pools.yaml").read_text())
    pools["prefill"][0]["port"] = pools["decode"][0]["port"] = 8100
    launcher = PoolLauncher(load_pools(write(tmp_path, pools)), tmp_path / "run")
    with pytest.raises(ConfigError, match="8100"):
        launcher.start()
    assert launcher.servers == {}


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_an_instance_that_cannot_start_fails_the_launch_with_its_name_and_log(
    tmp_path: Path,
) -> None:
    pools = yaml.safe_load((CONFIGS / "pools.yaml").read_text())
    pools["model"] = str(tmp_path / "no-such-model")
    launcher = PoolLauncher(load_pools(write(tmp_path, pools)), tmp_path / "run")
    with pytest.raises(LaunchError, match=r"prefill-0 did not start: vLLM exited") as failure:
        launcher.start()
    assert "no-such-model" in str(failure.value)  # the end of its log says why
    assert not any(server.running for server in launcher.servers.values())
