"""Start prefill and decode pools of vLLM from one YAML file, and the proxy in front of them.

Every instance gets its own HTTP port and, for decode, its own KV receive ports, picked free at
start; its transfer config is a copy of the named YAML with those ports and a stats file. All
instances start at once; the launcher waits for each to be healthy (with a progress display),
then warms each up (``VLLMServer.warm_up``: what vLLM compiles on first use is compiled before the
proxy sends traffic), and fails with the instance's name and the end of its log if one does not
come up. Stopping (Ctrl-C, SIGTERM, or leaving the ``with`` block) stops every process it started,
process group and all. ``supervise`` adds a ``Supervisor`` (``supervisor.py``): instances that die
are started again, and ``lmcache-pd restart`` rolls them.

The instances of one launch share a key of their own (``new_instance_key``), so that only the
proxy in front of them can call them: each vLLM gets it in its environment, the proxy reads it
from ``WORKDIR/instance.key`` (readable by its owner alone). The KV channel between them admits
no other process: from one deployment secret (``lmcache_pd/auth.py``: ``$LMCACHE_PD_SECRET`` if
set, else a fresh one, never written) each role's share is written to ``WORKDIR/kv.ROLE.key``,
and each process's config names its own role's (prefill: the producer's, decode: the consumer's,
the proxy: the proxy's).
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import msgspec
import yaml
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from lmcache_pd import auth
from lmcache_pd.auth import SECRET_ENV, generate_secret
from lmcache_pd.deploy.instance import (
    Role,
    connector_config,
    instance_args,
    instance_env,
    kv_events_args,
    transfer_settings,
)
from lmcache_pd.deploy.pools import InstanceSpec, PoolsConfig
from lmcache_pd.deploy.vllm_server import DRAIN_EXIT_MARGIN_S, VLLMServer
from lmcache_pd.errors import ConfigError, PDError
from lmcache_pd.metrics_scrape import scrape
from lmcache_pd.peers import format_peer
from lmcache_pd.proxy.config import (
    INSTANCE_API_KEY_ENV,
    DecodeInstance,
    KVEventsAddress,
    PrefillInstance,
    ProxyConfig,
    Timeouts,
    with_env_keys,
)

if TYPE_CHECKING:
    from lmcache_pd.deploy.supervisor import RestartPolicy, Supervisor

logger = logging.getLogger(__name__)


class LaunchError(PDError):
    """An instance did not start; the message names it and ends with its last log lines."""


# Ports are picked below the kernel's ephemeral range: an instance binds its ports tens of
# seconds after they are picked, and an ephemeral one can be handed to some other process's
# outgoing connection in between ("Address already in use", after which vLLM hangs).
PORT_FLOOR = 20000
# The highest port picked; None: the one below the ephemeral range. The test suite's workers
# share the range out between them (tests/conftest.py), as each picks ports it binds only later.
PORT_CEILING: int | None = None
# Bytes of randomness in an instance key (``secrets.token_urlsafe``: 43 characters).
INSTANCE_KEY_BYTES = 32
INSTANCE_KEY_FILE = "instance.key"
# The key role of each instance role (``auth.py``).
KEY_ROLE = {"kv_producer": auth.Role.PRODUCER, "kv_consumer": auth.Role.CONSUMER}


def new_instance_key(environ: Mapping[str, str] | None = None) -> str:
    """The key the instances of one launch want from their callers: the proxy's instance key
    from the environment (``INSTANCE_API_KEY_ENV``) if it names one, else a fresh random one."""
    environ = os.environ if environ is None else environ
    return environ.get(INSTANCE_API_KEY_ENV) or secrets.token_urlsafe(INSTANCE_KEY_BYTES)


def write_key(path: Path, key: str) -> None:
    """Write ``key`` to ``path``, readable and writable by this user alone."""
    path.unlink(missing_ok=True)  # a file left by an earlier launch may have other modes
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(key + "\n")


def share_file(workdir: Path, role: auth.Role) -> Path:
    """Where a launch writes ``role``'s share of the deployment secret."""
    return workdir / f"kv.{role.value}.key"


