"""A request whose prompt is too short to be worth a transfer, served whole by one decode
instance (selective disaggregation): the client's own request goes to decode unchanged, and its
answer comes back as decode wrote it, streamed or whole. No KV moves, so nothing is pushed,
claimed or dropped; the first token comes from decode.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from lmcache_pd.proxy.client_request import ClientRequest
from lmcache_pd.proxy.flow import Disaggregator, UpstreamFailed, UpstreamRejected
from lmcache_pd.proxy.metrics import Outcome, ProxyMetrics
from lmcache_pd.proxy.responses import (
    SSE_HEADERS,
    ClientGone,
    close_after_done,
    error_body,
    error_response,
    sse,
    write,
)
from lmcache_pd.proxy.routing import Upstream

logger = logging.getLogger(__name__)


async def serve_alone(
    http: web.Request,
    flow: Disaggregator,
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
    try:
        if not client.stream:
            [body] = [
                data
                async for events in flow.relay(member, client, req_id, client.body)
                for data in events
            ]
            metrics.ttft.observe(time.perf_counter() - started)
            trace["first_sent"] = time.time()
            return web.Response(body=body, content_type="application/json"), Outcome.OK
        last = started
        async for events in flow.relay(member, client, req_id, client.body):
            now = time.perf_counter()
            if response is None:
                computed()
                trace["first_sent"] = time.time()
                metrics.ttft.observe(now - started)
                response = web.StreamResponse(headers=SSE_HEADERS)
                await response.prepare(http)
            else:
                metrics.itl.observe(now - last)
            last = now
            await write(response, b"".join(sse(data) for data in events))
        assert response is not None  # alone() yields [DONE] at least, or raises
        await close_after_done(response)
        return response, Outcome.OK
    except UpstreamRejected as exc:  # only before anything was sent
        rejected = web.Response(body=exc.body, status=exc.status, content_type="application/json")
        return rejected, Outcome.UPSTREAM_REJECTED
    except UpstreamFailed as exc:
        metrics.upstream_error(exc.member, exc.kind)
        logger.error("req %s: decode failed serving it alone: %s", req_id, exc)
        message = exc.client_message(req_id)
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
