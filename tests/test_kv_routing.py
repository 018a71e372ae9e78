"""KV-aware routing for real: one prefill and two decode vLLMs that publish their KV events, a
proxy routing by them and one routing by load alone in front of the same instances, driven over
HTTP with the official ``openai`` client.

What must hold: a conversation's next turn goes to the decode instance that holds its history,
and a short follow-up is served there alone, from its own prefix cache (vLLM's counters say so);
the same turn through the load-routed proxy (the negative control) goes through prefill. A hot
prefix spreads once its instance
is loaded. The index reports its size, and a restarted decode re-enters it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import openai
import pytest

from lmcache_pd.deploy.launcher import PoolLauncher
from lmcache_pd.deploy.pools import InstanceSpec, PoolsConfig, ProxySpec
from lmcache_pd.harness.app_thread import proxy_thread
from lmcache_pd.metrics_scrape import prompt_tokens_by_source
from lmcache_pd.proxy.config import ProxyConfig
from lmcache_pd.proxy.local_tokenizer import LocalTokenizer
from tests.helpers import free_port, metric_sample, wait_for
from tests.vllm_support import SERVER_ARGS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
HEALTH_TIMEOUT_S = 10.0
WORDS = [
    "river", "stone", "cloud", "amber", "quiet", "lantern",
    "orbit", "maple", "violet", "signal", "harbor", "copper",
]  # fmt: skip


def text(seed: int, words: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 5 + i * i) % len(WORDS)] for i in range(words))


@pytest.fixture(scope="module")
def pools(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    """(launcher, the KV-routed proxy's config) of one prefill and two decode instances."""
    spec = PoolsConfig(
        model=str(model),
        prefill=[InstanceSpec(config=str(CONFIGS / "producer.yaml"), cpus="0")],
        decode=[InstanceSpec(config=str(CONFIGS / "consumer.yaml"), cpus="1")] * 2,
        proxy=ProxySpec(port=free_port()),
        vllm_args=list(SERVER_ARGS),
    )
    with PoolLauncher(spec, tmp_path_factory.mktemp("kv-routing")) as launcher:
        config = launcher.start()
        # Two cores for three instances: a slow /health must not mark one down mid-test.
        patient = msgspec.structs.replace(config.timeouts, health_s=HEALTH_TIMEOUT_S)
        yield launcher, msgspec.structs.replace(config, timeouts=patient)


def routed(config: ProxyConfig, routing: str) -> ProxyConfig:
    """The same pools behind a proxy of its own, routing by ``routing``."""
    return msgspec.structs.replace(config, routing=routing, port=free_port())


def chat(url: str, model: str, messages: list[dict[str, str]]) -> str:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    answer = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0
    )
    return answer.choices[0].message.content or ""


def decode_urls(launcher: PoolLauncher) -> list[str]:
    return [server.url for name, server in sorted(launcher.servers.items()) if "decode" in name]


def sources(launcher: PoolLauncher) -> dict[str, dict[str, float]]:
    return {name: prompt_tokens_by_source(s.url) for name, s in launcher.servers.items()}


def delta(after: dict, before: dict, name: str, source: str) -> float:
    return after[name].get(source, 0) - before[name].get(source, 0)


def index_blocks(proxy_url: str, instance: str) -> float:
    return metric_sample(proxy_url, "lmcache_pd_proxy_kv_index_blocks", instance=instance)


def landed_chunks(proxy_url: str, instance: str) -> float:
    return metric_sample(proxy_url, "lmcache_pd_proxy_kv_index_landed_chunks", instance=instance)


def test_a_follow_up_turn_goes_alone_to_the_decode_holding_its_history(pools: tuple) -> None:
    launcher, config = pools
    model = config.model
    messages = [
        {"role": "system", "content": text(1, 300)},
        {"role": "user", "content": text(2, 900)},  # a long first turn: through prefill
    ]
    with proxy_thread(routed(config, "kv")) as kv, proxy_thread(routed(config, "load")) as load:
        indexed = {url: index_blocks(kv.url, url) for url in decode_urls(launcher)}
        before = sources(launcher)
        messages.append({"role": "assistant", "content": chat(kv.url, model, messages)})
        first = sources(launcher)
        # The first turn went through prefill and was pushed to one decode instance.
        holder = max(
            ("decode-0", "decode-1"), key=lambda n: delta(first, before, n, "external_kv_transfer")
        )
        other = "decode-1" if holder == "decode-0" else "decode-0"
        assert delta(first, before, holder, "external_kv_transfer") > 1000
        holder_url = launcher.servers[holder].url
        wait_for(
            lambda: index_blocks(kv.url, holder_url) > indexed[holder_url] + 5,
            10,
            "the holder's new blocks indexed",
        )
        # The chunks pushed to it are published too (its consumer's landed chunks), the full
        # ones of the ~1,200 pushed tokens: a later push of them would be spared.
        wait_for(
            lambda: landed_chunks(kv.url, holder_url) >= 4,
            10,
            "the holder's landed chunks indexed",
        )
        assert landed_chunks(kv.url, launcher.servers[other].url) == 0

        messages.append({"role": "user", "content": text(3, 40)})  # a short follow-up
        alone_before = metric_sample(kv.url, "lmcache_pd_proxy_served_alone_total")
        chat(kv.url, model, messages)
        second = sources(launcher)
        assert metric_sample(kv.url, "lmcache_pd_proxy_served_alone_total") == alone_before + 1
        # The holder served it from its own cache; nothing was computed by prefill or pushed.
        assert delta(second, first, holder, "local_cache_hit") > 1000
        assert delta(second, first, holder, "local_compute") < 256
        assert delta(second, first, "prefill-0", "local_compute") == 0
        assert delta(second, first, other, "external_kv_transfer") == 0

        # The negative control: by load, the prompt's whole length decides, and the same turn
        # goes through prefill.
        chat(load.url, model, messages)
        third = sources(launcher)
        assert delta(third, second, "prefill-0", "local_compute") > 0
        assert metric_sample(load.url, "lmcache_pd_proxy_served_alone_total") == 0


