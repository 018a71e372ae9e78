"""What a vLLM instance started behind the proxy answers without its key: ``/health`` and
``/metrics`` only.

vLLM's own ``--api-key`` (``VLLM_API_KEY``) guards the paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere``, and leaves others open that reach the engine: ``/invocations``
(SageMaker's route, always served) runs a completion or chat request, ``kv_transfer_params``
and all. This ASGI middleware, loaded into vLLM's API server by ``--middleware``, asks for the
same key on every path but those two (and CORS preflights, which run no handler). It reads the
key from ``VLLM_API_KEY`` when vLLM builds its app; with none set it lets everything through.
It also reads each request body before vLLM does and refuses, with 400, one that no request of
ours holds and that would end vLLM's engine or fail in its API server
(``lmcache_pd/request_body.py``). Plain ASGI: nothing of vLLM or Starlette is imported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from lmcache_pd import request_body
from lmcache_pd.bearer import BearerKey

# What ``vllm --middleware`` is given (``vllm_server.vllm_command``).
GUARD_IMPORT_PATH = "lmcache_pd.deploy.instance_guard.InstanceKeyGuard"
KEY_ENV = "VLLM_API_KEY"
# Probes (Kubernetes, the launcher, the proxy's health checks) and scrapers carry no key.
OPEN_PATHS = frozenset({"/health", "/metrics"})
# A WebSocket refused for a policy reason (RFC 6455).
POLICY_VIOLATION = 1008

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]


class InstanceKeyGuard:
    """Refuses, with 401, every HTTP request to a path outside ``OPEN_PATHS`` that lacks
    ``Authorization: Bearer $VLLM_API_KEY``, and with 400 a body ``request_body`` refuses."""

    def __init__(self, app: App) -> None:
        self.app = app
        key = os.environ.get(KEY_ENV)
        self._key = BearerKey(key) if key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            self._key is None
            or scope["type"] not in ("http", "websocket")
            or scope.get("method") == "OPTIONS"
            or scope["path"].removeprefix(scope.get("root_path", "")) in OPEN_PATHS
            or self._authorized(scope)
        ):
            if scope["type"] == "http" and scope.get("method") == "POST":
                await self._checked(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": POLICY_VIOLATION})
            return
        await _refuse(send, 401, "Unauthorized", "AuthenticationError")

    async def _checked(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the whole body, refuse it or hand it to vLLM as one message."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: vLLM sees it so
                await self.app(scope, _replay(message, receive), send)
                return
            body += message.get("body", b"")
            if not message.get("more_body", False):
                break
        reason = request_body.refusal(bytes(body))
        if reason is not None:
            await _refuse(send, 400, reason, "BadRequestError")
            return
        whole = {"type": "http.request", "body": bytes(body), "more_body": False}
        await self.app(scope, _replay(whole, receive), send)

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        assert self._key is not None
        return self._key.admits(header.decode("latin-1"))


def _replay(first: Message, receive: Receive) -> Receive:
    """``first``, then whatever ``receive`` gives."""
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def _refuse(send: Send, status: int, message: str, kind: str) -> None:
    """An OpenAI-style error answer."""
    body = json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()
    headers = [(b"content-type", b"application/json")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
