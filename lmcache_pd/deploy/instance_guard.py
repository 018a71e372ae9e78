"""What a vLLM instance started behind the proxy answers without its key: ``/health`` and
``/metrics`` only.

vLLM's own ``--api-key`` (``VLLM_API_KEY``) guards the paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere``, and leaves others open that reach the engine: ``/invocations``
(SageMaker's route, always served) runs a completion or chat request, ``kv_transfer_params``
and all. This ASGI middleware, loaded into vLLM's API server by ``--middleware``, asks for the
same key on every path but those two (and CORS preflights, which run no handler). It reads the
key from ``VLLM_API_KEY`` when vLLM builds its app; with none set it lets everything through.
It also reads the body of each authorized POST before vLLM does and refuses, with 400, one
that no request of ours holds and that would end vLLM's engine or fail in its API server
(``lmcache_pd/request_body.py``); it reads no more than ``MAX_BODY_BYTES`` (413 past it, or
at once where ``Content-Length`` says so). A request to an open path that carries a body is
refused with 413 unread: nobody without the key can make an instance buffer anything (an
endless chunked ``POST /health`` once grew vLLM's API server until it was killed). It counts the
requests it lets through, for the drain on SIGTERM (``instance_drain.py``): then ``/health``
answers 503 saying draining and every other request 503. Plain ASGI: nothing of vLLM or
Starlette is imported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from lmcache_pd import request_body
from lmcache_pd.bearer import BearerKey
from lmcache_pd.deploy.instance_drain import Drain
from lmcache_pd.request_body import MAX_BODY_BYTES

# What ``vllm --middleware`` is given (``vllm_server.vllm_command``).
GUARD_IMPORT_PATH = "lmcache_pd.deploy.instance_guard.InstanceKeyGuard"
KEY_ENV = "VLLM_API_KEY"
# Probes (Kubernetes, the launcher, the proxy's health checks) and scrapers carry no key.
OPEN_PATHS = frozenset({"/health", "/metrics"})
# A WebSocket refused for a policy reason, and one refused by a server going away (RFC 6455).
POLICY_VIOLATION = 1008
GOING_AWAY = 1001
DRAINING_MESSAGE = "draining: this instance is stopping; send the request to another"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class InstanceKeyGuard:
    """Refuses, with 401, every HTTP request to a path outside ``OPEN_PATHS`` that lacks
    ``Authorization: Bearer $VLLM_API_KEY``; with 413 a body on an open path, or one past
    ``MAX_BODY_BYTES``; with 400 a body ``request_body`` refuses; with 503 every request but
    ``/metrics`` once draining."""

    def __init__(self, app: App) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV)
        self._key = BearerKey(key) if key else None
        self.drain = Drain()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            self.drain.listen(scope.get("app"))
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if scope.get("method") == "OPTIONS" or path in OPEN_PATHS:
            if scope["type"] == "http" and _carries_body(scope):
                await _refuse(send, 413, f"{path} takes no request body", "PayloadTooLarge")
            elif path == "/health" and self.drain.draining:
                await _draining(send, self.drain.in_flight)
            else:
                await self.app(scope, receive, send)
            return
        if self._key is not None and not self._authorized(scope):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": POLICY_VIOLATION})
            else:
                await _refuse(send, 401, "Unauthorized", "AuthenticationError")
            return
        if self.drain.draining:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": GOING_AWAY})
            else:
                await _refuse(send, 503, DRAINING_MESSAGE, "ServiceUnavailableError")
            return
        self.drain.enter()
        try:
            if scope["type"] == "http" and scope.get("method") == "POST":
                await self._checked(scope, receive, send)
            else:
                await self.app(scope, receive, send)
        finally:
            self.drain.leave()

    async def _checked(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the whole body, up to ``MAX_BODY_BYTES``; refuse it or hand it to vLLM as one
        message."""
        if _declared_length(scope) > MAX_BODY_BYTES:
            await _refuse_too_large(send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: vLLM sees it so
                await self.app(scope, _replay(message, receive), send)
                return
            body += message.get("body", b"")
            if len(body) > MAX_BODY_BYTES:
                await _refuse_too_large(send)
                return
            if not message.get("more_body", False):
                break
        reason = request_body.refusal(bytes(body))
        if reason is not None:
            await _refuse(send, 400, reason, "BadRequestError")
            return
        whole = {"type": "http.request", "body": bytes(body), "more_body": False}
        await self.app(scope, _replay(whole, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        header = _header(scope, b"authorization") or b""
        assert self._key is not None
        return self._key.admits(header.decode("latin-1"))


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((v for k, v in scope.get("headers", ()) if k.lower() == name), None)


def _declared_length(scope: Scope) -> int:
    """The body's ``Content-Length`` (0 where none is given or it is not a number: the server
    refused a malformed one already)."""
    value = _header(scope, b"content-length")
    return int(value) if value is not None and value.isdigit() else 0


def _carries_body(scope: Scope) -> bool:
    return _declared_length(scope) > 0 or _header(scope, b"transfer-encoding") is not None


async def _refuse_too_large(send: Send) -> None:
    await _refuse(send, 413, f"the body is over {MAX_BODY_BYTES} bytes", "PayloadTooLarge")


def _replay(first: Message, receive: Receive) -> Receive:
    """``first``, then whatever ``receive`` gives."""
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def _draining(send: Send, in_flight: int) -> None:
    """``/health`` while draining: 503 (so routers stop sending), and why."""
    body = json.dumps({"status": "draining", "in_flight": in_flight}).encode()
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _refuse(send: Send, status: int, message: str, kind: str) -> None:
    """An OpenAI-style error answer."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
