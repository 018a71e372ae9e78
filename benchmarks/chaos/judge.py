"""Answers judged against one plain vLLM: the prompts, their reference answers (greedy, with
logprobs) and the verdict on an answer."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console

from benchmarks.chaos.pools import CLIENT_TIMEOUT_S
from lmcache_pd.deploy.launcher import unused_port
from lmcache_pd.deploy.pools import PoolsConfig
from lmcache_pd.deploy.vllm_server import VLLMServer

# The end-to-end tests' bound (tests/vllm_support.py): vLLM's own fp32 logprobs move by < 6e-6
# with batch shapes; wrong KV moves them by far more.
LOGPROB_TOLERANCE = 1e-4

Answer = tuple[list[str], list[float]]


@dataclass(frozen=True, slots=True)
class Prompt:
    name: str
    tokens: list[int]
    max_tokens: int
    stream: bool
    # Generate all ``max_tokens`` past an end of sequence (the fleet benchmark's answers must
    # be long enough for an event to land mid-stream); the reference is asked alike.
    ignore_eos: bool = False


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(10, 1500) for _ in range(count)]


def _answer(raw: dict[str, Any]) -> Answer:
    logprobs = raw["choices"][0]["logprobs"]
    return list(logprobs["tokens"]), list(logprobs["token_logprobs"])


def compute_references(
    pools: PoolsConfig,
    prompts: list[Prompt],
    workdir: Path,
    console: Console,
    groups: list[int],
    reference_url: str | None = None,
) -> dict[str, Answer]:
    """Every prompt's answer from one plain vLLM with the pools' model and flags: the one at
    ``reference_url`` if given (already running, e.g. the test suite's), else one started here
    and stopped after."""
    console.print(f"computing {len(prompts)} reference answers on one plain vLLM ...")
    if reference_url is not None:
        return _answers(reference_url, _served_model(reference_url), prompts)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(pools.kv_cache_gib)}
    port, log = unused_port(set()), workdir / "reference.log"
    with VLLMServer(
        Path(pools.model),
        port,
        log,
        cpu=0,
        env=env,
        engine_args=pools.engine_args,
        extra_args=pools.vllm_args,
    ) as plain:
        groups.append(plain.pid)
        return _answers(plain.url, plain.model, prompts)


def _served_model(url: str) -> str:
    """The name the vLLM at ``url`` serves its model under."""
    response = httpx.get(f"{url}/v1/models", timeout=CLIENT_TIMEOUT_S)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


def _answers(url: str, model: str, prompts: list[Prompt]) -> dict[str, Answer]:
    def one(prompt: Prompt) -> tuple[str, Answer]:
        body = {"model": model, "prompt": prompt.tokens, "max_tokens": prompt.max_tokens}
        body |= {"temperature": 0, "logprobs": 1, "ignore_eos": prompt.ignore_eos}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=CLIENT_TIMEOUT_S)
        response.raise_for_status()
        return prompt.name, _answer(response.json())

    with ThreadPoolExecutor(4) as pool:
        return dict(pool.map(one, prompts))


def judge(got: Answer, want: Answer) -> tuple[str, str]:
    """("ok", "") or ("wrong", why): same tokens, logprobs within the tolerance."""
    if got[0] == want[0]:
        drift = max((abs(a - b) for a, b in zip(got[1], want[1], strict=True)), default=0.0)
        if drift <= LOGPROB_TOLERANCE:
            return "ok", ""
        return "wrong", f"same tokens, logprobs differ by up to {drift:.2e}"
    if got[0] == want[0][: len(got[0])]:
        return "wrong", f"cut short without an error: {len(got[0])} of {len(want[0])} tokens"
    at = next(i for i, (a, b) in enumerate(zip(got[0], want[0], strict=False)) if a != b)
    return "wrong", f"token {at} differs: {got[0][at]!r} instead of {want[0][at]!r}"