def write_shares(workdir: Path, secret: str) -> dict[auth.Role, Path]:
    """Each role's share of ``secret`` in its file (readable by this user alone), by role;
    ``ConfigError`` for a secret too short."""
    files = {}
    for role, text in auth.role_shares(secret).items():
        files[role] = share_file(workdir, role)
        write_key(files[role], text)
    return files


def ephemeral_port_start() -> int:
    """The first port of the kernel's ephemeral range (IANA's where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux
        return 49152


def unused_port(taken: set[int]) -> int:
    """A port nobody listens on, below the ephemeral range and not in ``taken`` (it is added)."""
    if PORT_CEILING is None:
        high = max(ephemeral_port_start(), PORT_FLOOR + 1000)
    else:
        high = PORT_CEILING + 1
    candidates = list(range(PORT_FLOOR, high))
    random.shuffle(candidates)
    for port in candidates:
        if port in taken:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        taken.add(port)
        return port
    raise LaunchError(f"no free port between {PORT_FLOOR} and {high - 1}")


class Ports:
    """Ports of one launch: those the config names, each at most once, and free ones that
    collide with none of them."""

    def __init__(self, named: list[int]) -> None:
        self._taken = set(named)
        repeated = sorted({port for port in named if named.count(port) > 1})
        if repeated:
            raise ConfigError(f"ports used twice in the pools config: {repeated}")

    def take(self, wanted: int | None = None) -> int:
        return wanted if wanted is not None else unused_port(self._taken)


def receive_ports(ports: Ports, ranks: int) -> dict[str, int | list[int]]:
    """A decode instance's KV receive ports: one pair, or a list of each for several ranks."""
    if ranks == 1:
        return {"init_port": ports.take(), "alloc_port": ports.take()}
    pairs = [(ports.take(), ports.take()) for _ in range(ranks)]
    return {"init_port": [p[0] for p in pairs], "alloc_port": [p[1] for p in pairs]}


def peer_text(decode: DecodeInstance) -> str:
    """``decode``'s receive address as a producer's ``warm_peers`` names it."""
    return format_peer(decode.receiver_host, decode.init_port, decode.alloc_port)


def start_instance(
    pools: PoolsConfig,
    workdir: Path,
    name: str,
    spec: InstanceSpec,
    role: str,
    port: int,
    settings_of_role: dict[str, Any],
    *,
    log_name: str | None = None,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    secret_file: Path | None = None,
    kv_keys: str | None = None,
    kv_events: KVEventsAddress | None = None,
) -> VLLMServer:
    """Start instance ``name`` of ``pools`` without waiting for it: its transfer config is a copy
    of ``spec.config`` with ``kv_role`` and ``settings_of_role`` (a decode rank's receive ports,
    a prefill's warm peers), written to ``workdir/NAME.yaml``; its log is ``workdir/NAME.log``
    (or ``LOG_NAME.log``); with ``api_key`` it answers only /health and /metrics without it;
    ``secret_file``: the file of its role's share of the deployment secret (it replaces any
    the instance's config names); ``kv_keys``: that share itself (``auth.share_text``), given in
    the server's environment (``SECRET_ENV``, never on its command line) where no file on its
    host holds it, over any file its config names;
    ``kv_events``: where it publishes its prefix cache's KV events (None: nowhere). Every engine
    starts its instances with this."""
    settings = transfer_settings(pools, name, spec, role, settings_of_role)
    if secret_file is not None:
        settings["secret_file"] = str(secret_file.resolve())
    elif kv_keys is not None:
        settings.pop("secret_file", None)
    if pools.trace:
        settings["trace_path"] = str(workdir / f"{name}.trace.jsonl")
    config_path = workdir / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(settings))
    log_path = workdir / f"{log_name or name}.log"
    server = VLLMServer(
        Path(pools.model),
        port,
        log_path,
        kv_transfer_config=connector_config(role, str(config_path)),
        cpu=spec.cpus,
        process_cpus=spec.process_cpus,
        env=instance_env(pools, spec) | ({} if kv_keys is None else {SECRET_ENV: kv_keys}),
        engine_args=pools.engine_args,
        extra_args=[
            *instance_args(pools, spec),
            *([] if kv_events is None else kv_events_args(kv_events)),
        ],
        log_stats=True,
        wait=False,
        host=host,
        api_key=api_key,
        drain_timeout_s=pools.drain_timeout_s,
    )
    logger.info("%s starting on %s (log %s)", name, server.url, log_path)
    return server


