"""Writing one disaggregated request's answer to its client: vLLM's own answer to its request
(``continuation.py``), prefill's first token at once where a stream can show it alone, then
decode's answer, streamed or whole, with the request's latency metrics and phase times."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from aiohttp import web

from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.proxy.client_request import ClientRequest, Endpoint
from lmcache_pd.proxy.continuation import (
    DecodeRelay,
    FirstTokenMismatch,
    continued_answer,
    first_events,
    first_text,
    shows_first_alone,
    whole_answer,
)
from lmcache_pd.proxy.decode_stream import DecodeStream
from lmcache_pd.proxy.flow import Disaggregator, Prefilled, UpstreamFailed, UpstreamRejected
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


class Answer:
    """Everything after prefill's answer: the first token and decode's answer, to one client."""

    def __init__(
        self,
        flow: Disaggregator,
        migrations: Migrations,
        metrics: ProxyMetrics,
        client: ClientRequest,
        req_id: str,
        prefilled: Prefilled,
        decoder: Upstream | None,
        spec: DisaggSpec | None,
        trace: dict[str, Any],
        started: float,
        early: DecodeStream | None,
    ) -> None:
        """``started`` is the request's arrival (``perf_counter``); ``trace`` holds its phase
        times (wall clock) for the proxy's trace file, from ``arrived`` on. ``early`` is decode's
        answer if it was asked on a notice (and continues ``prefilled``)."""
        self.flow, self.migrations, self.metrics = flow, migrations, metrics
        self.client, self.req_id = client, req_id
        self.prefilled, self.decoder, self.spec = prefilled, decoder, spec
        self.trace, self.started = trace, started
        self.early = early
        # Once true, decode itself releases the request's KV.
        self.decode_asked = early is not None
        # One token may also be all the client wanted (no decoder then).
        self.continues = decoder is not None and prefilled.goes_on
        # vLLM names its answer after the X-Request-Id the proxy sends decode.
        prefix = "cmpl-" if client.endpoint is Endpoint.COMPLETIONS else "chatcmpl-"
        self.response_id = prefix + client.answer_name(req_id)

    async def _decoded(self, resume: Callable[[], tuple[int, ...]]) -> AsyncIterator[list[bytes]]:
        """Decode's events' data (or its whole answer), a list per network read; where decode
        fails under it, going on elsewhere forced through ``resume()``'s tokens
        (``migration.py``)."""
        assert self.decoder is not None and self.spec is not None
        first = (self.prefilled.first_token,)
        stream = self.early or DecodeStream(
            self.flow,
            self.client,
            self.decoder,
            self.req_id,
            self.spec,
            first,
            self.prefilled.prompt_token_ids,
        )
        self.trace |= {"decode": self.decoder.url, "decode_sent": stream.sent_at}
        self.decode_asked = True
        decoded = self.migrations.decoded(self.client, self.req_id, stream, resume)
        async with contextlib.aclosing(decoded):
            async for items in decoded:
                if "decode_first" not in self.trace:  # once, not per token
                    self.trace["decode_first"] = time.time()
                yield items

    def _decode_lost(self, exc: UpstreamFailed) -> None:
        """Decode failed and the answer could not go on elsewhere (``migration.py`` counted
        and logged each failure)."""
        logger.error("req %s: lost after the first token: %s", self.req_id, exc)

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

    def _mismatched(self, exc: FirstTokenMismatch) -> None:
        self.metrics.first_token_mismatches.inc()
        logger.error("req %s: %s (is the forcing logits processor loaded?)", self.req_id, exc)

    def _first_sent(self) -> float:
        now = time.perf_counter()
        self.trace["first_sent"] = time.time()
        self.metrics.ttft.observe(now - self.started)
        return now

    async def stream(self, open_stream: OpenStream) -> tuple[web.StreamResponse, Outcome]:
        """The answer as SSE events: the first token at once where it can go alone, then
        decode's as they come."""
        response = await open_stream()
        try:
            shown = not self.continues or shows_first_alone(self.client, self.prefilled.answer)
            last = None
            if shown:
                events = first_events(
                    self.client, self.prefilled.answer, self.response_id, not self.continues
                )
                await write(response, b"".join(sse(event) for event in events))
                last = self._first_sent()
            outcome = Outcome.OK
            if not self.continues:
                await write(response, sse("[DONE]"))
                self.trace["done_sent"] = time.time()
            else:
                outcome = await self._stream_decoded(response, last, shown)
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

    async def _stream_decoded(
        self, response: web.StreamResponse, last: float | None, shown: bool
    ) -> Outcome:
        """Decode's events, passed on one write per network read (its ``[DONE]`` too); the gaps
        between writes, from ``last`` (the first token's, ``perf_counter``; None: not sent yet)
        on, are the inter-token latencies. A failure ends the stream with an error event."""
        shown_text = first_text(self.prefilled.answer) if shown else None
        relay = DecodeRelay(self.client, (self.prefilled.first_token,), shown_text)
        try:
            async with contextlib.aclosing(self._decoded(relay.resume)) as decoded:
                async for batch in decoded:
                    out = [data for data in map(relay.relay, batch) if data is not None]
                    if not out:
                        continue
                    await write(response, b"".join(sse(data) for data in out))
                    if last is None:
                        last = self._first_sent()
                        continue
                    now = time.perf_counter()
                    self.metrics.itl.observe(now - last)
                    for _ in out[1:]:  # they came in one read and went out together
                        self.metrics.itl.observe(0.0)
                    last = now
            await write(response, sse("[DONE]"))
            self.trace["done_sent"] = time.time()
            return Outcome.OK
        except UpstreamRejected as exc:
            self._decode_refused(exc)
            await write(response, sse(_refusal_event(exc)) + sse("[DONE]"))
            return Outcome.UPSTREAM_REJECTED
        except UpstreamFailed as exc:
            self._decode_lost(exc)
            error = error_body(exc.client_message(self.req_id), "BadGateway", 502)
            await write(response, sse(error) + sse("[DONE]"))
            return Outcome.DECODE_FAILED
        except FirstTokenMismatch as exc:
            self._mismatched(exc)
            message = f"decode could not continue prefill's first token (req {self.req_id})"
            await write(response, sse(error_body(message, "BadGateway", 502)) + sse("[DONE]"))
            return Outcome.DECODE_FAILED

    async def whole(self) -> tuple[web.StreamResponse, Outcome]:
        """The answer as one JSON body, once decode has ended."""
        self.metrics.ttft.observe(time.perf_counter() - self.started)
        if not self.continues:
            self._log_done(Outcome.OK)
            body = whole_answer(self.prefilled.answer, self.client)
            return web.Response(body=body, content_type="application/json"), Outcome.OK
        try:
            first = (self.prefilled.first_token,)  # the client has nothing yet
            async with contextlib.aclosing(self._decoded(lambda: first)) as decoded:
                [raw] = [data async for batch in decoded for data in batch]
            body, mismatch = continued_answer(raw, first, self.client)
        except UpstreamRejected as exc:
            self._decode_refused(exc)
            refused = web.Response(
                body=exc.body, status=exc.status, content_type="application/json"
            )
            return refused, Outcome.UPSTREAM_REJECTED
        except UpstreamFailed as exc:
            self._decode_lost(exc)
            response = error_response(exc.client_message(self.req_id), "BadGateway", 502)
            return response, Outcome.DECODE_FAILED
        except (msgspec.DecodeError, ValueError) as exc:  # one item, and JSON, from vLLM
            assert self.decoder is not None
            self.metrics.upstream_error(self.decoder, "bad_answer")
            self._decode_lost(UpstreamFailed(self.decoder, "bad_answer", repr(exc)))
            response = error_response(
                f"decode's answer was unreadable (req {self.req_id})", "BadGateway", 502
            )
            return response, Outcome.DECODE_FAILED
        if mismatch is not None:  # decode's own answer to the request: exact, but not forced
            self._mismatched(mismatch)
        self._log_done(Outcome.OK)
        return web.Response(body=body, content_type="application/json"), Outcome.OK

    def _log_done(self, outcome: Outcome) -> None:
        logger.debug(
            "req %s: %s, decode %s, %.1f ms",
            self.req_id,
            outcome.value,
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
