"""The fleet benchmark on the Ray engine: a one-node Ray cluster of its own, and ``lmcache-pd
serve`` of a pools file with ``engine: ray`` on it, its instances found through the controller.

The cluster is the benchmark's alone: ``ray start --head --block`` in a process group of its
own (stopped by that group, never by ``ray stop``, which ends every Ray process of this user on
the host), its temp folder and every port it binds picked free here, and Ray's token auth on
(every node, driver and ``lmcache-pd scale`` carry the token), as the docs ask of any cluster.

The instances are the controller's: their URLs, vLLM servers' pids and conditions come from its
``describe`` (the same the ``scale`` command prints), read by this process as a second driver of
the cluster; a restarted instance keeps its name and gets new ports. A pool shrinks through the
``lmcache-pd scale`` command itself, as an operator would.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.chaos.pools import pools_file
from benchmarks.fleet.serve import LMCACHE_PD, Member, Serve
from lmcache_pd.deploy.launcher import unused_port
from lmcache_pd.deploy.pools import RaySpec
from lmcache_pd.proxy.config import load_proxy_config

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)

HEAD_UP_TIMEOUT_S = 120.0
# ``ray start --block`` takes ~30 s to stop its node on SIGTERM here; by then nothing of ours
# runs on it, so its group is killed sooner.
HEAD_STOP_TIMEOUT_S = 10.0
STARTED_LINE = "Ray runtime started"
# Ports a worker process may bind (one per Ray worker: the controller, each instance actor and
# each restart of one, and every driver: serve, scale, this process).
WORKER_PORTS = 48
DESCRIBE_TIMEOUT_S = 10.0
# What ``ray start`` gets besides the ports: a small object store (nothing large goes through
# it here) and no dashboard.
OBJECT_STORE_BYTES = 80_000_000
NAMESPACE = "lmcache-pd-fleet"


class RayHead:
    """A one-node Ray cluster of this benchmark's own, for the instances' ``num_cpus``; a
    context manager that stops it (its whole process group) on exit."""

    def __init__(self, num_cpus: float, log_path: Path) -> None:
        """Start the node; this process joins it later as a driver (``RayServe``), so Ray's
        token goes into its environment here, before Ray is imported: Ray reads it once, then."""
        if "ray" in sys.modules:
            raise RuntimeError("Ray was imported before its token was set: start RayHead first")
        self.env = {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32),
            "RAY_USAGE_STATS_ENABLED": "0",
            # Ray's memory monitor kills workers, the controller first among them, once the
            # host's memory passes 95%: on a host shared with other work that is theirs as much
            # as ours (seen here: every actor of the deployment killed while it started). Off,
            # so that what is measured is the events the benchmark strikes.
            "RAY_memory_monitor_refresh_ms": "0",
        }
        os.environ.update(self.env)
        import ray

        # Short: Ray's Unix sockets live under it (108 bytes at most a path).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="lpr-"))
        taken: set[int] = set()
        self.port = unused_port(taken)
        # The node's own address, as Ray picks it for every process of the cluster: the drivers
        # (serve, scale, this process) find their node's raylet by it.
        self.address = f"{ray.util.get_node_ip_address()}:{self.port}"
        named = {
            "--ray-client-server-port": unused_port(taken),
            "--node-manager-port": unused_port(taken),
            "--object-manager-port": unused_port(taken),
            "--dashboard-port": unused_port(taken),  # its usage-stats module runs anyway
            "--dashboard-agent-listen-port": unused_port(taken),
            "--dashboard-agent-grpc-port": unused_port(taken),
            "--runtime-env-agent-port": unused_port(taken),
            "--metrics-export-port": unused_port(taken),
        }
        workers = ",".join(str(unused_port(taken)) for _ in range(WORKER_PORTS))
        self.command = [
            str(LMCACHE_PD.with_name("ray")),
            "start",
            "--head",
            "--block",
            f"--port={self.port}",
            f"--num-cpus={math.ceil(num_cpus)}",
            f"--object-store-memory={OBJECT_STORE_BYTES}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--temp-dir={self.temp_dir}",
            f"--worker-port-list={workers}",
            *(f"{flag}={port}" for flag, port in named.items()),
        ]
        self.log_path = log_path
        self._log = log_path.open("w")
        self._process = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            process_group=0,  # Ray's processes are its children, in this group
            env=os.environ | self.env,
        )
        self._wait_started()

    @property
    def pid(self) -> int:
        return self._process.pid

    def _wait_started(self) -> None:
        deadline = time.monotonic() + HEAD_UP_TIMEOUT_S
        while time.monotonic() < deadline:
            if STARTED_LINE in self.log_path.read_text(errors="replace"):
                return
            if self._process.poll() is not None:
                break
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"the Ray head did not start: see {self.log_path}")

    def leftovers(self) -> list[int]:
        """Processes started for this cluster still alive, by the token in their environment
        (Ray's workers lead groups of their own and rename themselves; serve, its actors and
        their vLLMs inherit it too), this process aside."""
        found = []
        needle = f"RAY_AUTH_TOKEN={self.env['RAY_AUTH_TOKEN']}".encode()
        for entry in Path("/proc").glob("[0-9]*"):
            with contextlib.suppress(OSError):
                if int(entry.name) != os.getpid() and needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
        return sorted(found)

    def stop(self) -> None:
        """SIGTERM the group (``ray start --block`` stops the node), SIGKILL what is left after
        ``HEAD_STOP_TIMEOUT_S``, then any process of the cluster outside the group; remove its
        temp folder (Ray's sockets and session logs: serve's log has what matters)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._process.wait(HEAD_STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self._process.wait(HEAD_STOP_TIMEOUT_S)
        for pid in self.leftovers():
            logger.warning("Ray process %d outlived its node's group; killing it", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        self._log.close()

    def __enter__(self) -> RayHead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RayServe(Serve):
    """``lmcache-pd serve`` of ``pools_path`` with ``engine: ray`` on ``head``'s cluster; its
    ``servers`` are the controller's instances as it last described them (``refresh``)."""

    def __init__(
        self, pools_path: str, workdir: Path, drain_timeout_s: float, head: RayHead
    ) -> None:
        self.head = head
        spec = RaySpec(address=head.address, namespace=NAMESPACE)
        super().__init__(pools_path, workdir, drain_timeout_s, ray=spec, env=head.env)
        self.groups.add(head.pid)
        self._controller: ActorHandle | None = None
        self._described: dict[str, dict[str, Any]] = {}

    def _read_instances(self) -> None:
        self.proxy = load_proxy_config(self.workdir / "proxy.yaml")
        self.refresh()

    def _controller_handle(self) -> ActorHandle:
        import ray

        from lmcache_pd.deploy.ray_pools import CONTROLLER_NAME

        if self._controller is None:
            # With the token RayHead put in this process's environment.
            ray.init(
                address=self.head.address,
                namespace=NAMESPACE,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            self._controller = ray.get_actor(CONTROLLER_NAME, namespace=NAMESPACE)
        return self._controller

    def refresh(self) -> dict[str, dict[str, Any]]:
        """The controller's ``describe`` now; ``servers`` set from it (every instance it has, at
        its current URL), each vLLM server's group noted."""
        import ray

        described = ray.get(self._controller_handle().describe.remote(), timeout=DESCRIBE_TIMEOUT_S)
        assert self.proxy is not None
        headers = self.proxy.instance_headers()
        self.servers = {
            name: Member(about["member"]["url"], headers)
            for name, about in described.items()
            if "member" in about
        }
        self.groups.update(about["pid"] for about in described.values() if "pid" in about)
        self._described = described
        return described

    def all_up(self) -> bool:
        self.refresh()
        return super().all_up()

    def instance_pid(self, name: str) -> int | None:
        """Instance ``name``'s vLLM server as the controller last heard from it (the old one
        while Ray starts it again); None once it is gone."""
        about = self.refresh().get(name, {})
        return about.get("pid")

    def condition(self, name: str) -> str | None:
        """``ready``, ``restarting``, ``draining``... as the controller says (None: gone)."""
        return self._described.get(name, {}).get("condition")

    def actor_pid(self, server_pid: int) -> int:
        """The instance actor's process: the vLLM server's parent (one node here)."""
        stat = Path(f"/proc/{server_pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[1])

    def scale(self, role: str, count: int, timeout_s: float) -> subprocess.CompletedProcess[str]:
        """``lmcache-pd scale ROLE COUNT`` against this deployment, as an operator runs it."""
        command = [str(LMCACHE_PD), "scale", role, str(count), "--address", self.head.address]
        command += ["--namespace", NAMESPACE, "--timeout-s", str(int(timeout_s))]
        return subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout_s + 30,
            check=False,
            process_group=0,
            env=os.environ | self.head.env | {"COLUMNS": "200"},
        )

    def stop(self) -> None:
        super().stop()
        if self._controller is not None:
            import ray

            ray.shutdown()


def ray_cpus(pools_path: str) -> float:
    """The cores the pools' instances reserve on Ray (``num_cpus``)."""
    pools = pools_file(pools_path)
    return sum(spec.cores for spec in (*pools.prefill, *pools.decode))