def proxy_config_for(
    pools: PoolsConfig,
    prefill: list[PrefillInstance],
    decode: list[DecodeInstance],
    workdir: Path,
    instance_key: str,
    secret_file: Path | None = None,
) -> ProxyConfig:
    """The proxy's config for ``pools`` whose instances are ``prefill`` and ``decode`` and want
    ``instance_key``, also written to ``workdir/proxy.yaml`` (what ``lmcache-pd proxy`` needs to
    front them; the key itself goes to ``workdir/instance.key``, which it names). The clients'
    key is the pools file's, or the environment's (``API_KEY_ENV``), which is not written.
    ``secret_file``: the proxy's share of the deployment secret (``share_file``)."""
    key_path = workdir / INSTANCE_KEY_FILE
    write_key(key_path, instance_key)
    client_key_file = pools.proxy.api_key_file
    proxy = ProxyConfig(
        model=pools.model,
        prefill=prefill,
        decode=decode,
        host=pools.proxy.host,
        port=pools.proxy.port,
        timeouts=Timeouts(decode_read_s=pools.proxy.decode_read_timeout_s),
        trace_path=str(workdir / "proxy.trace.jsonl") if pools.trace else None,
        tokenizer=pools.model,
        min_disagg_tokens=pools.proxy.min_disagg_tokens,
        routing=pools.proxy.routing,
        cpus=pools.proxy.cpus,
        first_token_notices=pools.proxy.first_token_notices,
        api_key_file=None if client_key_file is None else str(Path(client_key_file).resolve()),
        instance_api_key_file=str(key_path.resolve()),
        max_in_flight=pools.proxy.max_in_flight,
        secret_file=None if secret_file is None else str(secret_file.resolve()),
    )
    (workdir / "proxy.yaml").write_text(yaml.safe_dump(msgspec.to_builtins(proxy)))
    return with_env_keys(proxy)


@dataclass(frozen=True, slots=True)
class _Launch:
    """What an instance was started with, so that ``restart`` can start it again alike."""

    spec: InstanceSpec
    role: Role
    port: int
    settings_of_role: dict[str, Any]
    kv_events: KVEventsAddress | None


