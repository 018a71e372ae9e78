"""A real ``lmcache-pd serve`` as a child process: started on a pools file, its instances found
by name, signalled as an operator or a crash would, rolled with ``lmcache-pd restart``, and
stopped.

The benchmark drives the deployment only from outside, as a user would: the supervisor that
restarts a dead instance and the control socket that rolls them run inside ``serve``, so that
they are what is measured. What it needs to know of the instances it reads from the work
folder ``serve`` writes (``proxy.yaml``: their URLs; ``instance.key``: the key their /v1 routes
want) and from /proc (an instance's process: the child of ``serve`` serving its port).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import yaml

from benchmarks.chaos.pools import pools_file, proxy_url
from lmcache_pd.deploy.pools import RaySpec
from lmcache_pd.proxy.config import ProxyConfig, load_proxy_config

logger = logging.getLogger(__name__)

LMCACHE_PD = Path(sys.executable).with_name("lmcache-pd")
# Every instance started, healthy and warmed up: ~1-2 min for four on two cores, more on a
# busy machine.
SERVE_UP_TIMEOUT_S = 900.0
SERVE_STOP_TIMEOUT_S = 120.0
HEALTH_TIMEOUT_S = 5.0
POLL_S = 0.1
# Rich wraps serve's log lines at the terminal's width; this keeps a request's line whole.
LOG_COLUMNS = "400"


@dataclass(frozen=True, slots=True)
class Member:
    """One instance as the chaos suite's counter readers see it (``CounterTrack``,
    ``refresh_gauges``): its URL and the headers its /v1 routes want."""

    url: str
    headers: dict[str, str]


class Serve:
    """``lmcache-pd serve`` on ``pools_path`` (paths made absolute, the proxy on a free port,
    ``drain_timeout_s`` as given), its output in ``workdir/serve.log``; a context manager that
    stops it, and every instance with it, on exit."""

    def __init__(
        self,
        pools_path: str,
        workdir: Path,
        drain_timeout_s: float,
        *,
        ray: RaySpec | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """``ray``: serve the pools as actors on that Ray cluster (``engine: ray``) rather than
        as serve's children; ``env``: more of serve's environment (Ray's token)."""
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        pools = msgspec.structs.replace(pools_file(pools_path), drain_timeout_s=drain_timeout_s)
        if ray is not None:
            pools = msgspec.structs.replace(pools, engine="ray", ray=ray)
        self.pools = pools
        self.pools_path = workdir / "fleet-pools.yaml"
        self.pools_path.write_text(yaml.safe_dump(msgspec.to_builtins(pools)))
        self.log_path = workdir / "serve.log"
        self.command = [str(LMCACHE_PD), "serve", str(self.pools_path), "--workdir", str(workdir)]
        self._log = self.log_path.open("w")
        self._process = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            # A group of its own (its instances make theirs), in this session: see VLLMServer.
            process_group=0,
            env=os.environ | dict(env or {}) | {"COLUMNS": LOG_COLUMNS},
        )
        self.proxy: ProxyConfig | None = None
        self.servers: dict[str, Member] = {}
        # Every instance process group seen (each restart makes a new one): none may outlive
        # serve.
        self.groups: set[int] = set()

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def url(self) -> str:
        assert self.proxy is not None, "wait_until_serving first"
        return proxy_url(self.proxy)

    def wait_until_serving(self, timeout_s: float = SERVE_UP_TIMEOUT_S) -> float:
        """Until the proxy lists every instance up; the seconds that took. ``RuntimeError``
        with the end of serve's log if it exits or ``timeout_s`` passes first."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self._process.poll() is not None:
                raise RuntimeError(f"serve exited ({self._process.returncode}):\n{self.tail()}")
            if self.proxy is None and (self.workdir / "proxy.yaml").exists():
                self._read_instances()
            if self.proxy is not None and self.all_up():
                for name in self.servers:
                    self.instance_pid(name)
                return time.monotonic() - started
            time.sleep(0.5)
        raise RuntimeError(f"serve not up within {timeout_s:.0f} s:\n{self.tail()}")

    def _read_instances(self) -> None:
        self.proxy = load_proxy_config(self.workdir / "proxy.yaml")
        headers = self.proxy.instance_headers()
        for role, members in (("prefill", self.proxy.prefill), ("decode", self.proxy.decode)):
            for index, member in enumerate(members):
                self.servers[f"{role}-{index}"] = Member(member.url, headers)

    def up(self) -> set[str]:
        """The instance URLs the proxy's health checks have up now (empty if it does not
        answer)."""
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            listed = httpx.get(f"{self.url}/health", timeout=HEALTH_TIMEOUT_S).json()["up"]
            return {url for urls in listed.values() for url in urls}
        return set()

    def all_up(self) -> bool:
        return {m.url for m in self.servers.values()} <= self.up()

    def healthy(self, name: str) -> bool:
        """Whether instance ``name`` answers its own /health with 200 (not draining)."""
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{self.servers[name].url}/health", timeout=HEALTH_TIMEOUT_S)
            return response.status_code == 200
        return False

    def running(self, name: str) -> int:
        """Requests instance ``name``'s engine runs now (vLLM's ``num_requests_running``
        gauge); 0 if it does not answer."""
        try:
            text = httpx.get(f"{self.servers[name].url}/metrics", timeout=HEALTH_TIMEOUT_S).text
        except httpx.HTTPError:
            return 0
        return sum(
            int(float(line.rsplit(" ", 1)[1]))
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )

    def instance_pid(self, name: str) -> int | None:
        """The API server of instance ``name`` now (it changes with each restart): the child of
        serve whose command line serves the instance's port; None while there is none."""
        port = self.servers[name].url.rsplit(":", 1)[1]
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if fields[0] == "Z" or int(fields[1]) != self.pid:
                    continue
                argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
                if b"--port" in argv and argv[argv.index(b"--port") + 1].decode() == port:
                    self.groups.add(int(stat.parent.name))
                    return int(stat.parent.name)
        return None

    def signal(self, name: str, signum: int, *, group: bool) -> int:
        """Send ``signum`` to instance ``name``: its whole process group (a crash takes the
        engine processes too) or its API server alone (what an operator's ``kill`` or a pod's
        termination sends, and what drains). Returns the pid signalled; ``RuntimeError`` if the
        instance has no process now."""
        pid = self.instance_pid(name)
        if pid is None:
            raise RuntimeError(f"{name} has no process now")
        logger.info("%s (pid %d): %s to its %s", name, pid, signum, "group" if group else "pid")
        # Its API server leads its group (VLLMServer starts it with process_group=0).
        if group:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
        return pid

    def restart_all(self, timeout_s: float) -> list[tuple[float, str]]:
        """``lmcache-pd restart --workdir W``: every instance rolled, one at a time; its output
        lines with the seconds (monotonic) each came. ``RuntimeError`` if it fails."""
        command = [str(LMCACHE_PD), "restart", "--workdir", str(self.workdir)]
        command += ["--timeout-s", str(int(timeout_s))]
        lines: list[tuple[float, str]] = []
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, process_group=0
        ) as roll:
            assert roll.stdout is not None
            for line in roll.stdout:  # ends when the command does: it has its own deadline
                lines.append((time.monotonic(), line.rstrip()))
            code = roll.wait(HEALTH_TIMEOUT_S)
        if code != 0:
            raise RuntimeError(f"lmcache-pd restart exited {code}: {[t for _, t in lines]}")
        return lines

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """SIGTERM serve (it unwinds as on Ctrl-C, stopping every instance) and wait; SIGKILL
        its group past ``SERVE_STOP_TIMEOUT_S`` (its instances die with it: PDEATHSIG)."""
        if self._process.poll() is None:
            self._process.send_signal(signal.SIGTERM)
        try:
            self._process.wait(SERVE_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.error("serve did not stop in %.0f s; killing it", SERVE_STOP_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(SERVE_STOP_TIMEOUT_S)
        self._log.close()

    def __enter__(self) -> Serve:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
