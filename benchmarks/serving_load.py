"""The serving benchmark's client side: workloads of token-id prompts, and an asyncio load
generator that streams completions and times every token of every request.

Prompts are random token ids, unique per request (so no prefix cache hides prefill work), except
in a shared-prefix workload, where every prompt starts with the same tokens (so dedup shows), and
in a multi-turn one, where each turn of a conversation resends the whole conversation so far.
Outputs are forced to their full length (``ignore_eos``) at temperature 0.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from lmcache_pd.proxy.flow import UPSTREAM_KEEPALIVE_S

# Token ids drawn for prompts: clear of the tiny model's special tokens, inside its vocabulary.
TOKEN_RANGE = (10, 1500)
REQUEST_TIMEOUT_S = 300.0
WORKLOAD_PATTERN = re.compile(r"^(\d+)/(\d+)(?:@(\d+))?(?:x(\d+))?$")


@dataclass(frozen=True, slots=True)
class Workload:
    """``input_len`` prompt tokens (the first ``shared_prefix`` of them common to all requests)
    and ``output_len`` generated tokens per request; with ``turns`` > 1, conversations whose
    turn ``t`` resends the ``t - 1`` turns before it and adds ``input_len - shared_prefix``
    tokens (the answer it had and the next question); or prompts read from a JSONL file."""

    name: str
    input_len: int
    output_len: int
    shared_prefix: int = 0
    jsonl: Path | None = None
    turns: int = 1

    @classmethod
    def parse(cls, spec: str) -> Workload:
        """``IN/OUT``, ``IN/OUT@PREFIX`` (e.g. ``1500/32@1400``), either with ``xTURNS`` (e.g.
        ``400/32x3``: three-turn chats), or a path to a JSONL file."""
        if (match := WORKLOAD_PATTERN.match(spec)) is None:
            path = Path(spec)
            if not path.is_file():
                raise ValueError(
                    f"workload {spec!r} is neither IN/OUT[@PREFIX][xTURNS] nor a JSONL file"
                )
            return cls(path.stem, 0, 0, jsonl=path)
        input_len, output_len, prefix, turns = (int(g) if g else 0 for g in match.groups())
        if not 0 <= prefix < input_len or output_len < 1:
            raise ValueError(f"workload {spec!r}: need 0 <= PREFIX < IN and OUT >= 1")
        return cls(spec, input_len, output_len, prefix, turns=max(1, turns))

    def prompts(self, count: int, seed: int) -> list[tuple[list[int] | str, int]]:
        """``count`` (prompt, max_tokens) pairs, the same for the same seed. Chats come turn by
        turn: every conversation's first turn, then every second one, and so on."""
        if self.jsonl is not None:
            return _jsonl_prompts(self.jsonl, count)
        generator = random.Random(f"{self.name}:{seed}")

        def tokens(n: int) -> list[int]:
            return [generator.randrange(*TOKEN_RANGE) for _ in range(n)]

        prefix = tokens(self.shared_prefix)
        tail = self.input_len - self.shared_prefix
        talks = [list(prefix) for _ in range(-(-count // self.turns))]
        prompts: list[tuple[list[int] | str, int]] = []
        for _ in range(self.turns):
            for talk in talks:
                talk += tokens(tail)
                prompts.append((list(talk), self.output_len))
        return prompts[:count]


def _jsonl_prompts(path: Path, count: int) -> list[tuple[list[int] | str, int]]:
    """Lines of ``{"prompt": text or token ids, "max_tokens": n}`` (max_tokens defaults to 32)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return [(row["prompt"], int(row.get("max_tokens", 32))) for row in rows[:count]]


@dataclass(slots=True)
class RequestResult:
    """One request as its client saw it (seconds, relative to its own start)."""

    started_at: float  # wall clock
    ttft: float = 0.0
    gaps: list[float] = field(default_factory=list)
    e2e: float = 0.0
    output_tokens: int = 0
    response_id: str = ""
    error: str | None = None


async def _one(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int] | str, max_tokens: int
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult(started_at=time.time())
    started = last = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for line in response.content:
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return result
                result.response_id = result.response_id or event.get("id", "")
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                if event.get("choices"):
                    now = time.perf_counter()
                    if result.ttft == 0.0:
                        result.ttft = now - started
                    else:
                        result.gaps.append(now - last)
                    last = now
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = repr(exc)[:200]
        return result
    result.e2e = time.perf_counter() - started
    if result.ttft == 0.0:
        result.error = "no token"
    return result


async def run_load(
    url: str,
    model: str,
    prompts: Sequence[tuple[list[int] | str, int]],
    *,
    concurrency: int | None,
    rate: float | None,
    seed: int,
    on_done: Callable[[], None] = lambda: None,
) -> list[RequestResult]:
    """Send every prompt: ``concurrency`` at a time, or at Poisson arrivals of ``rate`` per
    second (exactly one of the two)."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give either a concurrency or a rate")
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S, sock_connect=10)
    # Colocated vLLM closes idle connections after 5 s: let go of them first.
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def send(prompt: list[int] | str, max_tokens: int) -> RequestResult:
            result = await _one(session, url, model, prompt, max_tokens)
            on_done()
            return result

        if concurrency is not None:
            slots = asyncio.Semaphore(concurrency)

            async def bounded(prompt: list[int] | str, max_tokens: int) -> RequestResult:
                async with slots:
                    return await send(prompt, max_tokens)

            return list(await asyncio.gather(*(bounded(p, n) for p, n in prompts)))
        assert rate is not None
        arrivals = random.Random(seed)
        tasks = []
        for prompt, max_tokens in prompts:
            tasks.append(asyncio.create_task(send(prompt, max_tokens)))
            await asyncio.sleep(arrivals.expovariate(rate))
        return list(await asyncio.gather(*tasks))


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, float | int]:
    """Percentiles (ms) of TTFT, inter-token gaps, the gap from the first token to the second,
    and end-to-end latency; that first gap over the ITL p50; throughputs."""
    done = [r for r in results if r.error is None]
    summary: dict[str, float | int] = {
        "requests": len(results),
        "failures": len(results) - len(done),
    }
    series = {
        "ttft": [r.ttft for r in done],
        "itl": [gap for r in done for gap in r.gaps],
        "e2e": [r.e2e for r in done],
        # First token to second: in PD, the second comes from decode once the KV has loaded.
        "first_gap": [r.gaps[0] for r in done if r.gaps],
    }
    for name, values in series.items():
        for q in (50, 90, 99):
            summary[f"{name}_ms_p{q}"] = float(np.percentile(values, q)) * 1e3 if values else 0.0
    itl = summary["itl_ms_p50"]
    summary["first_gap_over_itl_p50"] = summary["first_gap_ms_p50"] / itl if itl else 0.0
    summary["output_tok_s"] = sum(r.output_tokens for r in done) / wall_s
    summary["req_s"] = len(done) / wall_s
    return summary


def first_errors(results: Sequence[RequestResult], limit: int = 3) -> list[str]:
    return [r.error for r in results if r.error is not None][:limit]


def as_records(results: Sequence[RequestResult]) -> list[dict[str, Any]]:
    """Per-request raw data for plots."""
    return [
        {
            "id": r.response_id,
            "started_at": r.started_at,
            "ttft_ms": r.ttft * 1e3,
            "gaps_ms": [g * 1e3 for g in r.gaps],
            "e2e_ms": r.e2e * 1e3,
            "error": r.error,
        }
        for r in results
    ]
