"""What the proxy writes to its client: JSON answers, OpenAI-shaped errors, and server-sent events
whose writes turn a client that went away into one exception."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


# Opens the stream an answer's events go to, its headers sent: the client's own response, or one
# prompt's part of a batch (``batch.py``).
OpenStream = Callable[[], Awaitable[web.StreamResponse]]


def stream_to(http: web.Request) -> OpenStream:
    """Opens the client's SSE response to ``http``."""

    async def open_stream() -> web.StreamResponse:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(http)
        return response

    return open_stream


class ClientGone(Exception):
    """Writing to the client failed: it disconnected."""


def error_body(message: str, kind: str, status: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's (and vLLM's) error shape; also sent as a stream's last event."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def json_response(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type="application/json"
    )


def error_response(message: str, kind: str, status: int, param: str | None = None) -> web.Response:
    return json_response(error_body(message, kind, status, param), status)


def sse(event: dict[str, Any] | str | bytes) -> bytes:
    """One SSE event: a dict is encoded as JSON, text and bytes are sent as they are."""
    if isinstance(event, dict):
        event = msgspec.json.encode(event)
    elif isinstance(event, str):
        event = event.encode()
    return b"data: " + event + b"\n\n"


async def write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
        raise ClientGone from exc


async def close_after_done(response: web.StreamResponse) -> None:
    """End a stream whose ``[DONE]`` is out: a client that already hung up got its whole answer."""
    with contextlib.suppress(ConnectionError, aiohttp.ClientConnectionResetError):
        await response.write_eof()
