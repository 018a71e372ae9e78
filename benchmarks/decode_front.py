"""What vLLM's API server adds to decode's first token: the ceiling an engine-client proxy has.

In lmcache-pd, decode's first token for a request costs one step on a prompt whose KV is already
there, plus vLLM's way in (HTTP, its OpenAI server, the hand-off to the engine-core process) and
out (the engine core's output back to the API server process, SSE). The same shape is measured
here on one plain vLLM on decode's core: a prompt of ``PROMPT_TOKENS`` whose first
``PROMPT_TOKENS - 1`` are in its prefix cache, streamed for two tokens, while a background stream
keeps the engine stepping as decode's other requests do. Side ``http`` asks vLLM's OpenAI server
(as the proxy asks decode); side ``engine`` drives the same engine from this process through
vLLM's ``AsyncLLM`` (as a proxy that were decode's engine client would), with no API server
process between. Sides alternate start by start; the client is on decode's core in both, as the
proxy is in ``configs/pools.yaml``.

    .venv/bin/python -m benchmarks.decode_front --rounds 3
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated

import aiohttp
import typer
from rich.console import Console

from benchmarks.common import write_json
from benchmarks.environment import run_environment
from benchmarks.serving import DEFAULT_MODEL, installed_packages
from benchmarks.serving_systems import DECODE_CPUS
from lmcache_pd.affinity import parse_cpus
from lmcache_pd.deploy.launcher import unused_port
from lmcache_pd.deploy.vllm_server import TINY_MODEL_ARGS, VLLMServer, server_env
from lmcache_pd.harness.model_maker import ensure_model

DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "decode-front.json"
PROMPT_TOKENS = 1025  # 1024/32's prompt and its first token, as decode is asked
BACKGROUND_TOKENS = 400  # per background request: it decodes through every probe
PROBE_PAUSE_S = 0.05
SETTLE_TIMEOUT_S = 60.0  # for the background stream's first token

# A stream of ``max_tokens`` for ``prompt``: the perf_counter when asked, and one per token;
# the event, if any, is set at the first token.
Stream = Callable[[list[int], int, asyncio.Event | None], Awaitable[tuple[float, list[float]]]]


def _prompt(multiplier: int, length: int) -> list[int]:
    return [(i * multiplier) % 1000 + 5 for i in range(length)]


async def _probe(stream: Stream, probes: int) -> dict[str, float]:
    """Medians over ``probes`` of the first token's latency and the first-to-second gap (ms),
    with a background request decoding all the while."""
    prompt = _prompt(7919, PROMPT_TOKENS)
    await stream(prompt, 2, None)  # its prefix is cached from here on
    decoding = asyncio.Event()

    async def background() -> None:
        while True:
            await stream(_prompt(104729, 200), BACKGROUND_TOKENS, decoding)

    keep_busy = asyncio.create_task(background())
    try:
        await asyncio.wait_for(decoding.wait(), SETTLE_TIMEOUT_S)
        first, gap = [], []
        for _ in range(probes):
            asked, tokens = await stream(prompt, 2, None)
            first.append((tokens[0] - asked) * 1e3)
            gap.append((tokens[1] - tokens[0]) * 1e3)
            await asyncio.sleep(PROBE_PAUSE_S)
    finally:
        keep_busy.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await keep_busy
    return {"first_token_ms_p50": statistics.median(first), "gap_ms_p50": statistics.median(gap)}


async def _through_http(model: Path, workdir: Path, probes: int) -> dict[str, float]:
    """vLLM's OpenAI server, every process of it on decode's core."""
    port = unused_port(set())
    log = workdir / f"http-{port}.log"
    with VLLMServer(model, port, log, cpu=DECODE_CPUS, process_cpus=DECODE_CPUS) as server:
        async with aiohttp.ClientSession() as session:
            return await _probe(_http_stream(session, server.url, model), probes)


def _http_stream(session: aiohttp.ClientSession, url: str, model: Path) -> Stream:
    async def stream(
        prompt: list[int], max_tokens: int, first: asyncio.Event | None
    ) -> tuple[float, list[float]]:
        body = {
            "model": str(model),
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        asked, tokens = time.perf_counter(), []
        async with session.post(f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.content:
                if line.startswith(b"data:") and b"[DONE]" not in line:
                    tokens.append(time.perf_counter())
                    if first is not None:
                        first.set()
        return asked, tokens

    return stream


async def _through_engine(model: Path, probes: int) -> dict[str, float]:
    """The same engine driven from this process (its engine core in a child, as vLLM does), with
    the engine arguments the server side gets (``TINY_MODEL_ARGS``)."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(model), *TINY_MODEL_ARGS])
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(args))
    count = 0
    try:

        async def stream(
            prompt: list[int], max_tokens: int, first: asyncio.Event | None
        ) -> tuple[float, list[float]]:
            nonlocal count
            count += 1
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=0,
                ignore_eos=True,
                output_kind=RequestOutputKind.DELTA,
            )
            asked, tokens = time.perf_counter(), []
            async for _ in engine.generate({"prompt_token_ids": prompt}, params, f"probe-{count}"):
                tokens.append(time.perf_counter())
                if first is not None:
                    first.set()
            return asked, tokens

        return await _probe(stream, probes)
    finally:
        engine.shutdown()


def main(
    rounds: Annotated[int, typer.Option(min=1, help="starts of each side, alternating")] = 3,
    probes: Annotated[int, typer.Option(min=5, help="probe requests per start")] = 40,
    model_dir: Path = DEFAULT_MODEL,
    output: Path = DEFAULT_OUTPUT,
) -> None:
    logging.basicConfig(level=logging.WARNING)
    console = Console()
    model = ensure_model(model_dir)
    workdir = Path(f"/tmp/lmcache-pd-decode-front-{int(time.time())}")
    workdir.mkdir(parents=True)
    # This process is the client on both sides, and on the engine side it starts the engine:
    # both on decode's core, with the environment the server side gets.
    os.sched_setaffinity(0, parse_cpus(DECODE_CPUS))
    os.environ.update(server_env(cpu=DECODE_CPUS))
    os.environ["VLLM_RPC_BASE_PATH"] = str(workdir)  # the in-process engine's IPC sockets
    sides: dict[str, list[dict[str, float]]] = {"http": [], "engine": []}
    for round_ in range(rounds):
        for side in ("http", "engine") if round_ % 2 == 0 else ("engine", "http"):
            if side == "http":
                result = asyncio.run(_through_http(model, workdir, probes))
            else:
                result = asyncio.run(_through_engine(model, probes))
            sides[side].append(result)
            console.print(f"round {round_} {side}: {result}")
    medians = {
        side: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for side, runs in sides.items()
    }
    saved = medians["http"]["first_token_ms_p50"] - medians["engine"]["first_token_ms_p50"]
    record = run_environment(installed_packages(), None) | {
        "settings": {"rounds": rounds, "probes": probes, "prompt_tokens": PROMPT_TOKENS},
        "sides": sides,
        "medians": medians,
        "engine_over_http_first_token": medians["engine"]["first_token_ms_p50"]
        / medians["http"]["first_token_ms_p50"],
        "api_server_first_token_ms": saved,
    }
    write_json(output, record)
    console.print(f"medians: {medians}")
    console.print(f"vLLM's API server adds {saved:.1f} ms to the first token; wrote {output}")


if __name__ == "__main__":  # vLLM's engine core is a spawned child: it imports this module
    typer.run(main)
