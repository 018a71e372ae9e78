"""Images through PD, for real: a prefill and a decode vLLM serving the tiny vision-language
model (``harness/vision_maker.py``, an Idefics3) behind the proxy, against one plain vLLM with the
same flags.

A chat with an image, greedy, streamed and whole, is one vLLM's answer with its KV loaded on
decode. Two chats of the same text and different images (an image's placeholder tokens are the
same for every image, so their token ids are equal): the image changes plain vLLM's answer (the
negative control), and the second, through PD, is still one vLLM's: none of the first's chunks
from the image on stands in for its own (the images are part of the chunk keys). Decode never
runs the vision encoder: the image's KV comes with the prompt's, and only the prompt's last
token is computed there.
"""

from __future__ import annotations

import base64
import io
import random
import re
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
from lmcache_pd.harness.vision_maker import FAKE_IMAGE_TOKEN, IMAGE_TOKENS, ensure_vision_model
from lmcache_pd.metrics_scrape import prompt_tokens_by_source, scrape
from lmcache_pd.proxy.config import ProxyConfig
from tests import conformance
from tests.helpers import free_port, wait_for
from tests.vllm_support import MODEL_DIR, SERVER_ARGS

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
VISION_DIR = MODEL_DIR.parent / "tiny-vlm"
RED, BLUE = (200, 30, 30), (20, 30, 230)
CHUNK = 256  # configs/producer.yaml's chunk_size
# vLLM logs each step's encoder inputs with this flag (and its stats on, as in the pools): how
# the test sees where the vision encoder ran. It changes no answer, so plain vLLM goes without.
ITERATION_DETAILS = "--enable-logging-iteration-details"
ENCODER_RAN = re.compile(r"encoder inputs: (\d+)")


@pytest.fixture(scope="module")
def vision_model() -> Path:
    return ensure_vision_model(VISION_DIR)


@pytest.fixture(scope="module")
def served(
    vision_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ProxyConfig, VLLMServer, Path]]:
    """The proxy's config in front of 1P1D serving the vision model, a plain vLLM of it, started
    together, and the pools' folder (their logs)."""
    folder = tmp_path_factory.mktemp("vision-pools")
    plain = VLLMServer(
        vision_model, free_port(), folder / "plain.log", cpu=0, extra_args=SERVER_ARGS, wait=False
    )
    spec = PoolsConfig(
        model=str(vision_model),
        prefill=[
            InstanceSpec(
                config=str(CONFIGS / "producer.yaml"), cpus="0", vllm_args=[ITERATION_DETAILS]
            )
        ],
        decode=[
            InstanceSpec(
                config=str(CONFIGS / "consumer.yaml"), cpus="1", vllm_args=[ITERATION_DETAILS]
            )
        ],
        proxy=ProxySpec(port=free_port()),
        vllm_args=list(SERVER_ARGS),
    )
    try:
        with PoolLauncher(spec, folder) as launcher:
            config = launcher.start()
            plain.wait_until_healthy()
            patient = msgspec.structs.replace(config.timeouts, health_s=10.0)
            yield msgspec.structs.replace(config, timeouts=patient), plain, folder
    finally:
        plain.stop()


def image_url(colour: tuple[int, int, int]) -> str:
    """A PNG of one colour, as a client sends it: a base64 data URL."""
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(png, "PNG")
    return "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()


def body(model: Path, seed: int, colour: tuple[int, int, int], stream: bool) -> dict[str, Any]:
    """A greedy chat with logprobs: ~300 tokens of text (more than a chunk), the image, ~300
    more; ``seed`` picks the text."""
    words = random.Random(seed).choices(["alpha", "beta", "gamma", "delta", "list"], k=300)
    content = [
        {"type": "text", "text": " ".join(words[:150])},
        {"type": "image_url", "image_url": {"url": image_url(colour)}},
        {"type": "text", "text": " ".join(words[150:])},
    ]
    return {
        "model": str(model),
        "messages": [{"role": "user", "content": content}],
        "max_tokens": conformance.OUTPUT_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "stream": stream,
    }


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def prompt_of(plain: VLLMServer, request: dict[str, Any]) -> list[int]:
    """The prompt's token ids, the image's placeholders expanded (vLLM's ``/tokenize``)."""
    asked = {"model": request["model"], "messages": request["messages"]}
    response = httpx.post(f"{plain.url}/tokenize", json=asked, timeout=60)
    response.raise_for_status()
    return response.json()["tokens"]


def image_offset(model: Path, prompt: list[int]) -> int:
    return around_images(model, prompt)[0]


def around_images(model: Path, prompt: list[int]) -> list[int]:
    """Where the tokens around each image are (Idefics3 puts one before and one after)."""
    from transformers import AutoTokenizer

    fake = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids(FAKE_IMAGE_TOKEN)
    return [at for at, token in enumerate(prompt) if token == fake]


def sources(url: str) -> dict[str, float]:
    return prompt_tokens_by_source(url)


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}


def pushed_since(prefill: str, before: dict[str, float]) -> dict[str, float]:
    """Prefill's counters grown since ``before``, once its next push is counted: a push's
    counters reach its /metrics with the steps after it."""
    wait_for(
        lambda: scrape(prefill).get("pushes", 0) > before.get("pushes", 0),
        timeout_s=10.0,
        what="the push counted",
    )
    return grew(before, scrape(prefill))


