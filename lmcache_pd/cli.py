"""The ``lmcache-pd`` command: serve pools behind the proxy, run the proxy or a consumer rank
alone, the demos, make the tiny model, and write a pools file's Kubernetes manifests."""

from __future__ import annotations

import contextlib
import logging
import signal
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from lmcache_pd.config import load_config
from lmcache_pd.deploy.launcher import PoolLauncher
from lmcache_pd.deploy.pools import PoolsConfig, load_pools
from lmcache_pd.keys import ChunkKeyer

if TYPE_CHECKING:
    from torch import Tensor

    from lmcache_pd.deploy.ray_pools import RayPools

app = typer.Typer(no_args_is_help=True, add_completion=False, help=__doc__)
logger = logging.getLogger(__name__)

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
LANDING_TIMEOUT_S = 10.0
STATS_EVERY_S = 30.0
# The demo's prompts: a shared system prefix, then each request's own tail (tokens).
DEMO_PREFIX_TOKENS = 512
DEMO_TAIL_TOKENS = (700, 1100, 37, 2000)


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(name)s: %(message)s", handlers=[RichHandler()]
    )


def _keyer(chunk_size: int, model_name: str, kv_dtype: str) -> ChunkKeyer:
    return ChunkKeyer(
        model_name=model_name, world_size=1, worker_id=0, kv_dtype=kv_dtype, chunk_size=chunk_size
    )


def _fake_kv(key: bytes, tokens: int, floats_per_token: int) -> Tensor:
    """Stand-in KV for the demo, a function of the chunk key as real KV is of its prefix."""
    import torch

    seed = int.from_bytes(key[:8], "little") & (2**63 - 1)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, floats_per_token, generator=generator)


@app.command()
def consumer(
    config: Annotated[Path, typer.Option(help="consumer YAML")] = CONFIGS / "consumer.yaml",
    model_name: Annotated[str, typer.Option(help="part of every chunk key")] = "demo",
    kv_dtype: Annotated[str, typer.Option(help="part of every chunk key")] = "float32",
    log_level: str = "info",
) -> None:
    """Serve a consumer rank until SIGINT or SIGTERM, logging its counters now and then."""
    from lmcache_pd.transfer.consumer import Consumer

    _setup_logging(log_level)
    settings = load_config(config)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with Consumer(settings, _keyer(settings.chunk_size, model_name, kv_dtype)) as rank:
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

    _setup_logging(log_level)
    console = Console(stderr=True)
    settings, workdir = _pools_and_model(pools, workdir)
    engine: RayPools | PoolLauncher
    if settings.engine == "ray":
        from lmcache_pd.deploy.ray_pools import RayPools

        engine = RayPools(settings, workdir)
        where = f"Ray namespace {settings.ray.namespace}; `lmcache-pd scale` resizes a pool"
    else:
        engine = PoolLauncher(settings, workdir, console)
        where = f"logs in {workdir}"
    with _terminate_on_sigterm(), engine:
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

    from lmcache_pd.deploy.ray_pools import connect, controller

    if pool not in ("prefill", "decode"):
        raise typer.BadParameter(f"pool is prefill or decode, not {pool!r}")
    _setup_logging(log_level)
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

    _setup_logging(log_level)
    settings = load_proxy_config(config)
    run_proxy(settings, ready=lambda url: logger.info("proxy listening at %s/v1", url))


