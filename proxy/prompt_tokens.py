"""A request's prompt as token ids, before any instance is chosen: what KV routing looks up.

A completion given as token ids is its own answer. Anything else (a text, a chat) is tokenized
by the model's own tokenizer here where its files are (``local_tokenizer.py``), else by an
instance (vLLM's ``/tokenize``, which applies the same chat template and special tokens as
serving does), the least busy healthy one: one short call per request, bounded by the health
deadline; a failure means "unknown" and the request is routed by load alone, as before.

Local renders run on a small executor of their own, never the event loop's default one that
every other ``to_thread`` of the proxy shares, and each is awaited for the same deadline: a
render past it (a template that loops long on a client's values) routes its request by load
and is counted. A render cannot be stopped once it runs, so while every thread is taken and
``MAX_LOCAL_WAITING`` renders wait, further prompts go to an instance's ``/tokenize`` instead.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import aiohttp
import msgspec

from lmcache_pd.proxy.client_request import ClientRequest, Endpoint, completion_prompt
from lmcache_pd.proxy.local_tokenizer import LocalTokenizer
from lmcache_pd.proxy.routing import Upstream

logger = logging.getLogger(__name__)

# The fields of a chat request that change its tokens (vLLM's TokenizeChatRequest takes them).
CHAT_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template_kwargs",
)
# Threads that render prompts here: a render takes milliseconds, two keep up with a 2-core host.
LOCAL_THREADS = 2
# Renders submitted and not done past which prompts go to an instance's /tokenize.
MAX_LOCAL_WAITING = 16


class _Tokenized(msgspec.Struct):
    tokens: list[int]


class PromptTokens:
    """Token ids of a request's prompt, from the request or from an instance's tokenizer."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        instances: Callable[[], Iterable[Upstream]],
        headers: dict[str, str],
        timeout_s: float,
        local: LocalTokenizer | None = None,
        timed_out: Callable[[], None] = lambda: None,
    ) -> None:
        """``instances()`` gives the instances that may tokenize now; ``local``: the model's
        tokenizer here, tried first, each render bounded by ``timeout_s``; ``timed_out``
        counts a render that was not."""
        self._local = local
        self._timed_out = timed_out
        self._executor = (
            None if local is None else ThreadPoolExecutor(LOCAL_THREADS, "proxy-tokenizer")
        )
        self._rendering: set[Future[list[int] | None]] = set()
        self._timeout_s = timeout_s
        self._session = session
        self._instances = instances
        self._headers = {"Content-Type": "application/json", **headers}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def of(self, request: ClientRequest, model: str) -> list[int] | None:
        """The prompt's token ids; None if they cannot be had now, or are not what vLLM
        computes: a prompt it truncates (``truncate_prompt_tokens``, from the side
        ``truncation_side`` or its tokenizer's default says), whose blocks the uncut ids would
        misname (decode said to hold blocks of the cut prompt it lacks, prefill told to skip
        them)."""
        body = request.body
        if body.get("truncate_prompt_tokens") is not None:
            return None
        local = self._local
        if request.endpoint is Endpoint.COMPLETIONS:
            prompt = completion_prompt(body["prompt"])
            if isinstance(prompt, list):
                return prompt
            ask: dict[str, Any] = {"model": model, "prompt": prompt}
            if "add_special_tokens" in body:
                ask["add_special_tokens"] = body["add_special_tokens"]
            special = body.get("add_special_tokens", True)
            here = None if local is None else functools.partial(local.text, prompt, special)
        else:
            ask = {"model": model, "messages": body["messages"]}
            ask |= {key: body[key] for key in CHAT_TEMPLATE_FIELDS if key in body}
            here = None if local is None else functools.partial(local.chat, body)
        if here is not None:
            try:
                found = await self._render_here(here)
            except TimeoutError:
                self._timed_out()
                logger.warning(
                    "a %s prompt took over %.1f s to render here: routed by load",
                    request.endpoint.value,
                    self._timeout_s,
                )
                return None
            if found is not None:
                return found
        return await self._ask_instance(ask)

    async def _render_here(self, render: Callable[[], list[int] | None]) -> list[int] | None:
        """``render``'s ids, off the event loop and by the deadline (``TimeoutError``); None
        when it cannot render them, or while too many renders wait."""
        assert self._executor is not None
        self._rendering = {future for future in self._rendering if not future.done()}
        if len(self._rendering) >= MAX_LOCAL_WAITING:
            return None
        future = self._executor.submit(render)
        self._rendering.add(future)
        return await asyncio.wait_for(asyncio.wrap_future(future), self._timeout_s)

    async def _ask_instance(self, ask: dict[str, Any]) -> list[int] | None:
        """The ids the least busy healthy instance's ``/tokenize`` gives for ``ask``."""
        healthy = [member for member in self._instances() if member.healthy]
        if not healthy:
            return None
        member = min(healthy, key=lambda member: member.outstanding)
        try:
            async with self._session.post(
                f"{member.url}/tokenize",
                data=msgspec.json.encode(ask),
                headers=self._headers,
                timeout=self._timeout,
            ) as response:
                raw = await response.read()
                if response.status != 200:
                    status = response.status
                    logger.warning("%s: /tokenize answered %d: %r", member.url, status, raw[:200])
                    return None
            return msgspec.json.decode(raw, type=_Tokenized).tokens
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            logger.warning("%s could not tokenize a prompt: %r", member.url, exc)
            return None

    def close(self) -> None:
        """Stop the local renders' threads (a render running now ends on its own)."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
