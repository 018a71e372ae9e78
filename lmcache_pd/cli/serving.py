"""Commands that serve: ``serve`` (pools and the proxy), ``restart`` (roll a one-host serve's
instances), ``scale`` (a pool on Ray), ``proxy`` (the routing proxy alone) and ``consumer`` (one
consumer rank alone)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from prometheus_client.registry import Collector
from rich.console import Console
from rich.table import Table

from lmcache_pd.cli.common import (
    CONFIGS,
    app,
    keyer,
    pools_and_model,
    setup_logging,
    terminate_on_sigterm,
)
from lmcache_pd.config import load_config
from lmcache_pd.deploy.control import ControlError, ControlServer, request_restart, socket_path
from lmcache_pd.deploy.launcher import PoolLauncher
from lmcache_pd.deploy.vllm_server import (
    DRAIN_EXIT_MARGIN_S,
    START_TIMEOUT_S,
    WARM_UP_TIMEOUT_S,
)

if TYPE_CHECKING:
    from lmcache_pd.deploy.ray_pools import RayPools
    from lmcache_pd.deploy.supervisor import Supervisor

logger = logging.getLogger(__name__)

STATS_EVERY_S = 30.0
# Where ``serve`` makes its work folder when given none (``pools_and_model``), which is where
# ``restart`` looks for one.
SERVE_WORKDIR_PREFIX = "lmcache-pd-serve-"


@app.command()
def consumer(
    config: Annotated[Path, typer.Option(help="consumer YAML")] = CONFIGS / "consumer.yaml",
    model_name: Annotated[str, typer.Option(help="part of every chunk key")] = "demo",
    kv_dtype: Annotated[str, typer.Option(help="part of every chunk key")] = "float32",
    log_level: str = "info",
) -> None:
    """Serve a consumer rank until SIGINT or SIGTERM, logging its counters now and then."""
    from lmcache_pd.transfer.consumer import Consumer

    setup_logging(log_level)
    settings = load_config(config)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with Consumer(settings, keyer(settings.chunk_size, model_name, kv_dtype)) as rank:
        while not stop.wait(STATS_EVERY_S):
            logger.info("consumer stats: %s", rank.stats_snapshot())
    logger.info("consumer stopped")


@app.command()
def serve(
    pools: Annotated[Path, typer.Argument(help="pools YAML")] = CONFIGS / "pools.yaml",
    workdir: Annotated[Path | None, typer.Option(help="instance logs and configs")] = None,
    log_level: str = "info",
) -> None:
    """Start the prefill and decode pools of POOLS and the proxy in front of them; serve until
    Ctrl-C or SIGTERM, then stop every process started."""
    from lmcache_pd.proxy.app import run_proxy

    setup_logging(log_level)
    console = Console(stderr=True)
    settings, workdir = pools_and_model(pools, workdir)
    engine: RayPools | PoolLauncher
    if settings.engine == "ray":
        from lmcache_pd.deploy.ray_pools import RayPools

        engine = RayPools(settings, workdir)
        where = f"Ray namespace {settings.ray.namespace}; `lmcache-pd scale` resizes a pool"
    else:
        engine = PoolLauncher(settings, workdir, console)
        where = f"logs in {workdir}; `lmcache-pd restart --workdir {workdir}` rolls instances"
    with terminate_on_sigterm(), engine:
        proxy = engine.start()
        stack = contextlib.ExitStack()
        collectors: list[Collector] = []
        if isinstance(engine, PoolLauncher):
            collectors.append(stack.enter_context(supervised(engine, workdir)).collector())
        with stack:
            run_proxy(
                proxy,
                collectors=collectors,
                ready=lambda url: console.print(
                    f"[bold green]serving {settings.model} at {url}/v1[/bold green] "
                    f"({len(proxy.prefill)} prefill, {len(proxy.decode)} decode; {where}); "
                    "Ctrl-C stops everything"
                ),
                members=engine if settings.engine == "ray" else None,
            )


@contextlib.contextmanager
def supervised(launcher: PoolLauncher, workdir: Path) -> Iterator[Supervisor]:
    """Instances that die are started again, and ``lmcache-pd restart`` rolls them through the
    control socket, while the block runs (``supervisor.py``, ``control.py``); yields the
    supervisor (its counts go on the proxy's ``/metrics``)."""
    supervisor = launcher.supervise()
    per_instance_s = (
        launcher.pools.drain_timeout_s + DRAIN_EXIT_MARGIN_S + START_TIMEOUT_S + WARM_UP_TIMEOUT_S
    )

    def roll(target: str | None, report: Callable[[str], None]) -> None:
        names = supervisor.names(target)
        supervisor.roll(names, report, per_instance_s * len(names))

    try:
        control = ControlServer(workdir, roll)
    except OSError as exc:  # e.g. a work folder's path too long for a Unix socket
        logger.error(
            "no control socket in %s (%s): `lmcache-pd restart` cannot reach this serve",
            workdir,
            exc,
        )
        yield supervisor
        return
    try:
        yield supervisor
    finally:
        control.close()


@app.command()
def restart(
    target: Annotated[
        str | None, typer.Argument(help="prefill, decode, or an instance (decode-0); none: all")
    ] = None,
    workdir: Annotated[
        Path | None, typer.Option(help="the work folder of the serve (none: the only one running)")
    ] = None,
    timeout_s: Annotated[float, typer.Option(help="longest wait for the whole roll")] = 3600.0,
    log_level: str = "info",
) -> None:
    """Roll the instances of a running one-host `serve` (engine local), one at a time: drain
    (no new requests, the running ones finish), restart, wait until healthy, next; the
    deployment serves throughout (a pool of one instance is down while it restarts)."""
    setup_logging(log_level)
    folder = workdir or _only_serve_workdir()
    try:
        for line in request_restart(folder, target, timeout_s):
            typer.echo(line)
    except ControlError as exc:
        typer.echo(f"restart failed: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo("restart done")


def _only_serve_workdir() -> Path:
    """The work folder of the one ``serve`` of this user that made its own (``--workdir`` not
    given to it) and has a control socket."""
    found = [
        path.parents[1]
        for path in Path(tempfile.gettempdir()).glob(f"{SERVE_WORKDIR_PREFIX}*/*/*")
        if path == socket_path(path.parents[1]) and path.stat().st_uid == os.getuid()
    ]
    if len(found) != 1:
        which = ", ".join(map(str, found)) if found else "none found"
        raise typer.BadParameter(f"name the serve's work folder ({which})", param_hint="--workdir")
    return found[0]


@app.command()
def scale(
    pool: Annotated[str, typer.Argument(help="prefill or decode")],
    count: Annotated[int, typer.Argument(help="instances the pool should have", min=1)],
    address: Annotated[str, typer.Option(help="the Ray cluster's address")] = "auto",
    namespace: Annotated[str, typer.Option(help="the deployment's Ray namespace")] = "lmcache-pd",
    timeout_s: Annotated[float, typer.Option(help="longest wait")] = 900.0,
    log_level: str = "info",
) -> None:
    """Grow or shrink a pool of a running `serve` on Ray (engine: ray) while it serves; a
    decode instance leaving is drained first. Prints every instance afterwards."""
    import ray

    from lmcache_pd.deploy.ray_cluster import connect
    from lmcache_pd.deploy.ray_pools import controller

    if pool not in ("prefill", "decode"):
        raise typer.BadParameter(f"pool is prefill or decode, not {pool!r}")
    setup_logging(log_level)
    connect(address, namespace)
    try:
        handle = controller(namespace)
        changed = ray.get(handle.scale.remote(pool, count), timeout=timeout_s)
        instances = ray.get(handle.describe.remote(), timeout=60)
    finally:
        ray.shutdown()
    console = Console()
    console.print(
        f"{pool}: added {changed['added'] or 'none'}, removed {changed['removed'] or 'none'} "
        f"in {changed['seconds']:.1f} s"
    )
    table = Table("instance", "condition", "node", "url", "server pid")
    for name, about in sorted(instances.items()):
        member = about.get("member", {})
        table.add_row(
            name,
            about["condition"],
            str(about.get("node", "")),
            member.get("url", ""),
            str(about.get("pid", "")),
        )
    console.print(table)


@app.command()
def proxy(
    config: Annotated[Path, typer.Argument(help="proxy YAML (model, prefill and decode URLs)")],
    log_level: str = "info",
) -> None:
    """Run the routing proxy alone, in front of instances started elsewhere."""
    from lmcache_pd.proxy.app import run_proxy
    from lmcache_pd.proxy.config import load_proxy_config

    setup_logging(log_level)
    settings = load_proxy_config(config)
    run_proxy(settings, ready=lambda url: logger.info("proxy listening at %s/v1", url))
