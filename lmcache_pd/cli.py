"""The ``lmcache-pd`` command: run a consumer rank, or the transfer demo."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from pathlib import Path
from typing import Annotated

import torch
import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.table import Table

from lmcache_pd.config import load_config
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.vllm_server import VLLMServer

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


def _fake_kv(key: bytes, tokens: int, floats_per_token: int) -> torch.Tensor:
    """Stand-in KV for the demo, a function of the chunk key as real KV is of its prefix."""
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
    from lmcache_pd.consumer import Consumer

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
def demo(
    model_dir: Annotated[Path, typer.Option(help="built on first use")] = Path(".cache/tiny-llama"),
    prompt: str = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    max_tokens: int = 24,
    log_level: str = "warning",
) -> None:
    """The smallest real disaggregation: a producer vLLM prefills one prompt and pushes its KV,
    a consumer vLLM loads it and decodes; prints the answer and what moved."""
    import tempfile

    import yaml

    from lmcache_pd.model_maker import ensure_model

    _setup_logging(log_level)
    console = Console()
    model = ensure_model(model_dir)
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-pd-demo-"))
    consumer_settings = load_config(CONFIGS / "consumer.yaml")
    transfer = {}
    for role, name in (("kv_producer", "producer"), ("kv_consumer", "consumer")):
        settings = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
        settings["stats_path"] = str(workdir / f"{name}.stats.json")
        (workdir / f"{name}.yaml").write_text(yaml.safe_dump(settings))
        transfer[role] = {
            "kv_connector": "LMCachePDConnector",
            "kv_connector_module_path": "lmcache_pd.connector",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config_path": str(workdir / f"{name}.yaml")},
        }
    console.print(f"starting a producer and a consumer vLLM (logs in {workdir}) ...")
    with (
        VLLMServer(
            model,
            8100,
            workdir / "producer.log",
            kv_transfer_config=transfer["kv_producer"],
            cpu=0,
            wait=False,
        ) as producer,
        VLLMServer(
            model,
            8200,
            workdir / "consumer.log",
            kv_transfer_config=transfer["kv_consumer"],
            cpu=1,
            wait=False,
        ) as consumer,
    ):
        producer.wait_until_healthy()
        consumer.wait_until_healthy()
        tokens = producer.post("/tokenize", {"model": str(model), "prompt": prompt})["tokens"]
        receiver = {
            "receiver_host": consumer_settings.receiver_host,
            "receiver_init_port": consumer_settings.init_port,
            "receiver_alloc_port": consumer_settings.alloc_port,
        }
        # The first request of each instance pays one-off costs (kernels, handshake): not shown.
        _disaggregate(producer, consumer, model, tokens[::-1], {"req_id": "warm-up", **receiver}, 2)
        counters = [_read_counters(workdir)]
        answer, timings = _disaggregate(
            producer, consumer, model, tokens, {"req_id": "demo-1", **receiver}, max_tokens
        )
        counters.append(_read_counters(workdir))
        pushed, loaded = (
            {name: after[name] - before[name] for name in after}
            for before, after in zip(*counters, strict=True)
        )
    console.print(f"[bold]prompt[/bold] ({len(tokens)} tokens): {prompt!r}")
    console.print(f"[bold]answer[/bold]: {answer!r}")
    console.print(
        f"first token from the producer after {1e3 * timings[0]:.0f} ms; "
        f"the consumer loaded the KV and decoded the rest in {1e3 * timings[1]:.0f} ms"
    )
    console.print(
        f"producer pushed {pushed['chunks_pushed']} chunks ({pushed['bytes_pushed'] / 2**20:.2f}"
        f" MiB) in {pushed['pushes']} pushes; consumer loaded {loaded['tokens_loaded']} prompt "
        f"tokens instead of computing them ({loaded['loads_failed']} loads failed, "
        f"{loaded['integrity_failures']} bad chunks)"
    )


def _read_counters(workdir: Path) -> tuple[dict[str, int], dict[str, int]]:
    """The producer's and the consumer's connector counters (their workers write them)."""
    return tuple(
        json.loads((workdir / f"{side}.stats.json").read_text())
        for side in ("producer", "consumer")
    )


def _disaggregate(
    producer: VLLMServer,
    consumer: VLLMServer,
    model: Path,
    tokens: list[int],
    spec: dict[str, object],
    max_tokens: int,
) -> tuple[str, tuple[float, float]]:
    """What the proxy will do: prefill one token on the producer, which pushes the prompt's KV
    to the consumer named in ``spec``; then decode the rest there. Returns the text and the
    seconds of both steps."""
    request = {"model": str(model), "temperature": 0}
    started = time.monotonic()
    first = producer.complete(
        {
            **request,
            "prompt": tokens,
            "max_tokens": 1,
            "kv_transfer_params": {"ret_first_tok": True, "disagg_spec": spec},
        }
    )
    prefilled = time.monotonic()
    rest = consumer.complete(
        {
            **request,
            "prompt": [*tokens, first["kv_transfer_params"]["first_tok"]],
            "max_tokens": max_tokens - 1,
            "kv_transfer_params": {"disagg_spec": spec},
        }
    )
    text = first["choices"][0]["text"] + rest["choices"][0]["text"]
    return text, (prefilled - started, time.monotonic() - prefilled)


@app.command("transfer-demo")
def transfer_demo(
    producer_config: Annotated[Path, typer.Option()] = CONFIGS / "producer.yaml",
    consumer_config: Annotated[Path, typer.Option()] = CONFIGS / "consumer.yaml",
    ceiling: Annotated[bool, typer.Option(help="also measure raw NIXL and memcpy")] = True,
    log_level: str = "warning",
) -> None:
    """Push a few requests' chunks from this process into a consumer process, check every byte,
    and print what moved, how fast, and how that compares with raw NIXL."""
    from lmcache_pd.consumer import checksum
    from lmcache_pd.consumer_process import ConsumerProcess
    from lmcache_pd.producer import Producer
    from lmcache_pd.protocol import DisaggSpec

    _setup_logging(log_level)
    console = Console()
    settings = load_config(producer_config)
    receiver = load_config(consumer_config)
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
    if ceiling:
        from lmcache_pd.benchmarks.transfer import print_table, run_benchmark

        console.print("measuring the same pages with raw NIXL and memcpy in the same run ...")
        print_table(run_benchmark([settings.page_bytes], [16, 64], runs=3), console)


@app.command("make-model")
def make_model_command(
    directory: Annotated[Path, typer.Argument(help="the Hugging Face folder to write")],
    seed: Annotated[int, typer.Option(help="seeds the random weights")] = 0,
    force: Annotated[bool, typer.Option(help="rebuild even if this build is there")] = False,
) -> None:
    """Write the tiny random Llama that vLLM serves offline here, and print its folder.

    A folder already holding this seed's build is kept unless --force."""
    from lmcache_pd.model_maker import ensure_model, make_model

    _setup_logging("info")
    built = make_model(directory, seed=seed) if force else ensure_model(directory, seed=seed)
    typer.echo(built)
