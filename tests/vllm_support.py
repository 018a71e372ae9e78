"""What the tests that start real vLLM share: the tiny model's folder, the server arguments,
prompts, request bodies and answers, and the plain vLLM whose answers are the reference.

The fixtures built on these (``model``, ``plain_vllm``) are in tests/conftest.py.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from lmcache_pd.deploy.vllm_server import VLLMServer, worker_leftovers
from lmcache_pd.proxy.config import ProxyConfig
from tests.helpers import free_port, wait_for

MODEL_DIR = Path(__file__).resolve().parents[1] / ".cache" / "tiny-llama"
# Prefill in steps of at most this many tokens, so that long prompts are pushed chunk by chunk
# as prefill goes (the same on every instance, so that all compute alike).
# vLLM 0.32 guides a required or named tool's call only with a tool parser set, and parses
# "auto" ones only with auto tool choice on: pythonic needs no special tokens of the model. A
# random model under a JSON grammar that allows any whitespace writes whitespace to the end.
SERVER_ARGS = (
    "--max-num-batched-tokens",
    "1024",
    "--tool-call-parser",
    "pythonic",
    "--enable-auto-tool-choice",
    "--structured-outputs-config",
    '{"backend": "xgrammar", "disable_any_whitespace": true}',
)
# vLLM's own fp32 results move in the last bits when its step shapes change: one plain instance
# answering the batch below concurrently instead of one by one differed from itself by up to
# 5.5e-6 in logprobs (same tokens), and a prompt recomputed together with its first token (as a
# recompute does) differed from prefill-then-decode by 2.9e-6 (1000 tokens; 0 for 700), measured
# 2026-11-23. Where the consumer's steps cannot have the reference's shapes, logprobs are held to
# this bound instead of bit equality; wrong KV moves them by far more (see the control in
# tests/test_e2e_vllm.py).
LOGPROB_TOLERANCE = 1e-4

Answer = tuple[list[str], list[float]]


def prompt(length: int, seed: int) -> list[int]:
    """``length`` random token ids drawn from ``seed``: prompts of different seeds share no
    whole block, so none is served partly from a prefix cache another prompt filled."""
    generator = random.Random(seed)
    return [generator.randrange(10, 1500) for _ in range(length)]


def body(model: Path, tokens: list[int], max_tokens: int, params: dict | None = None) -> dict:
    """A greedy completion request with logprobs; ``params`` go as ``kv_transfer_params``."""
    request: dict[str, Any] = {
        "model": str(model),
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
    }
    if params is not None:
        request["kv_transfer_params"] = params
    return request


def answer(response: dict) -> Answer:
    """A completion's tokens and their logprobs."""
    logprobs = response["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


def complete(url: str, model: Path, tokens: list[int], max_tokens: int) -> Answer:
    """A greedy completion with logprobs through ``url`` (a proxy or an instance)."""
    response = httpx.post(
        f"{url}/v1/completions", json=body(model, tokens, max_tokens), timeout=120
    )
    response.raise_for_status()
    return answer(response.json())


def assert_close_answer(got: tuple[list, list], want: tuple[list, list], name: str = "") -> None:
    """Same tokens, and logprobs within ``LOGPROB_TOLERANCE``."""
    assert got[0] == want[0], name
    assert got[1] == pytest.approx(want[1], abs=LOGPROB_TOLERANCE, rel=0), name


class PlainVLLM:
    """A vLLM with no KV connector, its inference on ``cpu``: its greedy answers, asked one at a
    time, are the reference. It starts at once; ``server`` waits until it is up, so that a caller
    can start other instances meanwhile."""

    def __init__(
        self,
        model: Path,
        log_path: Path,
        *,
        cpu: int | str = 0,
        extra_args: Sequence[str] = SERVER_ARGS,
    ) -> None:
        self.model = model
        self._server = VLLMServer(
            model,
            free_port(),
            log_path,
            cpu=cpu,
            extra_args=extra_args,
            wait=False,
            env={"VLLM_SERVER_DEV_MODE": "1"},  # its /reset_prefix_cache (see ``answers``)
        )
        self._healthy = False
        self._stopped = False
        # What its workers left while it ran, found when it stops (see ``stop``).
        self.leftovers: list[Path] = []

    @property
    def server(self) -> VLLMServer:
        if not self._healthy:
            self._server.wait_until_healthy()
            self._healthy = True
        return self._server

    def answers(self, prompts: Mapping[str, list[int]], output_tokens: int) -> dict[str, Answer]:
        """Every prompt's answer of ``output_tokens`` tokens, asked in order, one at a time, the
        first from an empty prefix cache. The session's reference serves many modules, and one's
        prompt can be a prefix of another's (the chaos load's shared prefix is
        ``prompt(1024, 1000)``, the end-to-end module's ``len-1000`` its first 1000 tokens):
        served partly from the cache, in steps of other shapes, its logprobs moved in the last
        bits and an exact comparison failed, only in the whole suite."""
        self.forget_prefixes()
        return {
            name: answer(self.server.complete(body(self.model, tokens, output_tokens)))
            for name, tokens in prompts.items()
        }

    def forget_prefixes(self) -> None:
        """Empty its prefix cache (vLLM's own endpoint; it refuses while blocks are in use, as
        for a request that just ended)."""

        def reset() -> bool:
            response = httpx.post(f"{self.server.url}/reset_prefix_cache", timeout=10)
            response.raise_for_status()
            return response.json()["success"]

        wait_for(reset, 30, "the reference vLLM's prefix cache emptied")

    def stop(self) -> None:
        """Stop it, and check that it took its files with it; idempotent. vLLM's IPC sockets
        were in the instance's own runtime_dir and went with it; so did what its workers left
        (their torch.distributed file, which vLLM leaves: kept in ``leftovers``)."""
        if self._stopped:
            return
        self._stopped = True
        if not self._healthy:  # never came up (its start failed or nobody waited): no files
            self._server.stop()
            return
        sockets = list(self._server.runtime_dir.iterdir())
        self.leftovers = [p for p in worker_leftovers(self._server.log_path) if p.exists()]
        self._server.stop()
        assert sockets, "vLLM did not use the instance's runtime_dir"
        assert not self._server.runtime_dir.exists()
        assert self.leftovers, "no worker file found in vLLM's log"
        assert not any(path.exists() for path in self.leftovers)

    def __enter__(self) -> PlainVLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Reference:
    """A plain vLLM's answers to fixed prompts, asked when a test first needs them. Made as the
    plain vLLM starts, before the instances under test, it lets both start together (each
    start is mostly one process importing at a time: alone it leaves the other core idle); with
    ``stop_after`` the plain vLLM stops once it has answered, giving its core and memory back
    before the next instances start."""

    def __init__(
        self,
        plain: PlainVLLM,
        prompts: Mapping[str, list[int]],
        output_tokens: int,
        *,
        stop_after: bool = True,
    ) -> None:
        self._plain = plain
        self._prompts = dict(prompts)
        self._output_tokens = output_tokens
        self._stop_after = stop_after
        self._answers: dict[str, Answer] | None = None

    @property
    def asked(self) -> bool:
        return self._answers is not None

    def __getitem__(self, name: str) -> Answer:
        if self._answers is None:
            try:
                self._answers = self._plain.answers(self._prompts, self._output_tokens)
            finally:
                if self._stop_after:
                    self._plain.stop()
        return self._answers[name]


def proxy_pair(config: ProxyConfig, prefill: int, decode: int) -> ProxyConfig:
    """A proxy of its own (on a free port) in front of one prefill and one decode instance of a
    pool's: the shapes of one pool tested in turn, each instance started once."""
    return msgspec.structs.replace(
        config, prefill=[config.prefill[prefill]], decode=[config.decode[decode]], port=free_port()
    )
