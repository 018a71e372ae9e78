"""Writing one disaggregated request's answer to its client: prefill's first token at once (its
own SSE chunk when streaming), then decode's stream of the rest, streamed or gathered whole, with
the request's latency metrics, usage and phase times."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web

from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.proxy.client_request import ClientRequest
from lmcache_pd.proxy.decode_stream import DecodeStream
from lmcache_pd.proxy.flow import Disaggregator, Prefilled, UpstreamFailed, UpstreamRejected
from lmcache_pd.proxy.metrics import Outcome, ProxyMetrics
from lmcache_pd.proxy.openai_format import Piece, ResponseWriter, Usage, error_body
from lmcache_pd.proxy.responses import (
    SSE_HEADERS,
    ClientGone,
    close_after_done,
    error_response,
    json_response,
    sse,
    write,
)
from lmcache_pd.proxy.routing import Upstream

logger = logging.getLogger(__name__)


def goes_on(prefilled: Prefilled) -> bool:
    """Prefill stopped at its one-token limit: the answer goes on at decode (unless it really
    ended there: EOS, a stop string)."""
    return prefilled.piece.finish_reason == "length"


class Answer:
    """Everything after the first token: send it, then decode's stream, to one client."""

    def __init__(
        self,
        flow: Disaggregator,
        metrics: ProxyMetrics,
        client: ClientRequest,
        req_id: str,
        writer: ResponseWriter,
        prefilled: Prefilled,
        decoder: Upstream | None,
        spec: DisaggSpec | None,
        trace: dict[str, Any],
        started: float,
        early: DecodeStream | None,
    ) -> None:
        """``started`` is the request's arrival (``perf_counter``); ``trace`` holds its phase
        times (wall clock) for the proxy's trace file, from ``arrived`` on. ``early`` is decode's
        stream if it was asked on a notice (and continues ``prefilled``)."""
        self.flow, self.metrics = flow, metrics
        self.client, self.req_id, self.writer = client, req_id, writer
        self.prefilled, self.decoder, self.spec = prefilled, decoder, spec
        self.trace, self.started = trace, started
        self.usage = Usage(prefilled.prompt_tokens, 1)
        self.early = early
        # Once true, decode itself releases the request's KV.
        self.decode_asked = early is not None
        first = prefilled.piece
        # One token may also be all the client wanted (no decoder then).
        self.continues = decoder is not None and goes_on(prefilled)
        if self.continues:
            first.finish_reason = None
            first.stop_reason = None

    async def _rest(self) -> AsyncIterator[list[Piece]]:
        """Decode's pieces, a list per network read (the usage of its tokens is folded into
        ours)."""
        assert self.decoder is not None and self.spec is not None
        stream = self.early or DecodeStream(
            self.flow,
            self.client,
            self.decoder,
            self.req_id,
            self.spec,
            self.prefilled.prompt_token_ids,
            self.prefilled.first_token,
        )
        self.trace |= {"decode": self.decoder.url, "decode_sent": stream.sent_at}
        self.decode_asked = True
        try:
            async for items in stream.batches():
                if "decode_first" not in self.trace:  # once, not per token
                    self.trace["decode_first"] = time.time()
                pieces = []
                for item in items:
                    if isinstance(item, Usage):
                        self.usage.completion_tokens = 1 + item.completion_tokens
                    else:
                        pieces.append(item)
                if pieces:
                    yield pieces
        finally:
            await stream.cancel()

    def _decode_failed(self, exc: UpstreamFailed) -> None:
        self.metrics.upstream_error(exc.member, exc.kind)
        logger.error("req %s: decode failed after the first token: %s", self.req_id, exc)

    def _decode_refused(self, exc: UpstreamRejected) -> None:
        """Decode refused what prefill took (vLLM checks some limits, such as ``max_tokens``
        past the model's length, only where more than one token is asked): the client's
        request, not a fault."""
        logger.info(
            "req %s: decode refused it after the first token (%d): %s",
            self.req_id,
            exc.status,
            exc.body[:300],
        )

    async def stream(self, http: web.Request) -> tuple[web.StreamResponse, Outcome]:
        """The answer as SSE events: the first token at once, then decode's as they come."""
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(http)
        try:
            await write(response, sse(self.writer.chunk(self.prefilled.piece)))
            self.trace["first_sent"] = time.time()
            first_sent = time.perf_counter()
            self.metrics.ttft.observe(first_sent - self.started)
            outcome = Outcome.OK
            if self.continues:
                try:
                    await self._stream_rest(response, first_sent)
                except UpstreamRejected as exc:
                    self._decode_refused(exc)
                    await write(response, sse(_refusal_event(exc)))
                    outcome = Outcome.UPSTREAM_REJECTED
                except UpstreamFailed as exc:
                    self._decode_failed(exc)
                    message = exc.client_message(self.req_id)
                    await write(response, sse(error_body(message, "BadGateway", 502)))
                    outcome = Outcome.DECODE_FAILED
            if self.client.include_usage and outcome is Outcome.OK:
                await write(response, sse(self.writer.usage_chunk(self.usage)))
            await write(response, sse("[DONE]"))
            await close_after_done(response)
        except ClientGone:
            logger.info("req %s: client disconnected; upstream requests cancelled", self.req_id)
            return response, Outcome.CLIENT_DISCONNECTED
        except Exception:  # a bug of ours after the headers went out: end the stream clearly
            logger.exception("req %s: failed inside the proxy while streaming", self.req_id)
            with contextlib.suppress(ClientGone):
                message = f"internal error in the proxy (req {self.req_id})"
                await write(response, sse(error_body(message, "InternalError", 500)))
                await write(response, sse("[DONE]"))
            return response, Outcome.INTERNAL_ERROR
        self._log_done(outcome)
        return response, outcome

    async def _stream_rest(self, response: web.StreamResponse, last: float) -> None:
        """Decode's pieces as SSE events, one write per network read; the gaps between writes,
        from ``last`` (the first token's, ``perf_counter``) on, are the inter-token latencies."""
        async with contextlib.aclosing(self._rest()) as rest:
            async for pieces in rest:
                events = b"".join(sse(self.writer.chunk(piece)) for piece in pieces)
                await write(response, events)
                now = time.perf_counter()
                self.metrics.itl.observe(now - last)
                for _ in pieces[1:]:  # they came in one read and went out together
                    self.metrics.itl.observe(0.0)
                last = now

    async def whole(self) -> tuple[web.StreamResponse, Outcome]:
        """The answer as one JSON body, once decode has ended."""
        pieces: list[Piece] = [self.prefilled.piece]
        self.metrics.ttft.observe(time.perf_counter() - self.started)
        if self.continues:
            try:
                async with contextlib.aclosing(self._rest()) as rest:
                    pieces.extend([piece async for batch in rest for piece in batch])
            except UpstreamRejected as exc:
                self._decode_refused(exc)
                refused = web.Response(
                    body=exc.body, status=exc.status, content_type="application/json"
                )
                return refused, Outcome.UPSTREAM_REJECTED
            except UpstreamFailed as exc:
                self._decode_failed(exc)
                response = error_response(exc.client_message(self.req_id), "BadGateway", 502)
                return response, Outcome.DECODE_FAILED
        self._log_done(Outcome.OK)
        return json_response(self.writer.body(pieces, self.usage)), Outcome.OK

    def _log_done(self, outcome: Outcome) -> None:
        self.trace |= {
            "prompt_tokens": self.usage.prompt_tokens,
            "completion_tokens": self.usage.completion_tokens,
        }
        logger.debug(
            "req %s: %s, %d+%d tokens, decode %s, %.1f ms",
            self.req_id,
            outcome.value,
            self.usage.prompt_tokens,
            self.usage.completion_tokens,
            self.decoder.url if self.continues and self.decoder else "not needed",
            1000 * (time.perf_counter() - self.started),
        )


def _refusal_event(exc: UpstreamRejected) -> dict[str, Any]:
    """A stream's last event for decode's refusal: vLLM's own error body where it is one (an
    ``error`` object), else OpenAI's shape with its status."""
    try:
        body = msgspec.json.decode(exc.body)
    except msgspec.DecodeError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return body
    return error_body(f"decode refused the request ({exc.status})", "BadRequestError", exc.status)
