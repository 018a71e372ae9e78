"""The demos: ``demo`` (1 prefill and 1 decode vLLM behind the proxy, one streamed completion)
and ``transfer-demo`` (the transfer core alone, producer process to consumer process)."""

from __future__ import annotations

import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import msgspec
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
    from torch import Tensor

LANDING_TIMEOUT_S = 10.0
# The demo's prompts: a shared system prefix, then each request's own tail (tokens).
DEMO_PREFIX_TOKENS = 512
DEMO_TAIL_TOKENS = (700, 1100, 37, 2000)


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

    setup_logging(log_level)
    console = Console()
    settings, workdir = pools_and_model(pools, Path(tempfile.mkdtemp(prefix="lmcache-pd-demo-")))
    console.print(f"starting the pools of {pools} (logs in {workdir}) ...")
    with (
        terminate_on_sigterm(),
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


def _counter_changes(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> defaultdict[str, float]:
    """Per counter, its change summed over all instances."""
    moved: defaultdict[str, float] = defaultdict(float)
    for name, counters in after.items():
        for counter, value in counters.items():
            moved[counter] += value - before.get(name, {}).get(counter, 0)
    return moved


def _fake_kv(key: bytes, tokens: int, floats_per_token: int) -> Tensor:
    """Stand-in KV for the demo, a function of the chunk key as real KV is of its prefix."""
    import torch

    seed = int.from_bytes(key[:8], "little") & (2**63 - 1)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, floats_per_token, generator=generator)


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

    setup_logging(log_level)
    console = Console()
    settings = load_config(producer_config)
    receiver = load_config(consumer_config).for_rank(0)  # the child consumer is one rank
    chunk_keyer = keyer(settings.chunk_size, "demo", "float32")
    floats_per_token = settings.page_bytes // settings.chunk_size // 4
    table = Table(title="lmcache-pd demo: producer process -> consumer process over NIXL")
    for column in ("request", "tokens", "chunks sent", "already held", "MiB sent", "ms", "GB/s"):
        table.add_column(column, justify="right")
    with ConsumerProcess(consumer_config) as child, Producer(settings) as producer:
        for index, tail in enumerate(DEMO_TAIL_TOKENS):
            req_id = f"demo-{index}"
            own = 10**6 * (index + 1)
            tokens = list(range(DEMO_PREFIX_TOKENS)) + list(range(own, own + tail))
            keys = chunk_keyer.chunk_keys(tokens)
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
