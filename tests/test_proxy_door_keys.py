"""The instances' own key, as each engine hands it out (checked without starting vLLM; the real
instances refusing a call without it are in ``test_proxy_vllm.py``): the launcher's key file and
proxy config, the vLLM environment and command line, the guard that extends vLLM's own check to
every path, and the Kubernetes Secret that the vLLM pods and the proxy read it from."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from lmcache_pd.config import PROXY_ENV_PREFIX, load_config
from lmcache_pd.deploy.instance_guard import GUARD_IMPORT_PATH, KEY_ENV, InstanceKeyGuard
from lmcache_pd.deploy.k8s import manifests
from lmcache_pd.deploy.launcher import (
    INSTANCE_KEY_FILE,
    new_instance_key,
    proxy_config_for,
)
from lmcache_pd.deploy.pools import load_pools
from lmcache_pd.deploy.vllm_server import inherited_env, server_env, vllm_command
from lmcache_pd.errors import ConfigError
from lmcache_pd.proxy import config as proxy_settings
from lmcache_pd.proxy.config import (
    API_KEY_ENV,
    INSTANCE_API_KEY_ENV,
    DecodeInstance,
    PrefillInstance,
    load_proxy_config,
    proxy_config,
)
from lmcache_pd.request_body import MAX_BODY_BYTES
from tests.test_k8s import KUBERNETES_VERSION, container_of, mounted_file, one, pod_env

CONFIGS = Path(__file__).parent.parent / "configs"
KEY = "k" * 43


def test_the_proxys_variables_are_no_transfer_settings() -> None:
    """A vLLM started from a shell that sets the proxy's key is not refused for it; a name that
    is no setting still is (the control)."""
    assert proxy_settings.PROXY_ENV_PREFIX == PROXY_ENV_PREFIX
    environ = {API_KEY_ENV: "x", INSTANCE_API_KEY_ENV: "y", "LMCACHE_PD_KV_ROLE": "kv_producer"}
    assert load_config(None, environ=environ).kv_role == "kv_producer"
    with pytest.raises(ConfigError, match="LMCACHE_PD_PROXYAPI_KEY"):
        load_config(None, environ=environ | {"LMCACHE_PD_PROXYAPI_KEY": "x"})


def test_an_instance_gets_its_key_in_its_environment_not_on_its_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(API_KEY_ENV, "the clients' key")
    assert server_env(cpu=None, api_key=KEY)[KEY_ENV] == KEY
    assert KEY_ENV not in server_env(cpu=None)  # control: no key, none set
    assert API_KEY_ENV not in inherited_env()  # the clients' key is no instance's business
    assert "PATH" in inherited_env()
    command = vllm_command("/m", 8000, key_guard=True)
    assert command[command.index("--middleware") + 1] == GUARD_IMPORT_PATH
    assert KEY not in " ".join(command)
    assert "--middleware" not in vllm_command("/m", 8000)


def test_the_launcher_writes_the_key_where_only_its_user_reads_it(tmp_path: Path) -> None:
    pools = load_pools(CONFIGS / "pools.yaml")
    prefill = [PrefillInstance("http://127.0.0.1:9001")]
    decode = [DecodeInstance("http://127.0.0.1:9002", "127.0.0.1", 9003, 9004)]
    key = new_instance_key(environ={})
    assert len(key) == 43 and key != new_instance_key(environ={})
    assert new_instance_key(environ={INSTANCE_API_KEY_ENV: KEY}) == KEY
    served = proxy_config_for(pools, prefill, decode, tmp_path, key)
    assert served.instance_headers() == {"Authorization": f"Bearer {key}"}
    key_file = tmp_path / INSTANCE_KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    written = (tmp_path / "proxy.yaml").read_text()
    assert key not in written
    assert load_proxy_config(tmp_path / "proxy.yaml", environ={}).instance_key() == key
    # A second launch in the same folder writes its own key over the first's.
    proxy_config_for(pools, prefill, decode, tmp_path, KEY)
    assert key_file.read_text().strip() == KEY


def asgi_call(
    guard: InstanceKeyGuard, path: str, authorization: str | None = None, method: str = "POST"
) -> int:
    """The status ``guard`` answers a request with (200: it let the request through)."""
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    guard.app = app
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"]


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/invocations", "/tokenize", "/v2/x", "/anything"]
)
def test_the_guard_asks_for_the_key_on_every_path_but_health_and_metrics(
    monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """vLLM's own check covers /v1, /v2, /inference and /cohere only: /invocations runs a
    completion with whatever kv_transfer_params it is given, without the key."""
    monkeypatch.setenv(KEY_ENV, KEY)
    guard = InstanceKeyGuard(None)  # type: ignore[arg-type]
    assert asgi_call(guard, path) == 401
    assert asgi_call(guard, path, f"Bearer {KEY}x") == 401
    assert asgi_call(guard, path, KEY) == 401
    assert asgi_call(guard, path, f"Bearer {KEY}") == 200
    assert asgi_call(guard, path, f"bearer {KEY}") == 200
    for open_path in ("/health", "/metrics"):
        assert asgi_call(guard, open_path) == 200
    assert asgi_call(guard, path, method="OPTIONS") == 200  # a CORS preflight runs no handler
    monkeypatch.delenv(KEY_ENV)
    assert asgi_call(InstanceKeyGuard(None), path) == 200  # type: ignore[arg-type]  # control


def guard_passes(parts: list[bytes]) -> tuple[int, bytes]:
    """The status the guard (no key set) answers a POST whose body arrives in ``parts``, and
    the body vLLM's app then read."""
    sent: list[dict[str, Any]] = []
    seen = bytearray()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            seen.extend(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    messages = [
        {"type": "http.request", "body": part, "more_body": index < len(parts) - 1}
        for index, part in enumerate(parts)
    ]

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    guard = InstanceKeyGuard(app)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(guard(scope, receive, send))
    return sent[0]["status"], bytes(seen)


def test_the_guard_refuses_bodies_that_would_end_vllms_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kv_transfer_params nested 600 deep, sent with the key, ended prefill's and decode's
    engines (benchmarks/abuse, ``deep_params``); vllm_xargs carrying kv_transfer_params got a
    500 from vLLM's API server. Both are refused with 400; everything else reaches vLLM whole,
    however it was split."""
    monkeypatch.delenv(KEY_ENV, raising=False)
    deep = b'{"prompt": [1], "kv_transfer_params": {"x": ' + b"[" * 600 + b"]" * 600 + b"}}"
    assert guard_passes([deep])[0] == 400
    assert guard_passes([deep[:7], deep[7:]])[0] == 400
    way_deeper = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert guard_passes([way_deeper])[0] == 400
    smuggled = b'{"prompt": [1], "vllm_xargs": {"kv_transfer_params": "x"}}'
    assert guard_passes([smuggled])[0] == 400
    fine = b'{"prompt": [1, 2], "vllm_xargs": {"other": 1}, "kv_transfer_params": {"a": [[1]]}}'
    assert guard_passes([fine[:10], fine[10:20], fine[20:]]) == (200, fine)
    assert guard_passes([b"not json"]) == (200, b"not json")  # vLLM's own 400


MIB = 1 << 20
ENDLESS_PARTS = 4000


def endless_post(path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, int]:
    """The status the guard answers a POST whose chunked body is 4,000 parts of 1 MiB, and how
    many parts it read. A guard that reads on past the limit fails here at once (it would hold
    the whole body: 4 GiB)."""
    sent: list[dict[str, Any]] = []
    part = b"x" * MIB
    read = 0
    budget = MAX_BODY_BYTES // MIB + 2

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        nonlocal read
        read += 1
        assert read <= budget, f"the guard read {read} MiB of a body on {path}"
        return {"type": "http.request", "body": part, "more_body": read < ENDLESS_PARTS}

    scope = {"type": "http", "method": "POST", "path": path, "headers": headers}
    asyncio.run(InstanceKeyGuard(app)(scope, receive, send))
    return sent[0]["status"], read


def test_no_caller_makes_an_instance_buffer_an_endless_body(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Open paths take no body: a chunked POST /health is refused unread (it was read whole,
    growing vLLM's API server until it was killed); a caller with the key is read up to
    MAX_BODY_BYTES, then refused with 413; so is one that declares more. Without the key,
    nothing is read."""
    monkeypatch.setenv(KEY_ENV, KEY)
    chunked = [(b"transfer-encoding", b"chunked")]
    keyed = [*chunked, (b"authorization", f"Bearer {KEY}".encode())]
    past_limit = MAX_BODY_BYTES // MIB + 1
    for path in ("/health", "/metrics"):
        assert endless_post(path, chunked) == (413, 0)
    assert endless_post("/v1/completions", chunked) == (401, 0)
    assert endless_post("/v1/completions", keyed) == (413, past_limit)
    declared = [(b"content-length", str(MAX_BODY_BYTES + 1).encode()), keyed[1]]
    assert endless_post("/v1/completions", declared) == (413, 0)
    # The controls: an open path without a body passes; a body within the limit reaches vLLM
    # whole.
    assert asgi_call(InstanceKeyGuard(None), "/health", method="GET") == 200  # type: ignore[arg-type]
    monkeypatch.delenv(KEY_ENV)
    assert guard_passes([b'{"prompt": [1]}', b" " * MIB]) == (200, b'{"prompt": [1]}' + b" " * MIB)
    assert endless_post("/v1/completions", chunked) == (413, past_limit)
    assert endless_post("/health", chunked) == (413, 0)


def test_kubernetes_pods_and_the_proxy_read_one_key_from_the_secret(tmp_path: Path) -> None:
    """The Secret holds the key; each vLLM container gets it as VLLM_API_KEY with the guard on
    its command line, the proxy as its instance key; no ConfigMap holds it, and each writing
    makes a fresh one."""
    objects = manifests(load_pools(CONFIGS / "pools-2p1d.yaml"))
    secret = one(objects, "Secret", "secrets")
    kubernetes_validate.validate(secret, KUBERNETES_VERSION, strict=True)
    key = secret["stringData"]["instance-api-key"]
    assert len(key) >= 43
    for component in ("prefill", "decode"):
        workload = one(objects, "StatefulSet", component)
        container = container_of(workload)
        assert pod_env(container, f"pod-{component}", objects)[KEY_ENV] == key
        assert container["command"][container["command"].index("--middleware") + 1] == (
            GUARD_IMPORT_PATH
        )
    proxy = one(objects, "Deployment", "proxy")
    assert pod_env(container_of(proxy), "proxy", objects)[INSTANCE_API_KEY_ENV] == key
    text = mounted_file(proxy, objects, "/etc/lmcache-pd/proxy.yaml")
    assert text is not None
    as_the_pod_loads_it = tmp_path / "proxy.yaml"
    as_the_pod_loads_it.write_text(text)
    loaded = load_proxy_config(as_the_pod_loads_it, environ={INSTANCE_API_KEY_ENV: key})
    assert loaded.instance_key() == key
    assert proxy_config(yaml.safe_load(text)).instance_key() is None  # only the Secret has it
    assert not any(key in str(o) for o in objects if o["kind"] != "Secret")
    again = one(manifests(load_pools(CONFIGS / "pools-2p1d.yaml")), "Secret", "secrets")
    assert again["stringData"]["instance-api-key"] != key


def test_a_pools_files_client_key_file_reaches_the_proxy(tmp_path: Path) -> None:
    key_file = tmp_path / "clients.key"
    key_file.write_text("clients-key\n")
    raw = yaml.safe_load((CONFIGS / "pools.yaml").read_text())
    raw["proxy"] |= {"api_key_file": os.path.relpath(key_file), "max_in_flight": 7}
    path = tmp_path / "pools.yaml"
    path.write_text(yaml.safe_dump(raw))
    prefill = [PrefillInstance("http://127.0.0.1:9001")]
    decode = [DecodeInstance("http://127.0.0.1:9002", "127.0.0.1", 9003, 9004)]
    (tmp_path / "run").mkdir()
    served = proxy_config_for(load_pools(path), prefill, decode, tmp_path / "run", KEY)
    assert (served.client_key(), served.max_in_flight) == ("clients-key", 7)