def test_a_hot_prefix_spreads_once_its_instance_is_loaded(pools: tuple) -> None:
    launcher, config = pools
    shared = text(9, 1200)

    async def burst(url: str, count: int) -> None:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        await asyncio.gather(
            *(
                client.completions.create(
                    model=config.model,
                    prompt=f"{shared} {text(20 + i, 30)}",
                    max_tokens=32,
                    temperature=0,
                )
                for i in range(count)
            )
        )

    with proxy_thread(routed(config, "kv")) as kv:
        indexed = sum(index_blocks(kv.url, u) for u in decode_urls(launcher))
        asyncio.run(burst(kv.url, 1))  # the prefix lands on one decode instance
        wait_for(
            lambda: sum(index_blocks(kv.url, u) for u in decode_urls(launcher)) > indexed + 5,
            10,
            "the prefix's blocks indexed",
        )
        before = {u: _finished(u) for u in decode_urls(launcher)}
        asyncio.run(burst(kv.url, 6))
        served = [_finished(u) - before[u] for u in decode_urls(launcher)]
    assert sum(served) == 6
    assert min(served) >= 2, f"requests per decode instance {served}: the hot prefix piled up"


def _finished(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(
        float(line.rpartition(" ")[2])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )


def test_a_restarted_decode_reenters_the_index(pools: tuple) -> None:
    launcher, config = pools

    def fill(url: str, seed: int) -> None:
        """A prompt of full blocks straight to the instance: blocks it stores and announces."""
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=launcher.instance_key, timeout=60)
        client.completions.create(model=config.model, prompt=text(seed, 400), max_tokens=2)

    with proxy_thread(routed(config, "kv")) as kv:
        url = launcher.servers["decode-1"].url
        fill(url, 30)
        wait_for(lambda: index_blocks(kv.url, url) > 0, 10, "decode-1's blocks indexed")
        launcher.restart("decode-1")
        started = time.monotonic()
        fill(url, 31)  # the old blocks went with the old instance; the new one announces its own
        wait_for(
            lambda: (
                metric_sample(
                    kv.url, "lmcache_pd_proxy_kv_index_feed_events_total", what="reconnects"
                )
                >= 1
            ),
            30,
            "the restart noticed",
        )
        wait_for(lambda: index_blocks(kv.url, url) > 0, 10, "the new instance's blocks indexed")
        assert time.monotonic() - started < 30


def test_the_proxys_own_tokenizer_gives_the_token_ids_vllm_serves(pools: tuple) -> None:
    """The proxy tokenizes plain prompts itself (no /tokenize round trip): its ids are the
    instance's, for chats (with and without a generation prompt, a final message continued)
    and for text with and without special tokens."""
    launcher, config = pools
    local = LocalTokenizer.load(config.model)
    assert local is not None
    url = launcher.servers["prefill-0"].url
    headers = {"Authorization": f"Bearer {launcher.instance_key}"}
    messages = [
        {"role": "system", "content": text(3, 40)},
        {"role": "user", "content": "why? " + text(4, 30)},
        {"role": "assistant", "content": " " + text(5, 20)},
        {"role": "user", "content": text(6, 10) + " \u00e9t\u00e9 \u2014 done."},
    ]
    chats = [
        {"messages": messages},
        {"messages": messages, "add_generation_prompt": False},
        {"messages": messages[:3], "add_generation_prompt": False, "continue_final_message": True},
    ]
    for body in chats:
        asked = httpx.post(
            f"{url}/tokenize", json={"model": config.model, **body}, headers=headers, timeout=30
        )
        asked.raise_for_status()
        assert local.chat(body) == asked.json()["tokens"], body
    for special in (True, False):
        prompt = "def f(x):\n    return x  # " + text(7, 12)
        asked = httpx.post(
            f"{url}/tokenize",
            json={"model": config.model, "prompt": prompt, "add_special_tokens": special},
            headers=headers,
            timeout=30,
        )
        asked.raise_for_status()
        assert local.text(prompt, special) == asked.json()["tokens"]