def as_plain(
    config: ProxyConfig, proxy: str, plain: VLLMServer, request: dict[str, Any], length: int
) -> tuple[str, float, dict[str, float]]:
    """Ask ``request`` (a prompt of ``length`` tokens) through the proxy at ``proxy`` and of
    plain vLLM: the answers are equal, and decode computed the prompt's last token alone, the
    rest held in its prefix cache or loaded. Returns plain's text, the tokens decode held, and
    what prefill's push counters grew by."""
    decode, prefill = config.decode[0].url, config.prefill[0].url
    before, pushes = sources(decode), scrape(prefill)
    got = conformance.ask(client_of(proxy), request, chat=True)
    moved = grew(before, sources(decode))
    want = conformance.ask(client_of(plain.url), request, chat=True)
    assert not conformance.differences(got, want), conformance.differences(got, want)
    held = moved.get("local_cache_hit", 0)
    assert moved.get("local_compute", 0) == 1, moved
    assert held + moved.get("external_kv_transfer", 0) == length - 1, moved
    return want["choices"][0]["message"]["content"], held, pushed_since(prefill, pushes)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_chat_with_an_image_answers_as_one_vllm_with_its_kv_loaded(
    served: tuple[ProxyConfig, VLLMServer, Path], vision_model: Path, stream: bool
) -> None:
    config, plain, _ = served
    decode = config.decode[0].url
    request = body(vision_model, seed=1 + stream, colour=RED, stream=stream)
    prompt = prompt_of(plain, request)
    before = sources(decode)
    with proxy_thread(config) as proxy:
        got = conformance.ask(client_of(proxy.url), request, chat=True)
    moved = grew(before, sources(decode))
    want = conformance.ask(client_of(plain.url), request, chat=True)
    assert not conformance.differences(got, want), conformance.differences(got, want)
    assert moved.get("external_kv_transfer", 0) >= len(prompt) - 1, moved
    assert moved.get("local_compute", 0) == 1, moved


def test_another_image_changes_the_answer_and_never_shares_a_chunk_from_the_image_on(
    served: tuple[ProxyConfig, VLLMServer, Path], vision_model: Path
) -> None:
    """The same text with a red, then a blue image, through PD. The negative control: plain
    vLLM answers them differently. The blue chat's token ids are the red one's, yet prefill
    pushes every chunk of it from the image on and decode finds none of them landed already
    (none skipped); decode holds at most the shared text before the image (its own prefix
    cache), loads the rest, and answers as plain vLLM."""
    config, plain, _ = served
    red, blue = (body(vision_model, seed=3, colour=c, stream=False) for c in (RED, BLUE))
    prompt = prompt_of(plain, red)
    assert prompt_of(plain, blue) == prompt  # only the images tell them apart
    offset = image_offset(vision_model, prompt)
    assert CHUNK <= offset < 2 * CHUNK - IMAGE_TOKENS
    answers = {}
    with proxy_thread(config) as proxy:
        for name, request in (("red", red), ("blue", blue)):
            answers[name], held, pushed = as_plain(config, proxy.url, plain, request, len(prompt))
            assert pushed.get("chunks_skipped", 0) == 0, (name, pushed)
        # blue: decode held the text before the image (its prefix cache, vLLM's keys), no more
        assert 0 < held <= offset, held
        assert pushed.get("chunks_pushed", 0) == -(-len(prompt) // CHUNK) - held // CHUNK, pushed
    assert answers["red"] != answers["blue"]  # the negative control: the image matters


def test_decode_never_runs_the_vision_encoder(
    served: tuple[ProxyConfig, VLLMServer, Path],
) -> None:
    """After the tests above (images through PD): prefill's steps ran the vision encoder (the
    control: the log shows it), decode's never did. vLLM runs an image's encoder only for a step
    that computes some of its placeholders; decode computes only the prompt's last token."""
    _, _, folder = served

    def encoder_inputs(log: str) -> int:
        text = (folder / log).read_text(errors="replace")
        return sum(int(found) for found in ENCODER_RAN.findall(text))

    assert encoder_inputs("prefill-0.log") >= 2  # once per image: its encoder cache keeps it
    assert encoder_inputs("decode-0.log") == 0


def two_images(model: Path, second: tuple[int, int, int]) -> dict[str, Any]:
    """A greedy chat of ~450 words with a red image after the first 150 and ``second`` after
    the next 150: each image in a chunk of its own."""
    request = body(model, seed=5, colour=RED, stream=False)
    words = random.Random(5).choices(["alpha", "beta", "gamma", "delta", "list"], k=450)
    request["messages"][0]["content"] = [
        {"type": "text", "text": " ".join(words[:150])},
        {"type": "image_url", "image_url": {"url": image_url(RED)}},
        {"type": "text", "text": " ".join(words[150:300])},
        {"type": "image_url", "image_url": {"url": image_url(second)}},
        {"type": "text", "text": " ".join(words[300:])},
    ]
    return request


def test_two_images_answer_as_one_vllm_and_the_second_keys_the_chunks_from_it_on(
    served: tuple[ProxyConfig, VLLMServer, Path], vision_model: Path
) -> None:
    """Two images in one chat, through PD: red then red, then red then blue (the same token
    ids). Each answer is plain vLLM's, from KV decode loaded or held. The negative control: the
    second image changes plain's answer. The second chat shares with the first at most the
    chunks before its second image: prefill skips no chunk from there on."""
    config, plain, _ = served
    same, other = two_images(vision_model, RED), two_images(vision_model, BLUE)
    prompt = prompt_of(plain, same)
    assert prompt_of(plain, other) == prompt
    first, _, second, _ = around_images(vision_model, prompt)
    assert second // CHUNK > first // CHUNK  # in chunks of their own
    answers = {}
    with proxy_thread(config) as proxy:
        for name, request in (("same", same), ("other", other)):
            answers[name], held, pushed = as_plain(config, proxy.url, plain, request, len(prompt))
        assert held <= second, held  # decode's own cache: at most the part before the second
        assert pushed.get("chunks_skipped", 0) <= second // CHUNK, pushed
    assert answers["same"] != answers["other"]  # the negative control: the second image matters
