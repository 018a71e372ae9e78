"""LoRA adapters through PD, for real: a prefill and a decode vLLM serving the tiny Llama and an
adapter of it (``harness/lora_maker.py``, ``--lora-modules tuned=...``) behind the proxy, against
one plain vLLM with the same flags.

The same prompt asked of the adapter and of the base model, in both orders: each answer is one
vLLM's, each loaded its KV on decode from its own push (the adapter is part of the chunk keys:
the second request of a pair finds none of the first's chunks to load in its place), and the
adapter changes the answer (the negative control: an adapter's KV loaded for the base model
would show as a wrong answer here).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest

from lmcache_pd.deploy.launcher import PoolLauncher
from lmcache_pd.deploy.pools import InstanceSpec, PoolsConfig, ProxySpec
from lmcache_pd.deploy.vllm_server import VLLMServer
from lmcache_pd.harness.app_thread import proxy_thread
from lmcache_pd.harness.lora_maker import make_lora
from lmcache_pd.metrics_scrape import prompt_tokens_by_source
from lmcache_pd.proxy.config import ProxyConfig
from tests import conformance
from tests.helpers import free_port
from tests.vllm_support import SERVER_ARGS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ADAPTER = "tuned"
PROMPT_TOKENS = 400  # over min_disagg_tokens: disaggregated


@pytest.fixture(scope="module")
def lora_args(model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    adapter = make_lora(tmp_path_factory.mktemp("lora") / ADAPTER, model)
    lora = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"{ADAPTER}={adapter}"]
    return [*SERVER_ARGS, *lora]


@pytest.fixture(scope="module")
def served(
    model: Path, lora_args: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ProxyConfig, VLLMServer]]:
    """The proxy's config in front of 1P1D with the adapter, and a plain vLLM with it, started
    together."""
    folder = tmp_path_factory.mktemp("lora-pools")
    plain = VLLMServer(
        model, free_port(), folder / "plain.log", cpu=0, extra_args=lora_args, wait=False
    )
    spec = PoolsConfig(
        model=str(model),
        prefill=[InstanceSpec(config=str(CONFIGS / "producer.yaml"), cpus="0")],
        decode=[InstanceSpec(config=str(CONFIGS / "consumer.yaml"), cpus="1")],
        proxy=ProxySpec(port=free_port()),
        vllm_args=lora_args,
    )
    try:
        with PoolLauncher(spec, folder) as launcher:
            config = launcher.start()
            plain.wait_until_healthy()
            patient = msgspec.structs.replace(config.timeouts, health_s=10.0)
            yield msgspec.structs.replace(config, timeouts=patient), plain
    finally:
        plain.stop()


def ask(url: str, model: str, prompt: list[int]) -> dict[str, Any]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    answer = client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=8, temperature=0, logprobs=2
    )
    return msgspec.json.decode(answer.content)


def loaded(url: str) -> float:
    return prompt_tokens_by_source(url).get("external_kv_transfer", 0.0)


@pytest.mark.parametrize("first", [ADAPTER, "base"], ids=["adapter_then_base", "base_then_adapter"])
def test_an_adapter_and_the_base_model_answer_as_one_vllm_in_either_order(
    served: tuple[ProxyConfig, VLLMServer], model: Path, first: str
) -> None:
    config, plain = served
    names = [ADAPTER, str(model)] if first == ADAPTER else [str(model), ADAPTER]
    prompt = [(7 * i + (first == ADAPTER)) % 3000 + 20 for i in range(PROMPT_TOKENS)]
    decode = config.decode[0].url
    answers = {}
    with proxy_thread(config) as proxy:
        for name in names:
            before = loaded(decode)
            got = ask(proxy.url, name, prompt)
            assert loaded(decode) - before >= PROMPT_TOKENS - 1, f"{name}: KV not loaded"
            want = ask(plain.url, name, prompt)
            differences = conformance.differences(got, want)
            assert not differences, (name, differences)
            answers[name] = got["choices"][0]["text"]
    assert answers[ADAPTER] != answers[str(model)]  # the adapter changes the answer


def test_a_name_nobody_serves_gets_vllms_404(served: tuple[ProxyConfig, VLLMServer]) -> None:
    """vLLM's words (its base model's name among them), its status, its ``param``."""
    config, plain = served
    with proxy_thread(config) as proxy:
        answers = []
        for url in (proxy.url, plain.url):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
            with pytest.raises(openai.NotFoundError) as refused:
                client.completions.create(model="nope", prompt=[1, 2, 3], max_tokens=2)
            answers.append(refused.value.body)
    assert answers[0] == answers[1]
