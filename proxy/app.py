"""The proxy's HTTP server: OpenAI endpoints in front of prefill and decode pools.

A request goes to prefill for one token; that token is sent to the client at once (its own SSE
chunk when streaming), and decode is asked for the rest, on the exact prompt token ids plus that
token, as soon as the proxy knows the token: from prefill's engine directly (a first-token notice,
``decode_stream.py``) or from prefill's answer, whichever comes first. The KV may still be on its
way (the consumer waits for it, with its own deadline). A prompt under ``min_disagg_tokens``
goes to a decode instance alone instead (``direct.py``). asyncio end to end: nothing here
blocks the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import zmq
from aiohttp import web

from lmcache_pd.affinity import unpin_this_thread
from lmcache_pd.first_token import FirstTokenNotice, NoticeBoard
from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.proxy.client_request import BadRequest, ClientRequest, Endpoint
from lmcache_pd.proxy.config import ProxyConfig
from lmcache_pd.proxy.decode_stream import DecodeStream
from lmcache_pd.proxy.direct import serve_alone
from lmcache_pd.proxy.flow import (
    MAX_EVENT_BYTES,
    UPSTREAM_KEEPALIVE_S,
    Disaggregator,
    Prefilled,
    UpstreamFailed,
    UpstreamRejected,
)
from lmcache_pd.proxy.kv_drop import KVDropper
from lmcache_pd.proxy.membership import Membership, MemberSource
from lmcache_pd.proxy.metrics import Outcome, ProxyMetrics
from lmcache_pd.proxy.openai_format import Piece, ResponseWriter, Usage, error_body
from lmcache_pd.proxy.prompt_size import PromptSizer
from lmcache_pd.proxy.responses import (
    SSE_HEADERS,
    ClientGone,
    close_after_done,
    error_response,
    json_response,
    sse,
    write,
)
from lmcache_pd.proxy.routing import HealthChecker, NoHealthyInstance, Pool, Role, Upstream
from lmcache_pd.trace import TraceFile

logger = logging.getLogger(__name__)


class Proxy:
    """Owns the pools, the upstream HTTP session, health checks and metrics of one proxy."""

    def __init__(self, config: ProxyConfig, members: MemberSource | None = None) -> None:
        """Serve the pools of ``config``; with ``members``, whatever it says the pools are now
        (a cluster engine that adds, restarts and drains instances)."""
        self.config = config
        self.prefill = Pool(Role.PREFILL, [Upstream(p.url, Role.PREFILL) for p in config.prefill])
        self.decode = Pool(
            Role.DECODE,
            [
                Upstream(d.url, Role.DECODE, (d.receiver_host, d.init_port, d.alloc_port))
                for d in config.decode
            ],
        )
        self.metrics = ProxyMetrics(self._upstreams)
        self._membership = (
            None
            if members is None
            else Membership(
                members,
                {Role.PREFILL: self.prefill, Role.DECODE: self.decode},
                self.metrics.membership_errors.inc,
            )
        )
        self._session: aiohttp.ClientSession | None = None
        self._health: HealthChecker | None = None
        self._flow: Disaggregator | None = None
        self._dropper: KVDropper | None = None
        self._notices: NoticeBoard | None = None
        self._trace = TraceFile(config.trace_path)
        self._sizer = PromptSizer(config.min_disagg_tokens, config.tokenizer)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post(Endpoint.COMPLETIONS.value, self.completions)
        app.router.add_post(Endpoint.CHAT.value, self.chat)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, ttl_dns_cache=None, keepalive_timeout=UPSTREAM_KEEPALIVE_S
            ),
            read_bufsize=MAX_EVENT_BYTES,
            max_line_size=MAX_EVENT_BYTES,
            max_field_size=MAX_EVENT_BYTES,
        )
        if self.config.first_token_notices:
            try:
                self._notices = NoticeBoard(self.config.host)
            except zmq.ZMQError as exc:  # serve anyway: a notice is only a head start
                logger.warning(
                    "no first-token notices (cannot listen on %s): %s", self.config.host, exc
                )
            else:
                self._notices.start()
        self._flow = Disaggregator(
            self._session, self.prefill, self.config.timeouts, self.metrics, self._notices
        )
        self._dropper = KVDropper()
        self._health = HealthChecker(
            self._upstreams,
            lambda: self._session,
            interval_s=self.config.health_interval_s,
            timeout_s=self.config.timeouts.health_s,
        )
        await self._health.check_all()  # start with what is up now, not with assumptions
        self._health.periodic.start()
        if self._membership is not None:
            self._membership.periodic.start()
        logger.info(
            "proxy for %s: prefill %s, decode %s",
            self.config.model,
            [m.url for m in self.prefill.members],
            [m.url for m in self.decode.members],
        )

    def _upstreams(self) -> list[Upstream]:
        return [*self.prefill.members, *self.decode.members]

    async def _stop(self, _: web.Application) -> None:
        if self._membership is not None:
            await self._membership.periodic.stop()
        if self._health is not None:
            await self._health.periodic.stop()
        if self._dropper is not None:
            await self._dropper.close()
        if self._notices is not None:
            await self._notices.close()
        if self._session is not None:
            await self._session.close()

    # ---- small endpoints ----

    async def health(self, _: web.Request) -> web.Response:
        """200 when at least one prefill and one decode instance are up."""
        up = {
            pool.role.value: [m.url for m in pool.members if m.healthy]
            for pool in (self.prefill, self.decode)
        }
        return json_response({"up": up}, 200 if all(up.values()) else 503)

    async def prometheus(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), content_type="text/plain")

    async def models(self, _: web.Request) -> web.Response:
        """Prefill's own model card (vLLM's benchmark client reads the tokenizer from it)."""
        assert self._session is not None
        try:
            member = self.prefill.pick()
            async with self._session.get(
                f"{member.url}/v1/models",
                timeout=aiohttp.ClientTimeout(total=self.config.timeouts.health_s),
            ) as response:
                return web.Response(
                    body=await response.read(),
                    status=response.status,
                    content_type="application/json",
                )
        except (NoHealthyInstance, aiohttp.ClientError, TimeoutError) as exc:
            return error_response(
                f"no prefill instance answered /v1/models: {exc}", "ServiceUnavailable", 503
            )

    # ---- the disaggregated endpoints ----

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, Endpoint.COMPLETIONS)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, Endpoint.CHAT)

    async def _serve(self, http: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        started = time.perf_counter()
        label = endpoint.value
        try:
            client = ClientRequest.parse(
                endpoint, msgspec.json.decode(await http.read()), self.config.model
            )
        except msgspec.DecodeError as exc:
            self.metrics.requests.labels(label, Outcome.BAD_REQUEST.value).inc()
            return error_response(f"malformed JSON body: {exc}", "BadRequestError", 400)
        except BadRequest as exc:
            self.metrics.requests.labels(label, Outcome.BAD_REQUEST.value).inc()
            return error_response(str(exc), exc.kind, exc.status)
        except web.HTTPRequestEntityTooLarge as exc:
            self.metrics.requests.labels(label, Outcome.BAD_REQUEST.value).inc()
            return error_response(exc.text or "request body too large", "BadRequestError", 413)
        req_id = f"pd-{uuid.uuid4().hex}"
        outcome = Outcome.INTERNAL_ERROR
        trace: dict[str, Any] = {"event": "proxy", "req_id": req_id, "arrived": time.time()}
        try:
            response, outcome = await self._disaggregate(http, client, req_id, started, trace)
            return response
        except asyncio.CancelledError:  # the client went away; aiohttp cancels its handler
            outcome = Outcome.CLIENT_DISCONNECTED
            logger.info("req %s: client disconnected; upstream requests cancelled", req_id)
            raise
        except Exception:  # a bug of ours: this request is lost, the proxy keeps serving
            logger.exception("req %s: failed inside the proxy", req_id)
            return error_response(
                f"internal error in the proxy (req {req_id})", "InternalError", 500
            )
        finally:
            self.metrics.requests.labels(label, outcome.value).inc()
            if self._trace.enabled:
                self._trace.write(trace | {"outcome": outcome.value, "done": time.time()})

    async def _disaggregate(
        self,
        http: web.Request,
        client: ClientRequest,
        req_id: str,
        started: float,
        trace: dict[str, Any],
    ) -> tuple[web.StreamResponse, Outcome]:
        assert self._flow is not None
        try:
            decoder = self.decode.pick() if client.needs_decode else None
        except NoHealthyInstance as exc:
            return error_response(str(exc), "ServiceUnavailable", 503), Outcome.NO_INSTANCE
        if decoder is not None and self._sizer.is_short(client):
            self.metrics.served_alone.inc()
            with decoder.busy():
                return await serve_alone(
                    http, self._flow, self.metrics, client, req_id, decoder, started, trace
                )
        spec = None
        if decoder is not None:
            assert decoder.receiver is not None
            host, init_port, alloc_port = decoder.receiver
            spec = DisaggSpec(req_id, host, init_port, alloc_port)
        answer: _Answer | None = None
        outcome = Outcome.INTERNAL_ERROR
        try:
            with decoder.busy() if decoder is not None else contextlib.nullcontext():
                response, outcome, answer = await self._answer(
                    http, client, req_id, decoder, spec, started, trace
                )
                return response, outcome
        except asyncio.CancelledError:  # the client went away: say so in the drop notice
            outcome = Outcome.CLIENT_DISCONNECTED
            raise
        finally:
            # Pushed KV that decode will not load: freed now rather than at its claim timeout
            # (also when the client's cancellation brings us here).
            if spec is not None and not (outcome is Outcome.OK and answer and answer.decode_asked):
                self.metrics.kv_drops.inc()
                assert self._dropper is not None
                self._dropper.drop(spec, f"request ended ({outcome.value}) before decode loaded")

    async def _answer(
        self,
        http: web.Request,
        client: ClientRequest,
        req_id: str,
        decoder: Upstream | None,
        spec: DisaggSpec | None,
        started: float,
        trace: dict[str, Any],
    ) -> tuple[web.StreamResponse, Outcome, _Answer | None]:
        """Prefill for the first token, then the answer (streamed or whole) with decode's rest."""
        assert self._flow is not None
        params: dict[str, Any] = {"ret_first_tok": True}
        if spec is not None:
            params["disagg_spec"] = msgspec.structs.asdict(spec)
        prefill = asyncio.get_running_loop().create_task(self._flow.prefill(client, req_id, params))
        early: DecodeStream | None = None
        answered = False
        try:
            if decoder is not None and spec is not None and self._notices is not None:
                early = await self._decode_on_notice(prefill, client, req_id, decoder, spec, trace)
            prefilled = await prefill
            answered = True
        except NoHealthyInstance as exc:
            return error_response(str(exc), "ServiceUnavailable", 503), Outcome.NO_INSTANCE, None
        except UpstreamRejected as exc:
            response = web.Response(
                body=exc.body, status=exc.status, content_type="application/json"
            )
            return response, Outcome.UPSTREAM_REJECTED, None
        except UpstreamFailed as exc:
            logger.error("req %s: lost before its first token: %s", req_id, exc)
            return error_response(str(exc), "BadGateway", 502), Outcome.PREFILL_FAILED, None
        finally:
            if not answered:  # prefill failed, or the client went away while it ran
                prefill.cancel()
                if early is not None:
                    await early.cancel()
        trace |= {"prefill": prefilled.instance, "prefilled": time.time()}
        if early is not None and not (_goes_on(prefilled) and early.matches(prefilled)):
            # Prefill's answer is what the client sees: decode must continue exactly that.
            outcome = "mismatched" if _goes_on(prefilled) else "unused"
            self.metrics.first_token_notices.labels(outcome).inc()
            if outcome == "mismatched":
                logger.error(
                    "req %s: the first-token notice (token %d) disagrees with prefill's answer "
                    "(token %d); decode is asked again",
                    req_id,
                    early.first_token,
                    prefilled.first_token,
                )
            await early.cancel()
            early = None
        elif early is not None:
            self.metrics.first_token_notices.labels("used").inc()
        prefix = "cmpl-" if client.endpoint is Endpoint.COMPLETIONS else "chatcmpl-"
        writer = ResponseWriter(client.endpoint, client.model, prefix + req_id)
        answer = _Answer(
            self._flow,
            self.metrics,
            client,
            req_id,
            writer,
            prefilled,
            decoder,
            spec,
            trace,
            started,
            early,
        )
        try:
            if client.stream:
                response, outcome = await answer.stream(http)
            else:
                response, outcome = await answer.whole()
        finally:
            if early is not None:  # read by the answer, or left unread if the client went
                await early.cancel()
        return response, outcome, answer

    async def _decode_on_notice(
        self,
        prefill: asyncio.Task[Prefilled],
        client: ClientRequest,
        req_id: str,
        decoder: Upstream,
        spec: DisaggSpec,
        trace: dict[str, Any],
    ) -> DecodeStream | None:
        """Wait for prefill's answer or its engine's first-token notice; on a notice that comes
        first, ask decode now (the answer decides later whether that stream is kept)."""
        assert self._notices is not None and self._flow is not None
        notice = self._notices.expect(spec.req_id)
        try:
            await asyncio.wait((prefill, notice), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._notices.forget(spec.req_id)
        if prefill.done():  # else the wait ended on the notice
            self.metrics.first_token_notices.labels("after_answer").inc()
            return None
        got: FirstTokenNotice = notice.result()
        trace["notice"] = time.time()
        return DecodeStream(
            self._flow, client, decoder, req_id, spec, got.prompt_token_ids, got.token
        )


def _goes_on(prefilled: Prefilled) -> bool:
    """Prefill stopped at its one-token limit: the answer goes on at decode (unless it really
    ended there: EOS, a stop string)."""
    return prefilled.piece.finish_reason == "length"


class _Answer:
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
        self.continues = decoder is not None and _goes_on(prefilled)
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

    async def stream(self, http: web.Request) -> tuple[web.StreamResponse, Outcome]:
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(http)
        try:
            await write(response, sse(self.writer.chunk(self.prefilled.piece)))
            self.trace["first_sent"] = time.time()
            last = time.perf_counter()
            self.metrics.ttft.observe(last - self.started)
            outcome = Outcome.OK
            if self.continues:
                try:
                    async with contextlib.aclosing(self._rest()) as rest:
                        async for pieces in rest:
                            events = b"".join(sse(self.writer.chunk(piece)) for piece in pieces)
                            await write(response, events)
                            now = time.perf_counter()
                            self.metrics.itl.observe(now - last)
                            for _ in pieces[1:]:  # they came in one read and went out together
                                self.metrics.itl.observe(0.0)
                            last = now
                except UpstreamFailed as exc:
                    self._decode_failed(exc)
                    await write(response, sse(error_body(str(exc), "BadGateway", 502)))
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

    async def whole(self) -> tuple[web.StreamResponse, Outcome]:
        pieces: list[Piece] = [self.prefilled.piece]
        self.metrics.ttft.observe(time.perf_counter() - self.started)
        if self.continues:
            try:
                async with contextlib.aclosing(self._rest()) as rest:
                    pieces.extend([piece async for batch in rest for piece in batch])
            except UpstreamFailed as exc:
                self._decode_failed(exc)
                return error_response(str(exc), "BadGateway", 502), Outcome.DECODE_FAILED
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


async def serve(
    config: ProxyConfig,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    members: MemberSource | None = None,
) -> None:
    """Serve until ``stop`` is set (by default: until SIGINT or SIGTERM), calling ``ready`` with
    the base URL once listening.

    A client that disconnects cancels its handler (``handler_cancellation``), which closes both
    upstream connections; vLLM then aborts the request. ``members``: see ``Proxy``."""
    runner = web.AppRunner(Proxy(config, members).app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, config.host, config.port).start()
        if stop is None:
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stop.set)
        if ready is not None:
            ready(f"http://{config.host}:{config.port}")
        await stop.wait()
        logger.info("proxy stopping")
    finally:
        await runner.cleanup()


def run_proxy(
    config: ProxyConfig,
    ready: Callable[[str], None] | None = None,
    members: MemberSource | None = None,
) -> None:
    """``serve`` on a fresh event loop until SIGINT or SIGTERM (uvloop when installed: it comes
    with vLLM), on ``config.cpus`` (the threads it starts inherit them)."""
    if config.cpus is not None:
        unpin_this_thread(config.cpus, "proxy")
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(config, ready, members=members))
    else:
        uvloop.run(serve(config, ready, members=members))
