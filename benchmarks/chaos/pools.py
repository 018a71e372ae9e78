"""Pools under test: a pools file read from anywhere, the proxy's URL and warm-up, restarts,
and the process groups left alive (shared by the chaos suite, ``selective`` and
``shared_prefix``)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai

from lmcache_pd.deploy.launcher import PoolLauncher, unused_port
from lmcache_pd.deploy.pools import PoolsConfig, load_pools
from lmcache_pd.proxy.config import ProxyConfig

ROOT = Path(__file__).resolve().parents[2]
# Beyond the proxy's own read deadlines (120 s): a request that hangs shows as a timeout.
CLIENT_TIMEOUT_S = 180.0
PROXY_UP_WAIT_S = 15.0


def proxy_url(proxy: ProxyConfig) -> str:
    """The proxy's base URL (no ``/v1``)."""
    return f"http://{proxy.host}:{proxy.port}"


def pools_file(path: str) -> PoolsConfig:
    """The pools file at ``path`` (else the repository's), its paths absolute and its proxy on an
    unused port."""
    return _absolute(load_pools(path if Path(path).exists() else ROOT / path))


def _absolute(pools: PoolsConfig) -> PoolsConfig:
    """Paths in a pools file are relative to the current folder, or else to the repository."""

    def resolve(path: str) -> str:
        here = Path(path)
        return str(here.resolve() if here.exists() or here.is_absolute() else ROOT / path)

    def instance(spec: Any) -> Any:
        return msgspec.structs.replace(spec, config=resolve(spec.config))

    return msgspec.structs.replace(
        pools,
        model=resolve(pools.model),
        prefill=[instance(s) for s in pools.prefill],
        decode=[instance(s) for s in pools.decode],
        proxy=msgspec.structs.replace(pools.proxy, port=unused_port(set())),
    )


def alive_groups(groups: list[int]) -> list[int]:
    """Process groups that still have a live (not zombie) member."""
    alive = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) in groups:
                alive.add(int(fields[2]))
    return sorted(alive)


def warm_up(proxy: ProxyConfig) -> None:
    """The first request through new pools pays one-off costs (handshake, kernels)."""
    with openai.OpenAI(base_url=f"{proxy_url(proxy)}/v1", api_key="none", max_retries=0) as client:
        for length in (31, 300, 1000, 3000):
            client.completions.create(
                model=proxy.model, prompt=list(range(10, 10 + length)), max_tokens=4
            )


def wait_until_proxy_sees_all(proxy: ProxyConfig) -> None:
    """Until the proxy's own health checks list every instance up (at most PROXY_UP_WAIT_S)."""
    urls = {instance.url for instance in (*proxy.prefill, *proxy.decode)}
    deadline = time.monotonic() + PROXY_UP_WAIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            up = httpx.get(f"{proxy_url(proxy)}/health", timeout=2.0).json()["up"]
            if urls <= {url for urls in up.values() for url in urls}:
                return
        time.sleep(0.1)


def restart(launcher: PoolLauncher, name: str, groups: list[int], spec: Any = None) -> float:
    """Restart ``name`` (see ``PoolLauncher.restart``), noting its new process group; returns
    the seconds until it was healthy."""
    seconds = launcher.restart(name, spec)
    groups.append(launcher.servers[name].pid)
    return round(seconds, 1)
