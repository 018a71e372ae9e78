"""A decode instance lost under load, for real: one prefill and two decode vLLMs behind the
proxy, greedy streams running, decode-0 SIGKILLed (a node lost) once every stream has tokens.
Every stream goes on on the other decode (``proxy/migration.py``): no client sees an error, and
every answer is one plain vLLM's, token for token, logprobs within the end-to-end tolerance.
(The short form of the fleet benchmark's ``sigkill_decode`` event.)"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest

from lmcache_pd.deploy.launcher import PoolLauncher
from lmcache_pd.deploy.pools import InstanceSpec, PoolsConfig, ProxySpec
from lmcache_pd.harness.app_thread import proxy_thread
from lmcache_pd.proxy.config import ProxyConfig
from tests.helpers import free_port, metric_sample, wait_for
from tests.vllm_support import LOGPROB_TOLERANCE, SERVER_ARGS, PlainVLLM

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
STREAMS = 4
TOKENS = 160
PROMPT_TOKENS = 600  # over min_disagg_tokens: disaggregated
TOKENS_BEFORE_KILL = 8
STREAM_WAIT_S = 120.0


@pytest.fixture(scope="module")
def pools(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(launcher, the proxy's config) of one prefill and two decode instances."""
    spec = PoolsConfig(
        model=str(model),
        prefill=[InstanceSpec(config=str(CONFIGS / "producer.yaml"), cpus="0")],
        decode=[InstanceSpec(config=str(CONFIGS / "consumer.yaml"), cpus="1")] * 2,
        proxy=ProxySpec(port=free_port()),
        vllm_args=list(SERVER_ARGS),
    )
    with PoolLauncher(spec, tmp_path_factory.mktemp("fleet")) as launcher:
        config = launcher.start()
        # Two cores for three instances: a slow /health must not mark one down mid-test.
        patient = msgspec.structs.replace(config.timeouts, health_s=10.0)
        yield launcher, msgspec.structs.replace(config, timeouts=patient)


def request(model: str, seed: int) -> dict[str, Any]:
    prompt = [(seed * 7919 + i * 104729) % 4000 + 10 for i in range(PROMPT_TOKENS)]
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": TOKENS,
        "temperature": 0.0,
        "logprobs": 1,
        "extra_body": {"ignore_eos": True},
    }


class StreamReader(threading.Thread):
    """One streamed answer read with the official client: its tokens' texts and logprobs, or
    the error that ended it."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        self.body = body
        self.tokens: list[str] = []
        self.logprobs: list[float] = []
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            for chunk in self.client.completions.create(**self.body, stream=True):
                for choice in chunk.choices:
                    if choice.logprobs is not None:
                        self.tokens += choice.logprobs.tokens or []
                        self.logprobs += choice.logprobs.token_logprobs or []
        except Exception as exc:  # what the client would see
            self.error = exc


def test_a_decode_killed_under_streams_loses_none_of_them(
    pools: tuple[PoolLauncher, ProxyConfig], plain_vllm: PlainVLLM, model: Path
) -> None:
    launcher, config = pools
    bodies = [request(str(model), seed) for seed in range(STREAMS)]
    plain = openai.OpenAI(base_url=f"{plain_vllm.server.url}/v1", api_key="none")
    references = [plain.completions.create(**body).choices[0].logprobs for body in bodies]
    with proxy_thread(config) as proxy:
        readers = [StreamReader(proxy.url, body) for body in bodies]
        for reader in readers:
            reader.start()
        wait_for(
            lambda: all(len(r.tokens) >= TOKENS_BEFORE_KILL for r in readers),
            STREAM_WAIT_S,
            "every stream has its first tokens",
        )
        launcher.signal("decode-0", signal.SIGKILL)
        killed = time.monotonic()
        for reader in readers:
            reader.join(STREAM_WAIT_S)
        migrated = metric_sample(
            proxy.url, "lmcache_pd_proxy_decode_migrations_total", cause="broken"
        )
    assert all(not r.is_alive() for r in readers)
    assert [r.error for r in readers] == [None] * STREAMS
    assert migrated >= 1, "no stream was on the killed decode: the test proved nothing"
    for reader, want in zip(readers, references, strict=True):
        assert reader.tokens == want.tokens
        worst = max(abs(a - b) for a, b in zip(reader.logprobs, want.token_logprobs, strict=True))
        assert worst <= LOGPROB_TOLERANCE, worst
    assert time.monotonic() - killed < STREAM_WAIT_S
