"""LoRA adapters through PD, for real: a prefill and a decode vLLM serving the tiny Llama and an
adapter of it (``harness/lora_maker.py``, ``--lora-modules tuned=...``) behind the proxy, against
one plain vLLM with the same flags.

The same prompt asked of the adapter and of the base model, in both orders: each answer is one
vLLM's, each loaded its KV on decode from its own push (the adapter is part of the chunk keys:
the second request of a pair finds none of the first's chunks to load in its place), and the
adapter changes the answer (the negative control: an adapter's KV loaded for the base model
would show as a wrong answer here).

A second adapter (another seed) loaded at run time, through the proxy and on the plain vLLM
alike (``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` on every instance): listed as vLLM lists it,
answering as one vLLM with its KV loaded on decode, streamed and whole, unlike ``tuned``; then
unloaded alike, after which asking for it gets plain vLLM's status and words.

One adapter name and path holding other files on prefill and on decode (the files replaced
between their loads, as two hosts may hold them): decode loads none of prefill's KV for it (the
digest of the files is in the chunk keys) and computes the prompt.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import openai
import pytest

from lmcache_pd.deploy.launcher import PoolLauncher
from lmcache_pd.deploy.pools import InstanceSpec, PoolsConfig, ProxySpec
from lmcache_pd.deploy.vllm_server import VLLMServer
from lmcache_pd.harness.app_thread import proxy_thread
from lmcache_pd.harness.lora_maker import make_lora
from lmcache_pd.metrics_scrape import prompt_tokens_by_source, scrape
from lmcache_pd.proxy.config import ProxyConfig
from tests import conformance
from tests.helpers import free_port, wait_for
from tests.vllm_support import SERVER_ARGS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
ADAPTER = "tuned"
LATE = "late"  # the adapter loaded at run time
RUNTIME_LORA = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
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
        model,
        free_port(),
        folder / "plain.log",
        cpu=0,
        extra_args=lora_args,
        env=RUNTIME_LORA,
        wait=False,
    )
    spec = PoolsConfig(
        model=str(model),
        prefill=[InstanceSpec(config=str(CONFIGS / "producer.yaml"), cpus="0", env=RUNTIME_LORA)],
        decode=[InstanceSpec(config=str(CONFIGS / "consumer.yaml"), cpus="1", env=RUNTIME_LORA)],
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


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def adapter_call(url: str, path: str, body: dict[str, str]) -> tuple[int, str]:
    """Status and text of a load or unload (``/v1/PATH``), refused or not. Not its content
    type: vLLM's success is plain text with none, which aiohttp (the proxy) names
    ``application/octet-stream``, what RFC 9110 lets a recipient assume of a body with none."""
    try:
        answer = client_of(url).post(path, body=body, cast_to=httpx.Response)
    except openai.APIStatusError as exc:
        answer = exc.response
    return answer.status_code, answer.text


def listing(url: str) -> list[dict[str, Any]]:
    cards = msgspec.json.decode(client_of(url).models.with_raw_response.list().content)["data"]
    return sorted(cards, key=lambda card: card["id"])


def test_an_adapter_loaded_at_run_time_answers_as_one_vllm_and_unloads_alike(
    served: tuple[ProxyConfig, VLLMServer], model: Path, tmp_path: Path
) -> None:
    """Runs last in the module: it leaves ``late`` unloaded, as it found it."""
    config, plain = served
    decode = config.decode[0].url
    load = {"lora_name": LATE, "lora_path": str(make_lora(tmp_path / LATE, model, seed=2))}
    with proxy_thread(config) as proxy:
        loads = [adapter_call(url, "/load_lora_adapter", load) for url in (proxy.url, plain.url)]
        assert loads[0] == loads[1] and loads[0][0] == 200, loads
        assert not conformance.differences(listing(proxy.url), listing(plain.url))
        assert LATE in {card["id"] for card in listing(proxy.url)}
        texts = {}
        for stream in (False, True):
            prompt = [(11 * i + 3 * stream) % 3000 + 20 for i in range(PROMPT_TOKENS)]
            request = {"model": LATE, "prompt": prompt, "stream": stream}
            request |= {"max_tokens": 8, "temperature": 0, "logprobs": 2}
            before = loaded(decode)
            got = conformance.ask(client_of(proxy.url), request, chat=False)
            assert loaded(decode) - before >= PROMPT_TOKENS - 1, f"{stream=}: KV not loaded"
            want = conformance.ask(client_of(plain.url), request, chat=False)
            assert not conformance.differences(got, want), (
                stream,
                conformance.differences(got, want),
            )
            texts[stream] = got
        tuned = ask(plain.url, ADAPTER, prompt)["choices"][0]["text"]
        late = "".join(
            event["choices"][0]["text"] for event in texts[True][:-1] if event["choices"]
        )
        assert late != tuned  # the negative control: the new adapter changes the answer
        unload = {"lora_name": LATE}
        unloads = [
            adapter_call(url, "/unload_lora_adapter", unload) for url in (proxy.url, plain.url)
        ]
        assert unloads[0] == unloads[1] and unloads[0][0] == 200, unloads
        asked = [
            conformance.ask(client_of(url), request, chat=False) for url in (proxy.url, plain.url)
        ]
        assert asked[0] == asked[1] and asked[0]["status"] == 404, asked
        again = [
            adapter_call(url, "/unload_lora_adapter", unload) for url in (proxy.url, plain.url)
        ]
        assert again[0] == again[1] and again[0][0] == 404, again


def test_one_adapter_name_and_path_holding_other_files_on_prefill_and_decode_shares_no_kv(
    served: tuple[ProxyConfig, VLLMServer], model: Path, tmp_path: Path
) -> None:
    """The files are replaced between prefill's load and decode's, each instance asked once
    (its first request reads the files' digest). Prefill pushes the prompt's KV, and decode,
    whose keys name other files, loads none of it (by name and path alone it loaded it all: a
    wrong answer, status 200). The control: the first test, where the same files share it."""
    config, _ = served
    prefill, decode = config.prefill[0].url, config.decode[0].url
    headers, folder = config.instance_headers(), tmp_path / "swapped"
    load = {"lora_name": "swapped", "lora_path": str(folder)}
    first = {"model": "swapped", "prompt": [1, 2, 3], "max_tokens": 1}
    try:
        for url, seed in ((prefill, 3), (decode, 4)):
            make_lora(folder, model, seed=seed)
            for path, body in (("/v1/load_lora_adapter", load), ("/v1/completions", first)):
                answer = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=60)
                assert answer.status_code == 200, (url, path, answer.text)
        prompt = [(13 * i + 5) % 3000 + 20 for i in range(PROMPT_TOKENS)]
        pushed, held = scrape(prefill), scrape(decode)
        with proxy_thread(config) as proxy:
            assert ask(proxy.url, "swapped", prompt)["choices"][0]["finish_reason"] == "length"
        wait_for(lambda: scrape(prefill).get("pushes", 0) > pushed.get("pushes", 0), 10.0)
        wait_for(
            lambda: scrape(decode).get("loads_failed", 0) > held.get("loads_failed", 0),
            10.0,
            what="decode's load found none of prefill's chunks under its keys",
            explain=lambda: {k: v - held.get(k, 0) for k, v in scrape(decode).items()},
        )
        assert scrape(decode).get("tokens_loaded", 0) == held.get("tokens_loaded", 0)
    finally:
        for url in (prefill, decode):
            unload = {"lora_name": "swapped"}
            httpx.post(f"{url}/v1/unload_lora_adapter", json=unload, headers=headers, timeout=60)
