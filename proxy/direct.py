"""A request served whole by one decode instance: a prompt too short to be worth a transfer
(selective disaggregation), or a request with a field that decode serves alone
(``client_request.ALONE_FIELDS``). The client's own request goes to decode, and its answer comes
back as vLLM wrote it, streamed or whole. No KV moves, so nothing is pushed, claimed or dropped;
the first token comes from decode. Where decode fails under it, it goes on on another
(``migration.py``): a short prompt's stream from where the client is, a request served alone for
a field only before its first event (its answer is passed on unread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from lmcache_pd.proxy.client_request import ClientRequest
from lmcache_pd.proxy.continuation import (
    CannotContinue,
    DecodeRelay,
    FirstTokenMismatch,
    continued_answer,
)
from lmcache_pd.proxy.decode_stream import DecodeStream
from lmcache_pd.proxy.flow import Disaggregator, UpstreamFailed, UpstreamRejected
from lmcache_pd.proxy.metrics import Outcome, ProxyMetrics
from lmcache_pd.proxy.migration import Migrations
from lmcache_pd.proxy.responses import (
    ClientGone,
    OpenStream,
    close_after_done,
    error_body,
    error_response,
    sse,
    write,
)
from lmcache_pd.proxy.routing import Upstream

logger = logging.getLogger(__name__)


class _Unread:
    """What the client has of a stream passed on unread: anything or nothing."""

    def __init__(self) -> None:
        self.started = False

    def relay(self, data: bytes) -> bytes | None:
        if data == b"[DONE]":
            return None
        self.started = True
        return data

    def resume(self) -> tuple[int, ...]:
        if self.started:
            raise CannotContinue("its events were passed on unread")
        return ()


async def serve_alone(
    open_stream: OpenStream,
    flow: Disaggregator,
    migrations: Migrations,
    metrics: ProxyMetrics,
    client: ClientRequest,
    req_id: str,
    member: Upstream,
    started: float,
    trace: dict[str, Any],
    computed: Callable[[], None],
) -> tuple[web.StreamResponse, Outcome]:
    """Answer ``client`` from ``member`` alone. ``started`` is the request's arrival
    (``perf_counter``); ``trace`` gets the decode instance and its first event's time;
    ``computed`` is called at the first event (the prompt is computed: routing stops counting
    it as queued on ``member``)."""
    trace |= {"route": "alone", "decode": member.url, "decode_sent": time.time()}
    response: web.StreamResponse | None = None
    relay = _Unread() if client.alone_reason is not None else DecodeRelay(client, ())
    stream = DecodeStream(flow, client, member, req_id, None, ())
    decoded = migrations.decoded(client, req_id, stream, relay.resume)
    try:
        if not client.stream:
            [raw] = [data async for events in decoded for data in events]
            body, _ = continued_answer(raw, (), client)  # nothing is forced: no mismatch
            metrics.ttft.observe(time.perf_counter() - started)
            trace["first_sent"] = time.time()
            return web.Response(body=body, content_type="application/json"), Outcome.OK
        last = started
        async for events in decoded:
            out = [data for data in map(relay.relay, events) if data is not None]
            if not out:
                continue
            now = time.perf_counter()
            if response is None:
                computed()
                trace["first_sent"] = time.time()
                metrics.ttft.observe(now - started)
                response = await open_stream()
            else:
                metrics.itl.observe(now - last)
            last = now
            await write(response, b"".join(sse(data) for data in out))
        if response is None:  # decode's stream held nothing but its end
            response = await open_stream()
        await write(response, sse("[DONE]"))
        trace["done_sent"] = time.time()
        await close_after_done(response)
        return response, Outcome.OK
    except UpstreamRejected as exc:  # only before anything was sent
        rejected = web.Response(body=exc.body, status=exc.status, content_type="application/json")
        return rejected, Outcome.UPSTREAM_REJECTED
    except (UpstreamFailed, FirstTokenMismatch) as exc:
        if isinstance(exc, FirstTokenMismatch):
            metrics.first_token_mismatches.inc()
        logger.error("req %s: lost, served alone: %s", req_id, exc)
        message = (
            exc.client_message(req_id)
            if isinstance(exc, UpstreamFailed)
            else f"decode could not continue the answer (req {req_id})"
        )
        if response is None:
            return error_response(message, "BadGateway", 502), Outcome.DECODE_FAILED
        try:
            await write(response, sse(error_body(message, "BadGateway", 502)) + sse("[DONE]"))
        except ClientGone:
            return response, Outcome.CLIENT_DISCONNECTED
        return response, Outcome.DECODE_FAILED
    except ClientGone:
        logger.info("req %s: client disconnected; upstream request cancelled", req_id)
        assert response is not None
        return response, Outcome.CLIENT_DISCONNECTED
    finally:
        await decoded.aclose()