@app.command()
def demo(
    pools: Annotated[Path, typer.Argument(help="pools YAML")] = CONFIGS / "pools.yaml",
    prompt: str = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    max_tokens: int = 24,
    log_level: str = "warning",
) -> None:
    """The real thing at its smallest: 1 prefill and 1 decode vLLM behind the proxy, one
    completion streamed as it arrives, what moved, then a clean shutdown."""
    from openai import OpenAI

    from lmcache_pd.harness.app_thread import proxy_thread

    _setup_logging(log_level)
    console = Console()
    settings, workdir = _pools_and_model(pools, Path(tempfile.mkdtemp(prefix="lmcache-pd-demo-")))
    console.print(f"starting the pools of {pools} (logs in {workdir}) ...")
    with (
        _terminate_on_sigterm(),
        PoolLauncher(settings, workdir, console) as launcher,
        # A demo of the transfer: its short prompt is disaggregated too (min_disagg_tokens 0).
        proxy_thread(msgspec.structs.replace(launcher.start(), min_disagg_tokens=0)) as running,
    ):
        client = OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)
        # The first request of each instance pays one-off costs (kernels, handshake): not shown.
        client.completions.create(model=settings.model, prompt=prompt[::-1], max_tokens=2)
        before = launcher.counters()
        console.print(f"[bold]prompt[/bold]: {prompt!r}\n[bold]answer[/bold]: ", end="")
        started = time.monotonic()
        ttft = None
        stream = client.completions.create(
            model=settings.model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        for chunk in stream:
            ttft = ttft or time.monotonic() - started
            console.print(chunk.choices[0].text, end="", markup=False, highlight=False)
        total = time.monotonic() - started
        console.print()
        moved = _counter_changes(before, launcher.counters())
    console.print(
        f"first token after {1e3 * (ttft or 0):.0f} ms (from prefill, through the proxy); "
        f"all {max_tokens} tokens after {1e3 * total:.0f} ms"
    )
    console.print(
        f"prefill pushed {moved['chunks_pushed']:.0f} chunks "
        f"({moved['bytes_pushed'] / 2**20:.2f} MiB) in {moved['pushes']:.0f} pushes; decode "
        f"loaded {moved['tokens_loaded']:.0f} prompt tokens instead of computing them "
        f"({moved['loads_failed']:.0f} loads failed, {moved['integrity_failures']:.0f} bad "
        "chunks); all instances and the proxy stopped (counters from each vLLM's /metrics)"
    )


def _pools_and_model(pools: Path, workdir: Path | None) -> tuple[PoolsConfig, Path]:
    """The pools config, with its model built first if it is not there yet."""
    from lmcache_pd.harness.model_maker import ensure_model

    settings = load_pools(pools)
    ensure_model(Path(settings.model))
    return settings, workdir or Path(tempfile.mkdtemp(prefix="lmcache-pd-serve-"))


@contextlib.contextmanager
def _terminate_on_sigterm() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so that every ``with`` block stops what it started."""

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _counter_changes(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> defaultdict[str, float]:
    """Per counter, its change summed over all instances."""
    moved: defaultdict[str, float] = defaultdict(float)
    for name, counters in after.items():
        for counter, value in counters.items():
            moved[counter] += value - before.get(name, {}).get(counter, 0)
    return moved


@app.command("transfer-demo")
def transfer_demo(
    producer_config: Annotated[Path, typer.Option()] = CONFIGS / "producer.yaml",
    consumer_config: Annotated[Path, typer.Option()] = CONFIGS / "consumer.yaml",
    log_level: str = "warning",
) -> None:
    """Push a few requests' chunks from this process into a consumer process, check every byte,
    and print what moved and how fast."""
    import torch

    from lmcache_pd.harness.consumer_process import ConsumerProcess
    from lmcache_pd.kernels.integrity import checksum
    from lmcache_pd.protocol import DisaggSpec
    from lmcache_pd.transfer.producer import Producer

    _setup_logging(log_level)
    console = Console()
    settings = load_config(producer_config)
    receiver = load_config(consumer_config).for_rank(0)  # the child consumer is one rank
    keyer = _keyer(settings.chunk_size, "demo", "float32")
    floats_per_token = settings.page_bytes // settings.chunk_size // 4
    table = Table(title="lmcache-pd demo: producer process -> consumer process over NIXL")
    for column in ("request", "tokens", "chunks sent", "already held", "MiB sent", "ms", "GB/s"):
        table.add_column(column, justify="right")
    with ConsumerProcess(consumer_config) as child, Producer(settings) as producer:
        for index, tail in enumerate(DEMO_TAIL_TOKENS):
            req_id = f"demo-{index}"
            own = 10**6 * (index + 1)
            tokens = list(range(DEMO_PREFIX_TOKENS)) + list(range(own, own + tail))
            keys = keyer.chunk_keys(tokens)
            spec = DisaggSpec(
                req_id=req_id,
                receiver_host=receiver.receiver_host,
                receiver_init_port=receiver.init_port,
                receiver_alloc_port=receiver.alloc_port,
            )
            producer.connect(spec)  # a real producer shakes hands before its first request
            with producer.staged(len(keys)) as pages:
                # Build each chunk in registered memory, as the KV gather will: no copy to push.
                chunks = []
                for k, page in zip(keys, pages, strict=True):
                    kv = _fake_kv(k.key, k.end - k.start, floats_per_token)
                    nbytes = kv.numel() * kv.element_size()
                    chunks.append((k.key, page[:nbytes].copy_(kv.view(-1).view(torch.uint8))))
                result = producer.push(spec, chunks)
                child.wait_until(
                    lambda _, tokens=tokens: child.call("lookup", tokens=tokens) == len(tokens),
                    LANDING_TIMEOUT_S,
                    f"{req_id} landed",
                )
                landed = child.call("checksums", keys=[key.hex() for key, _ in chunks])
                if landed != [checksum(tensor) for _, tensor in chunks]:
                    raise typer.Exit(f"{req_id}: landed bytes differ from the source")
            table.add_row(
                req_id,
                str(len(tokens)),
                str(result.chunks_sent),
                str(result.chunks_skipped),
                f"{result.bytes_sent / 2**20:.1f}",
                f"{result.seconds * 1e3:.2f}",
                f"{result.bytes_sent / result.seconds / 1e9:.2f}",
            )
        for index in range(len(DEMO_TAIL_TOKENS)):
            child.call("release", req_id=f"demo-{index}")
        stats = child.wait_until(lambda s: s["used_pages"] == 0, 5, "pages released")
    console.print(table)
    console.print(
        f"consumer: {stats['chunks_landed']} chunks landed ({stats['bytes_landed'] / 2**20:.1f}"
        f" MiB), {stats['chunks_already_held']} not resent, every landed byte verified"
    )
    console.print(
        "against raw NIXL and memcpy on the same pages, from a checkout: "
        "python -m benchmarks.transfer"
    )


@app.command("make-model")
def make_model_command(
    directory: Annotated[Path, typer.Argument(help="the Hugging Face folder to write")],
    seed: Annotated[int, typer.Option(help="seeds the random weights")] = 0,
    force: Annotated[bool, typer.Option(help="rebuild even if this build is there")] = False,
) -> None:
    """Write the tiny random Llama that vLLM serves offline here, and print its folder.

    A folder already holding this seed's build is kept unless --force."""
    from lmcache_pd.harness.model_maker import ensure_model, make_model

    _setup_logging("info")
    built = make_model(directory, seed=seed) if force else ensure_model(directory, seed=seed)
    typer.echo(built)


@app.command()
def k8s(
    pools: Annotated[Path, typer.Argument(help="pools YAML")],
    output: Annotated[
        Path | None, typer.Option(help="write one file per object into this folder")
    ] = None,
) -> None:
    """Write the Kubernetes manifests of POOLS (its `kubernetes:` section says the image,
    namespace, names and model volume): decode and prefill as StatefulSets with headless
    Services, the proxy as a Deployment with a Service, their YAMLs as ConfigMaps. Printed as
    one YAML stream, or with --output one file per object; then `kubectl apply -f`."""
    from lmcache_pd.deploy.k8s import file_name, manifests, to_yaml
    from lmcache_pd.errors import ConfigError

    try:
        objects = manifests(load_pools(pools))
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="POOLS") from None
    if output is None:
        typer.echo(to_yaml(objects), nl=False)
        return
    output.mkdir(parents=True, exist_ok=True)
    for index, manifest in enumerate(objects):
        (output / file_name(index, manifest)).write_text(to_yaml([manifest]))
    typer.echo(f"{len(objects)} objects written to {output}", err=True)


if __name__ == "__main__":
    app()
