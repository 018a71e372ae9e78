"""The pools under attack: 1 prefill and 1 decode vLLM started by the launcher (which gives them
the deployment secret and their instance key), and the proxy as a process of its own with a
client key; and what the suite reads of each (alive, healthy, memory, counters, listening ports)."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgspec
import psutil
from rich.console import Console

from benchmarks.chaos.pools import pools_file, wait_until_proxy_sees_all
from lmcache_pd.auth import DeploymentKeys, Role, load_keys
from lmcache_pd.deploy.launcher import PoolLauncher, write_key
from lmcache_pd.deploy.pools import PoolsConfig
from lmcache_pd.metrics_scrape import scrape
from lmcache_pd.proxy.config import PROXY_ENV_PREFIX, ProxyConfig

POOLS = "configs/pools.yaml"
CLIENT_KEY_FILE = "client.key"
# The proxy's admission limit in these pools: small, so that a burst of a few requests passes it.
ADMISSION_LIMIT = 4
PROXY_START_TIMEOUT_S = 60.0
PROXY_STOP_TIMEOUT_S = 10.0
HEALTH_TIMEOUT_S = 10.0
# A process that stops answering /health is asked again this many times, a second apart, before
# it counts as dead (a 2-core machine under attack answers slowly, not never).
HEALTH_TRIES = 3
PROXY = "proxy"


@dataclass(frozen=True, slots=True, order=True)
class Listener:
    """A listening TCP port and the process that holds it."""

    host: str
    port: int
    pid: int
    process: str


@dataclass(frozen=True, slots=True)
class Condition:
    """One process group as the suite sees it after a door."""

    alive: bool  # its first process runs (not a zombie)
    healthy: bool  # /health answered 200 (the proxy: answered at all)
    rss_bytes: int  # resident memory of every process of its group

    @property
    def up(self) -> bool:
        return self.alive and self.healthy


@dataclass
class Deployment:
    """Running pools and their proxy; a context manager that stops them all."""

    workdir: Path
    console: Console
    client_key: str = field(default_factory=lambda: secrets.token_urlsafe(32), repr=False)
    launcher: PoolLauncher | None = None
    proxy: ProxyConfig | None = None
    proxy_process: subprocess.Popen | None = None
    groups: list[int] = field(default_factory=list)  # every process group started
    restarts: dict[str, int] = field(default_factory=dict)

    @property
    def keys(self) -> DeploymentKeys:
        """A producer's keys (they open every door an intruder knocks on), from the file the
        launcher wrote for its prefill instances."""
        assert self.launcher is not None and self.launcher.key_files is not None
        keys = load_keys(str(self.launcher.key_files[Role.PRODUCER]), Role.PRODUCER)
        assert keys is not None
        return keys

    @property
    def proxy_url(self) -> str:
        assert self.proxy is not None
        return f"http://{self.proxy.host}:{self.proxy.port}"

    @property
    def instance_key(self) -> str:
        assert self.launcher is not None
        return self.launcher.instance_key

    def urls(self) -> dict[str, str]:
        """Every process's base URL by name (instances, then the proxy)."""
        assert self.launcher is not None
        found = {name: server.url for name, server in self.launcher.servers.items()}
        return found | {PROXY: self.proxy_url}

    def pools(self) -> PoolsConfig:
        """The shipped 1P1D pools with a client key and a small admission limit."""
        pools = pools_file(POOLS)
        key_file = self.workdir / CLIENT_KEY_FILE
        write_key(key_file, self.client_key)
        proxy = msgspec.structs.replace(
            pools.proxy, max_in_flight=ADMISSION_LIMIT, api_key_file=str(key_file)
        )
        return msgspec.structs.replace(pools, proxy=proxy)

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.launcher = PoolLauncher(self.pools(), self.workdir, self.console)
        self.proxy = self.launcher.start()
        self.groups += [server.pid for server in self.launcher.servers.values()]
        self.start_proxy()

    def start_proxy(self) -> None:
        """``lmcache-pd proxy`` on the launcher's proxy.yaml (which names the secret's, the
        client key's and the instance key's files); waits until it sees every instance up."""
        assert self.proxy is not None
        # Keys come from its config's files alone, not from variables this process may have.
        env = {k: v for k, v in os.environ.items() if not k.startswith(PROXY_ENV_PREFIX)}
        log = (self.workdir / "proxy.log").open("a")
        command = [
            sys.executable,
            "-m",
            "lmcache_pd.cli",
            "proxy",
            str(self.workdir / "proxy.yaml"),
        ]
        with log:
            self.proxy_process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, process_group=0
            )
        self.groups.append(self.proxy_process.pid)
        deadline = time.monotonic() + PROXY_START_TIMEOUT_S
        while time.monotonic() < deadline and self.proxy_process.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.proxy_url}/health", timeout=2).status_code == 200:
                    wait_until_proxy_sees_all(self.proxy)
                    return
            time.sleep(0.2)
        raise RuntimeError(f"the proxy did not start (log: {self.workdir / 'proxy.log'})")

    def stop_proxy(self) -> None:
        process = self.proxy_process
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, 15)
        try:
            process.wait(PROXY_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 9)
            process.wait(PROXY_STOP_TIMEOUT_S)
        self.proxy_process = None

    def group(self, name: str) -> int:
        """The process group of ``name`` (its first process's id)."""
        if name == PROXY:
            assert self.proxy_process is not None
            return self.proxy_process.pid
        assert self.launcher is not None
        return self.launcher.servers[name].pid

    def running(self, name: str) -> bool:
        if name == PROXY:
            return self.proxy_process is not None and self.proxy_process.poll() is None
        assert self.launcher is not None
        return self.launcher.servers[name].running

    def condition(self, name: str) -> Condition:
        url = self.urls()[name]
        healthy = False
        for attempt in range(HEALTH_TRIES):
            if attempt:
                time.sleep(1.0)
            with contextlib.suppress(httpx.HTTPError):
                status = httpx.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S).status_code
                healthy = status == 200 or name == PROXY
            if healthy or not self.running(name):
                break
        return Condition(self.running(name), healthy, group_rss(self.group(name)))

    def conditions(self) -> dict[str, Condition]:
        return {name: self.condition(name) for name in self.urls()}

    def counters(self) -> dict[str, dict[str, float]]:
        """Every process's ``lmcache_pd_*`` counters (empty for one that does not answer)."""
        found = {}
        for name, url in self.urls().items():
            try:
                found[name] = scrape(url)
            except httpx.HTTPError:
                found[name] = {}
        return found

    def heal(self, name: str) -> None:
        """Start ``name`` again after it died, so that the next door is measured on its own."""
        self.restarts[name] = self.restarts.get(name, 0) + 1
        if name == PROXY:
            self.stop_proxy()
            self.start_proxy()
            return
        assert self.launcher is not None and self.proxy is not None
        self.launcher.restart(name)
        self.groups.append(self.launcher.servers[name].pid)
        wait_until_proxy_sees_all(self.proxy)

    def listening(self, name: str) -> list[Listener]:
        """Every TCP port a process of ``name``'s group listens on."""
        found = set()
        for process in group_processes(self.group(name)):
            with contextlib.suppress(psutil.Error):
                for connection in process.net_connections(kind="tcp"):
                    if connection.status == psutil.CONN_LISTEN:
                        address = connection.laddr
                        found.add(Listener(address.ip, address.port, process.pid, process.name()))
        return sorted(found)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_proxy()
        if self.launcher is not None:
            self.launcher.stop()


def group_processes(group: int) -> list[psutil.Process]:
    """The live processes of process group ``group``."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getpgid(process.pid) == group and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
    return found


def group_rss(group: int) -> int:
    """Resident bytes of every process of ``group``."""
    total = 0
    for process in group_processes(group):
        with contextlib.suppress(psutil.Error):
            total += process.memory_info().rss
    return total
