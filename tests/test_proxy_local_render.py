"""The proxy renders chats with the model's own template and nothing of the client's: a
template inside ``chat_template_kwargs`` is refused at the door as vLLM refuses it, never run
here, and a render that runs long is bounded by a deadline on threads of its own."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import msgspec
import pytest

from lmcache_pd.harness.model_maker import ensure_model
from lmcache_pd.proxy.client_request import BadRequest, ClientRequest, Endpoint
from lmcache_pd.proxy.local_tokenizer import LocalTokenizer
from lmcache_pd.proxy.prompt_tokens import LOCAL_THREADS, MAX_LOCAL_WAITING, PromptTokens
from tests.vllm_support import MODEL_DIR

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def local() -> LocalTokenizer:
    found = LocalTokenizer.load(str(ensure_model(MODEL_DIR)))
    assert found is not None
    return found


def chat_request(**extra: Any) -> ClientRequest:
    body = msgspec.json.encode({"model": "m", "messages": CHAT} | extra)
    return ClientRequest.from_json(Endpoint.CHAT, body)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"chat_template": "XYZ"}, "untrusted chat template"),
        ({"chat_template": None}, "{'chat_template'}"),
        ({"tokenize": False}, "{'tokenize'}"),
    ],
)
def test_a_template_or_tokenize_inside_chat_template_kwargs_is_refused_as_vllm_does(
    kwargs: dict[str, Any], words: str
) -> None:
    with pytest.raises(BadRequest, match=r"chat_template|unexpected chat template kwargs") as err:
        chat_request(chat_template_kwargs=kwargs)
    assert words in str(err.value) and err.value.status == 400
    chat_request(chat_template_kwargs={"enable_thinking": False})  # control: a template variable


def test_the_proxys_render_never_runs_a_template_of_the_clients(local: LocalTokenizer) -> None:
    """transformers takes ``chat_template`` among the kwargs as the template to run: before,
    this rendered "XYZ". The render's own parameters go to an instance now; variables the model's
    template does not read are dropped, as vLLM drops them."""
    plain = local.chat({"messages": CHAT})
    assert plain is not None
    injected = local.chat({"messages": CHAT, "chat_template_kwargs": {"chat_template": "XYZ"}})
    assert injected is None
    assert local.text("XYZ", False) != plain  # the control: "XYZ" renders otherwise
    for parameter in ("tokenize", "tools", "documents", "return_dict", "conversation"):
        assert local.chat({"messages": CHAT, "chat_template_kwargs": {parameter: 1}}) is None
    assert local.chat({"messages": CHAT, "chat_template_kwargs": {"not_read": "x"}}) == plain


class _SlowTokenizer:
    """A tokenizer whose every render holds its thread until released (the thing under test is
    the wait for it, not the tokenizer)."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.release = threading.Event()

    def apply_chat_template(self, messages: Any, tokenize: bool = True, **_: Any) -> str:
        self.release.wait(30)
        return "x"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1, 2]


def test_a_render_past_its_deadline_routes_by_load_and_holds_no_shared_thread() -> None:
    """Renders that never end hold the proxy's own render threads only: each request waits
    its deadline, is counted and routed by load (None); the event loop's default executor,
    which every other ``to_thread`` of the proxy uses, stays free. Past ``MAX_LOCAL_WAITING``
    renders no more are queued (None at once: an instance's /tokenize; none is given here)."""
    slow = _SlowTokenizer()
    timeouts: list[int] = []
    tokens = PromptTokens(
        None, lambda: [], {}, 0.3, LocalTokenizer(slow), lambda: timeouts.append(1)
    )

    async def run() -> tuple[list[list[int] | None], float, float]:
        started = time.monotonic()
        found = await asyncio.gather(*(tokens.of(chat_request(), "m") for _ in range(8)))
        waited = time.monotonic() - started
        shared = time.monotonic()
        await asyncio.to_thread(lambda: None)  # the default executor is not theirs
        return found, waited, time.monotonic() - shared

    found, waited, shared = asyncio.run(run())
    assert found == [None] * 8 and len(timeouts) == 8
    assert 0.3 <= waited < 2.0 and shared < 0.2
    # Renders not started by their deadline were dropped; the running ones hold their threads.
    # Of the next many, those that fit beside them wait their deadline; the rest are not queued.
    more = asyncio.run(_many(tokens, MAX_LOCAL_WAITING))
    assert more == [None] * MAX_LOCAL_WAITING
    assert len(timeouts) - 8 == MAX_LOCAL_WAITING - LOCAL_THREADS
    slow.release.set()
    tokens.close()


async def _many(tokens: PromptTokens, count: int) -> list[list[int] | None]:
    return list(await asyncio.gather(*(tokens.of(chat_request(), "m") for _ in range(count))))
