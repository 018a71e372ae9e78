"""Commands that serve: ``serve`` (pools and the proxy), ``scale`` (a pool on Ray), ``proxy``
(the routing proxy alone) and ``consumer`` (one consumer rank alone)."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
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
from lmcache_pd.deploy.launcher import PoolLauncher

if TYPE_CHECKING:
    from lmcache_pd.deploy.ray_pools import RayPools

logger = logging.getLogger(__name__)

STATS_EVERY_S = 30.0


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
        where = f"logs in {workdir}"
    with terminate_on_sigterm(), engine:
        proxy = engine.start()
        run_proxy(
            proxy,
            ready=lambda url: console.print(
                f"[bold green]serving {settings.model} at {url}/v1[/bold green] "
                f"({len(proxy.prefill)} prefill, {len(proxy.decode)} decode; {where}); "
                "Ctrl-C stops everything"
            ),
            members=engine if settings.engine == "ray" else None,
        )


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