class PoolLauncher:
    """Starts the pools of ``PoolsConfig``; a context manager that stops them all on exit."""

    def __init__(
        self,
        pools: PoolsConfig,
        workdir: Path,
        console: Console | None = None,
        *,
        kv_secret: bool = True,
    ) -> None:
        """``kv_secret=False`` leaves the KV channel unauthenticated: only for a benchmark's
        control (what authentication costs), never offered on the command line."""
        self.pools = pools
        self.workdir = workdir
        self.console = console or Console(stderr=True)
        self.servers: dict[str, VLLMServer] = {}
        self.instance_key = new_instance_key()
        # Each role's share of the deployment secret, by role (None: no secret).
        self.key_files: dict[auth.Role, Path] | None = None
        self._kv_secret = kv_secret
        self._launches: dict[str, _Launch] = {}
        self._restarts: dict[str, int] = {}
        # Held while an instance is replaced or the pools stop: a supervisor's thread restarts
        # instances while the caller's may be stopping them all.
        self._lock = threading.Lock()
        self._closed = False
        self._supervisor: Supervisor | None = None

    def start(self) -> ProxyConfig:
        """Start every instance, wait until all are healthy, and return the proxy's config."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self._kv_secret:
            self.key_files = write_shares(
                self.workdir, os.environ.get(SECRET_ENV) or generate_secret()
            )
        instances = (*self.pools.prefill, *self.pools.decode)
        ports = Ports([self.pools.proxy.port, *(spec.port for spec in instances if spec.port)])
        prefill, decode = [], []
        try:
            # Decode's ports first: every prefill instance shakes hands with every decode rank
            # ahead of its first request (warm_peers), off any request's path.
            for spec in self.pools.decode:
                port = ports.take(spec.port)
                receive = receive_ports(ports, spec.tensor_parallel_size)
                decode.append(
                    DecodeInstance(
                        f"http://127.0.0.1:{port}",
                        "127.0.0.1",
                        **receive,
                        kv_events=self._events_address(ports),
                    )
                )
            peers = [peer_text(d) for d in decode]
            for index, spec in enumerate(self.pools.prefill):
                port = ports.take(spec.port)
                events = self._events_address(ports)
                name = f"prefill-{index}"
                self._launch(name, spec, "kv_producer", port, {"warm_peers": peers}, events)
                prefill.append(PrefillInstance(f"http://127.0.0.1:{port}", kv_events=events))
            for index, (spec, member) in enumerate(zip(self.pools.decode, decode, strict=True)):
                receive = {"init_port": member.init_port, "alloc_port": member.alloc_port}
                port = int(member.url.rsplit(":", 1)[1])
                self._launch(
                    f"decode-{index}", spec, "kv_consumer", port, receive, member.kv_events
                )
            self._wait_all_healthy()
        except BaseException:
            self.stop()
            raise
        return proxy_config_for(
            self.pools,
            prefill,
            decode,
            self.workdir,
            self.instance_key,
            None if self.key_files is None else self.key_files[auth.Role.PROXY],
        )

    def _launch(
        self,
        name: str,
        spec: InstanceSpec,
        role: Role,
        port: int,
        settings_of_role: dict[str, Any],
        kv_events: KVEventsAddress | None,
        log_name: str | None = None,
    ) -> None:
        """Start one instance and remember how, for ``restart``."""
        self._launches[name] = _Launch(spec, role, port, settings_of_role, kv_events)
        self.servers[name] = start_instance(
            self.pools,
            self.workdir,
            name,
            spec,
            role,
            port,
            settings_of_role,
            log_name=log_name,
            api_key=self.instance_key,
            secret_file=None if self.key_files is None else self.key_files[KEY_ROLE[role]],
            kv_events=kv_events,
        )

    def _events_address(self, ports: Ports) -> KVEventsAddress | None:
        """Where a new instance publishes its KV events: for the proxy's KV routing only."""
        if self.pools.proxy.routing != "kv":
            return None
        return KVEventsAddress("127.0.0.1", ports.take(), ports.take())

    def _wait_all_healthy(self) -> None:
        """Each instance healthy, then warmed up (``VLLMServer.warm_up``), all at once."""
        columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*columns, console=self.console, transient=True) as progress:
            tasks = {name: progress.add_task(f"{name}: starting", total=1) for name in self.servers}
            started = time.monotonic()
            for name, server in self.servers.items():
                try:
                    server.wait_until_healthy()
                except (RuntimeError, TimeoutError) as exc:
                    raise LaunchError(f"{name} did not start: {exc}") from None
                progress.update(tasks[name], description=f"{name}: warming up")
            names = list(self.servers)
            with ThreadPoolExecutor(len(names)) as pool:
                for name, seconds in zip(names, pool.map(self._warm_up, names), strict=True):
                    progress.update(
                        tasks[name],
                        completed=1,
                        description=f"{name}: ready after {time.monotonic() - started:.0f} s "
                        f"(warm-up {seconds:.1f} s)",
                    )

    def _warm_up(self, name: str) -> float:
        try:
            seconds = self.servers[name].warm_up()
        except httpx.HTTPError as exc:
            raise LaunchError(f"{name} failed its warm-up requests: {exc!r}") from None
        logger.info("%s warmed up in %.1f s", name, seconds)
        return seconds

    def counters(self) -> dict[str, dict[str, float]]:
        """Each instance's connector counters and gauges, from its ``/metrics`` (vLLM publishes
        them after a step; empty for an instance that does not answer)."""
        found: dict[str, dict[str, float]] = {}
        for name, server in self.servers.items():
            try:
                found[name] = scrape(server.url)
            except httpx.HTTPError as exc:
                logger.warning("%s: no counters: %s", name, exc)
                found[name] = {}
        return found

    def signal(self, name: str, signum: int) -> None:
        """Send ``signum`` to every process of instance ``name`` (its process group: the API
        server and vLLM's engine processes), as a crash (SIGKILL) or a frozen host (SIGSTOP,
        SIGCONT) would hit them all at once."""
        self.servers[name].send_signal(signum)

    def supervise(self, policy: RestartPolicy | None = None) -> Supervisor:
        """Start looking after the started instances (``supervisor.py``); ``stop`` ends it."""
        from lmcache_pd.deploy.supervisor import RestartPolicy, Supervisor

        self._supervisor = Supervisor(self, policy or RestartPolicy())
        self._supervisor.start()
        return self._supervisor

    def drain(self, name: str) -> float:
        """SIGTERM instance ``name``'s API server, as Kubernetes or an operator would: it
        leaves routing (/health 503), finishes its requests, and exits; wait for that up to
        ``drain_timeout_s`` and ``DRAIN_EXIT_MARGIN_S``, then stop whatever is left of it.
        Returns the seconds it took."""
        server = self.servers[name]
        started = time.monotonic()
        logger.info("%s draining (up to %.0f s)", name, self.pools.drain_timeout_s)
        server.terminate()
        if not server.wait_exit(self.pools.drain_timeout_s + DRAIN_EXIT_MARGIN_S):
            logger.warning("%s did not exit after its drain; stopping it", name)
        server.stop()
        return time.monotonic() - started

    def restart(self, name: str, spec: InstanceSpec | None = None, *, drain: bool = False) -> float:
        """Stop instance ``name`` (its whole process group, whether alive, stopped or dead;
        with ``drain``, drained first) and start it again on the same HTTP and KV receive ports
        with the same transfer config, or with ``spec`` in place of its own; block until it is
        healthy and warmed up, and return the seconds that took. Its counters start again from
        zero; its earlier log is kept (``NAME.log``, then ``NAME.1.log``, ...). ``LaunchError``
        if it does not come up, or the pools are stopping."""
        launch = self._launches[name]
        started = time.monotonic()
        if drain:
            self.drain(name)
        with self._lock:
            if self._closed:
                raise LaunchError(f"{name} not restarted: the pools are stopping")
            self.servers[name].stop()
            self._restarts[name] = count = self._restarts.get(name, 0) + 1
            self._launch(
                name,
                spec or launch.spec,
                launch.role,
                launch.port,
                launch.settings_of_role,
                launch.kv_events,
                f"{name}.{count}",
            )
            server = self.servers[name]
        try:  # outside the lock: ``stop`` ends this wait by stopping the server
            server.wait_until_healthy()
        except (RuntimeError, TimeoutError) as exc:
            raise LaunchError(f"{name} did not restart: {exc}") from None
        self._warm_up(name)
        return time.monotonic() - started

    def stop(self) -> None:
        """Stop the supervisor, if any, and every instance (idempotent): the decodes, side by
        side, then the prefills, so that no push lands in a stopping decode (a vLLM takes ~6 s
        to stop here)."""
        if self._supervisor is not None:
            self._supervisor.stop_soon()
        with self._lock:
            self._closed = True
            servers = dict(self.servers)

        def stop(name: str) -> None:
            servers[name].stop()
            logger.info("%s stopped", name)

        decode = sorted(name for name in servers if name.startswith("decode"))
        for names in (decode, sorted(servers.keys() - set(decode))):
            if names:
                with ThreadPoolExecutor(len(names)) as pool:
                    list(pool.map(stop, names))
        if self._supervisor is not None:
            self._supervisor.close()

    def __enter__(self) -> PoolLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
