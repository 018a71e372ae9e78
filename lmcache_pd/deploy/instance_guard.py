"""What a vLLM instance started behind the proxy answers without its key: ``/health`` and
``/metrics`` only.

vLLM's own ``--api-key`` (``VLLM_API_KEY``) guards the paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere``, and leaves others open that reach the engine: ``/invocations``
(SageMaker's route, always served) runs a completion or chat request, ``kv_transfer_params``
and all. This ASGI middleware, loaded into vLLM's API server by ``--middleware``, asks for the
same key on every path but those two (and CORS preflights, which run no handler). It reads the
key from ``VLLM_API_KEY`` when vLLM builds its app; with none set it lets everything through.
Plain ASGI: nothing of vLLM or Starlette is imported.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

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
    ``Authorization: Bearer $VLLM_API_KEY``."""

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
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": POLICY_VIOLATION})
            return
        body = b'{"error": {"message": "Unauthorized", "type": "AuthenticationError", "code": 401}}'
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: Scope) -> bool:
        header = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        assert self._key is not None
        return self._key.admits(header.decode("latin-1"))
