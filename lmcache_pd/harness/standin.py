"""A stand-in for a vLLM instance, speaking just enough of its OpenAI API for the proxy: for the
proxy's fault tests and its overhead benchmark, where the proxy is what is under test.

Its tokens are a function of the prompt (so answers can be checked), it answers at once or after
set delays, and it can misbehave on demand. It records what it was sent and which streams were
cut by the proxy, so tests can see upstream cancellations.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from lmcache_pd.first_token import FirstTokenNotice, NoticeSender
from lmcache_pd.protocol import NOTICE_KEY

EOS = 2
VOCAB = 1000
# What its answers say they came from: a test can tell its answer passed on from one rebuilt.
FINGERPRINT = "standin"


class Fault(enum.Enum):
    NONE = "none"
    STATUS_500 = "500"  # answer every generation request with an internal error
    STATUS_400 = "400"  # refuse every generation request as a bad one
    HANG = "hang"  # accept, then never answer
    DIE_MID_STREAM = "die_mid_stream"  # cut the connection after a few streamed tokens
    EOS_FIRST = "eos_first"  # the first generated token is EOS


@dataclass
class StandinState:
    """What the stand-in does and what it has seen."""

    fault: Fault = Fault.NONE
    first_delay_s: float = 0.0  # before answering (prefill time)
    token_delay_s: float = 0.0  # between streamed tokens (decode time)
    end_delay_s: float = 0.0  # between [DONE] and the end of the HTTP body
    split_s: float = 0.0  # if set, each streamed event goes in two writes this far apart
    # Send a first-token notice where asked, before ``first_delay_s``, with the token shifted
    # by this much (0: the token it answers; None: send none, as an engine that cannot reach
    # the proxy).
    notice_shift: int | None = None
    received: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    cancelled: int = 0
    in_flight: int = 0
    # Client addresses seen: one per TCP connection, so reuse shows.
    peers: set[tuple[str, int]] = field(default_factory=set)
    # LoRA adapters it lists beside its model (``/v1/models``), loaded at run time too.
    adapters: list[str] = field(default_factory=list)
    refuse_loads: bool = False  # answer a load with vLLM's 500, as a load that failed
    healthy: bool = True  # False: /health answers 503, as a draining or starting vLLM
    max_model_len: int = 4096  # its model's context length, as ``/v1/models`` lists it


def next_token(context: list[int]) -> int:
    """Deterministic 'greedy' token after ``context``, never EOS."""
    return 3 + (sum(context) * 31 + len(context)) % (VOCAB - 3)


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    prompt = body.get("prompt")
    if prompt is None:  # chat: a token per character of the messages' contents
        prompt = "".join(str(m.get("content", "")) for m in body.get("messages", ()))
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
        prompt = prompt[0]
    return [ord(c) % VOCAB for c in prompt] if isinstance(prompt, str) else list(prompt)


def _text(token: int) -> str:
    return f" t{token}"


def _logprobs(tokens: list[int], k: int | None) -> dict[str, Any] | None:
    if k is None:
        return None
    texts = [_text(token) for token in tokens]
    logprobs = [-1.0 - token / VOCAB for token in tokens]
    offsets = [sum(len(text) for text in texts[:index]) for index in range(len(texts))]
    return {
        "tokens": texts,
        "token_logprobs": logprobs,
        "top_logprobs": [{t: lp} if k else None for t, lp in zip(texts, logprobs, strict=True)],
        "text_offset": offsets,
    }


def _answer_id(request: web.Request) -> str:
    """The answer's id as vLLM makes it of the caller's X-Request-Id."""
    prefix = "chatcmpl-" if request.path.endswith("chat/completions") else "cmpl-"
    return prefix + request.headers.get("X-Request-Id", "standin")


def _event(data: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


class Standin:
    """The stand-in's aiohttp app around one ``StandinState``."""

    def __init__(self, state: StandinState | None = None) -> None:
        self.state = state or StandinState()
        self._notices = NoticeSender()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_get("/version", self._version)
        app.router.add_post("/v1/responses", self._responses)
        app.router.add_post("/v1/load_lora_adapter", self._load_adapter)
        app.router.add_post("/v1/unload_lora_adapter", self._unload_adapter)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, _: web.Application) -> None:
        self._notices.close()

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({}, status=200 if self.state.healthy else 503)

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = msgspec.json.decode(await request.read())
        self.state.received.append((time.monotonic(), request.path, body))
        tokens = _prompt_ids(body)
        length = self.state.max_model_len
        return web.json_response({"count": len(tokens), "tokens": tokens, "max_model_len": length})

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """A Responses API answer: its output's text, whole or as vLLM's SSE events."""
        body = await request.json()
        self.state.received.append((time.monotonic(), request.path, body))
        text = "".join(_text(t) for t in self._tokens(body, body.get("max_output_tokens") or 4))
        if not body.get("stream"):
            return web.json_response({"object": "response", "output_text": text})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for kind, data in (("response.output_text.delta", text), ("response.completed", "")):
            event = msgspec.json.encode({"type": kind, "delta": data})
            await response.write(b"event: " + kind.encode() + b"\ndata: " + event + b"\n\n")
        await response.write_eof()
        return response

    async def _version(self, request: web.Request) -> web.Response:
        self.state.received.append((time.monotonic(), request.path, {}))
        return web.json_response({"version": FINGERPRINT})

    async def _models(self, _: web.Request) -> web.Response:
        length = {"max_model_len": self.state.max_model_len}
        adapters = [{"id": name, "parent": "standin", **length} for name in self.state.adapters]
        cards = [{"id": "standin", **length}, *adapters]
        return web.json_response({"object": "list", "data": cards})

    async def _load_adapter(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.state.received.append((time.monotonic(), request.path, body))
        if self.state.refuse_loads:
            error = {"message": "cannot load", "type": "InternalServerError", "code": 500}
            return web.json_response({"error": error}, status=500)
        self.state.adapters.append(body["lora_name"])
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def _unload_adapter(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.state.received.append((time.monotonic(), request.path, body))
        name = body["lora_name"]
        if name not in self.state.adapters:
            message = f"The lora adapter '{name}' cannot be found."
            error = {"message": message, "type": "NotFoundError", "code": 404}
            return web.json_response({"error": error}, status=404)
        self.state.adapters.remove(name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await request.read())
        state = self.state
        state.received.append((time.monotonic(), request.path, body))
        if request.transport is not None:
            state.peers.add(request.transport.get_extra_info("peername"))
        state.in_flight += 1
        try:
            if state.fault is Fault.HANG:
                await asyncio.sleep(3600)
            if state.fault is Fault.STATUS_500:
                return web.json_response({"error": {"message": "boom", "code": 500}}, status=500)
            if state.fault is Fault.STATUS_400:
                error = {"message": "refused by the stand-in", "type": "BadRequestError"}
                return web.json_response({"error": {**error, "code": 400}}, status=400)
            self._notice(body)
            await asyncio.sleep(state.first_delay_s)
            if body.get("stream"):
                return await self._stream(request, body)
            return await self._whole(request, body)
        except asyncio.CancelledError:
            state.cancelled += 1
            raise
        finally:
            state.in_flight -= 1

    def _notice(self, body: dict[str, Any]) -> None:
        params = body.get("kv_transfer_params") or {}
        if self.state.notice_shift is None or NOTICE_KEY not in params:
            return
        prompt = _prompt_ids(body)
        token = self._first_token(prompt) + self.state.notice_shift
        req_id = params["disagg_spec"]["req_id"]
        self._notices.send(params[NOTICE_KEY], FirstTokenNotice(req_id, prompt, token))

    def _first_token(self, prompt: list[int]) -> int:
        return EOS if self.state.fault is Fault.EOS_FIRST else next_token(prompt)

    def _tokens(self, body: dict[str, Any], count: int) -> list[int]:
        """The answer's tokens: its first ones forced where the request names them (as
        decode's logits processor does), each next one continuing the prompt and those before
        it."""
        context = _prompt_ids(body)
        params = body.get("kv_transfer_params") or {}
        forced = params.get("first_tok")
        tokens = [forced] if isinstance(forced, int) else [self._first_token(context)]
        tokens += params.get("next_toks") or []
        if tokens[-1] == EOS:
            return tokens
        while len(tokens) < count:
            tokens.append(next_token(context + tokens))
        return tokens

    async def _whole(self, request: web.Request, body: dict[str, Any]) -> web.Response:
        prompt = _prompt_ids(body)
        tokens = self._tokens(body, body.get("max_tokens") or 16)
        if self.state.fault is Fault.DIE_MID_STREAM and len(tokens) > 2:
            assert request.transport is not None
            request.transport.close()  # as it would cut a stream: mid-answer
            raise asyncio.CancelledError
        await asyncio.sleep(self.state.token_delay_s * len(tokens))
        finish = "stop" if tokens[-1] == EOS else "length"
        ids = body.get("return_token_ids") is True
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": tokens if ids else None,
        }
        text = "".join("" if token == EOS else _text(token) for token in tokens)
        if request.path.endswith("chat/completions"):
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = None
        else:
            choice["text"] = text
            choice["logprobs"] = _logprobs(tokens, body.get("logprobs"))
            choice["prompt_token_ids"] = prompt if ids else None
        params = body.get("kv_transfer_params") or {}
        chat = request.path.endswith("chat/completions")
        return web.json_response(
            {
                "id": _answer_id(request),
                "object": "chat.completion" if chat else "text_completion",
                "model": body.get("model"),
                "choices": [choice],
                "prompt_token_ids": prompt if ids else None,
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(tokens)},
                # A prefill's (asked with params) says its first token; decode's says nothing.
                "kv_transfer_params": None
                if not params or "first_tok" in params
                else {"first_tok": tokens[0]},
                "system_fingerprint": FINGERPRINT,
            }
        )

    async def _stream(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        count = body.get("max_tokens") or 16
        chat = request.path.endswith("chat/completions")
        ids = body.get("return_token_ids") is True
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": _answer_id(request), "object": kind, "model": body.get("model")}
        if chat:
            role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
            await self._write_event(response, _event(head | {"choices": [role]}))
        tokens = self._tokens(body, count)
        for index, token in enumerate(tokens):
            if self.state.fault is Fault.DIE_MID_STREAM and index == 2:
                assert request.transport is not None
                request.transport.close()
                return response
            choice: dict[str, Any] = {"index": 0, "logprobs": None}
            if chat:
                choice["delta"] = {"content": "" if token == EOS else _text(token)}
            else:
                choice["text"] = "" if token == EOS else _text(token)
                choice["logprobs"] = _logprobs([token], body.get("logprobs"))
            last = index == len(tokens) - 1
            choice["finish_reason"] = ("stop" if token == EOS else "length") if last else None
            choice["token_ids"] = [token] if ids else None
            event = head | {"choices": [choice]}
            if last:
                event["system_fingerprint"] = FINGERPRINT
            await self._write_event(response, _event(event))
            if self.state.token_delay_s:
                await asyncio.sleep(self.state.token_delay_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": len(_prompt_ids(body)), "completion_tokens": len(tokens)}
            await response.write(_event(head | {"choices": [], "usage": usage}))
        await response.write(b"data: [DONE]\n\n")
        await asyncio.sleep(self.state.end_delay_s)
        await response.write_eof()
        return response

    async def _write_event(self, response: web.StreamResponse, event: bytes) -> None:
        if not self.state.split_s:
            await response.write(event)
            return
        half = len(event) // 2  # mid-line: the reader sees a partial event first
        await response.write(event[:half])
        await asyncio.sleep(self.state.split_s)
        await response.write(event[half:])
