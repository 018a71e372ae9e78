"""Config: YAML plus LMCACHE_PD_* overrides, and errors that name the key at fault."""

from pathlib import Path

import pytest
import vllm

from lmcache_pd.config import load_config
from lmcache_pd.connector.vllm_version import check_vllm_version
from lmcache_pd.errors import ConfigError

CONFIGS = Path(__file__).parent.parent / "configs"


@pytest.mark.parametrize("name", ["producer", "consumer"])
def test_shipped_example_configs_load(name: str) -> None:
    config = load_config(CONFIGS / f"{name}.yaml", environ={})
    assert config.kv_role == f"kv_{name}"
    assert config.chunk_size == 256
    assert config.nixl_backends == ["UCX"]


def test_defaults_need_only_the_role() -> None:
    config = load_config(None, environ={}, kv_role="kv_consumer")
    assert config.chunk_size == 256
    assert config.buffer_device == "cpu"
    assert config.num_pages == config.buffer_size_bytes // config.page_bytes


def test_environment_overrides_file_with_typed_values() -> None:
    environ = {"LMCACHE_PD_ALLOC_PORT": "6001", "LMCACHE_PD_NIXL_BACKENDS": "[UCX, POSIX]"}
    config = load_config(CONFIGS / "consumer.yaml", environ=environ)
    assert config.alloc_port == 6001
    assert config.nixl_backends == ["UCX", "POSIX"]


def test_config_path_can_come_from_the_environment() -> None:
    config = load_config(environ={"LMCACHE_PD_CONFIG": str(CONFIGS / "producer.yaml")})
    assert config.kv_role == "kv_producer"


@pytest.mark.parametrize(
    ("overrides", "environ", "named"),
    [
        ({"bogus_key": 1}, {}, "bogus_key"),
        ({"chunk_size": "big"}, {}, "chunk_size"),
        ({"init_port": 70000}, {}, "init_port"),
        ({"alloc_port": 0}, {}, "alloc_port"),
        ({"kv_role": "kv_both"}, {}, "kv_role"),
        ({}, {"LMCACHE_PD_INIT_PORT": "eighty"}, "init_port"),
        ({}, {"LMCACHE_PD_NO_SUCH_SETTING": "1"}, "LMCACHE_PD_NO_SUCH_SETTING"),
        ({"claim_timeout_s": 60.0, "hold_timeout_s": 30.0}, {}, "claim_timeout_s"),
        ({"receiver_host": "tcp://decode:5555"}, {}, "receiver_host"),
        ({"buffer_size_bytes": 10, "page_bytes": 100}, {}, "buffer_size_bytes"),
    ],
)
def test_invalid_settings_are_refused_naming_the_key(
    overrides: dict, environ: dict, named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        load_config(CONFIGS / "consumer.yaml", environ=environ, **overrides)


def test_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        load_config(tmp_path / "missing.yaml", environ={})
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml", environ={})


def test_the_connector_refuses_an_untested_vllm_naming_the_tested_one() -> None:
    for tested in ("0.32.0", "0.32.3+cpu", vllm.__version__):
        check_vllm_version(tested)
    with pytest.raises(ConfigError, match=r"vLLM 0\.33\.0 is untested .* \(tested: 0\.32\.x\)"):
        check_vllm_version("0.33.0")
    allowed = load_config(
        None, environ={"LMCACHE_PD_ALLOW_UNTESTED_VLLM": "true"}, kv_role="kv_consumer"
    )
    check_vllm_version("0.33.0", allowed.allow_untested_vllm)  # the operator's own risk
