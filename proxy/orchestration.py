"""One client request's path through the pools, from its body to its answer.

The body is checked at the door; where it goes is ``placement.py``'s: a prompt of which the
chosen decode instance would compute fewer than ``min_disagg_tokens`` goes there alone
(``direct.py``). Any other goes to prefill for one token, and decode is sent the client's own
request, its first output token forced to that one, as soon as the proxy knows the token: from
prefill's engine directly (a first-token notice, ``decode_stream.py``) or from prefill's answer,
whichever comes first. The answer (``answer.py``) sends that token at once where it can go
alone, then decode's answer as vLLM wrote it (``continuation.py``). KV pushed for a request
that decode will not load is dropped at its consumer when the request ends (``kv_drop.py``).
The upstream calls themselves are ``flow.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from lmcache_pd.first_token import FirstTokenNotice, NoticeBoard
from lmcache_pd.protocol import DisaggSpec, KVTransferParams
from lmcache_pd.proxy.answer import Answer
from lmcache_pd.proxy.batch import serve_batch
from lmcache_pd.proxy.client_request import BadRequest, ClientRequest, Endpoint, unknown_model
from lmcache_pd.proxy.decode_stream import DecodeStream
from lmcache_pd.proxy.direct import serve_alone
from lmcache_pd.proxy.flow import Disaggregator, Prefilled, UpstreamFailed, UpstreamRejected
from lmcache_pd.proxy.kv_drop import KVDropper
from lmcache_pd.proxy.metrics import Outcome, ProxyMetrics
from lmcache_pd.proxy.migration import Migrations
from lmcache_pd.proxy.model_length import check_length
from lmcache_pd.proxy.model_names import ModelNames
from lmcache_pd.proxy.placement import Placer, Plan
from lmcache_pd.proxy.responses import OpenStream, error_response, stream_to
from lmcache_pd.proxy.routing import NoHealthyInstance, Upstream
from lmcache_pd.trace import TraceFile

logger = logging.getLogger(__name__)


class Orchestrator:
    """Serves client requests, each on its own from arrival to answer. Holds no request's state;
    uses, and never closes, what the proxy started (the upstream calls, the notice board, the
    KV dropper, the trace file)."""

    def __init__(
        self,
        *,
        names: ModelNames,
        flow: Disaggregator,
        placer: Placer,
        migrations: Migrations,
        metrics: ProxyMetrics,
        dropper: KVDropper,
        notices: NoticeBoard | None,
        trace: TraceFile,
    ) -> None:
        """``names``: the model names clients may ask for; with ``notices``, decode is asked on
        prefill's first-token notice when it comes before prefill's answer."""
        self._names = names
        self._flow = flow
        self._placer = placer
        self._migrations = migrations
        self._metrics = metrics
        self._dropper = dropper
        self._notices = notices
        self._trace = trace

    async def serve(self, http: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        """Answer one client request on ``endpoint``, counted by its outcome (and traced)."""
        started = time.perf_counter()
        label = endpoint.value
        try:
            client = ClientRequest.from_json(endpoint, await http.read())
            if (named := http.headers.get("X-Request-Id")) is not None:  # before request_id
                client = dataclasses.replace(client, named=named)
            model = await self._names.resolve(client.model)
            if model is None:
                raise unknown_model(str(client.model), self._names.base)
            client = dataclasses.replace(client, model=model)
            check_length(client, await self._names.max_model_len())  # before prefill is spent
        except BadRequest as exc:
            self._metrics.requests.labels(label, Outcome.BAD_REQUEST.value).inc()
            return error_response(str(exc), exc.kind, exc.status, exc.param)
        except web.HTTPRequestEntityTooLarge as exc:
            self._metrics.requests.labels(label, Outcome.BAD_REQUEST.value).inc()
            return error_response(exc.text or "request body too large", "BadRequestError", 413)
        req_id = f"pd-{uuid.uuid4().hex}"
        outcome = Outcome.INTERNAL_ERROR
        trace: dict[str, Any] = {"event": "proxy", "req_id": req_id, "arrived": time.time()}
        try:
            if client.is_batch:
                response, outcome = await serve_batch(
                    stream_to(http), client, req_id, self._disaggregate, started, trace
                )
            else:
                response, outcome = await self._disaggregate(
                    stream_to(http), client, req_id, started, trace
                )
            return response
        except asyncio.CancelledError:  # the client went away; aiohttp cancels its handler
            outcome = _cancelled(trace)
            if outcome is Outcome.CLIENT_DISCONNECTED:
                logger.info("req %s: client disconnected; upstream requests cancelled", req_id)
            raise
        except Exception:  # a bug of ours: this request is lost, the proxy keeps serving
            logger.exception("req %s: failed inside the proxy", req_id)
            return error_response(
                f"internal error in the proxy (req {req_id})", "InternalError", 500
            )
        finally:
            self._metrics.requests.labels(label, outcome.value).inc()
            if self._trace.enabled:
                self._trace.write(trace | {"outcome": outcome.value, "done": time.time()})

    async def _disaggregate(
        self,
        open_stream: OpenStream,
        client: ClientRequest,
        req_id: str,
        started: float,
        trace: dict[str, Any],
    ) -> tuple[web.StreamResponse, Outcome]:
        """Pick decode (none if prefill's one token is the whole answer), serve a short prompt
        there alone, and drop the pushed KV of a request that ends before decode loads it."""
        try:
            with self._metrics.placement.time():
                plan = await self._placer.plan(client)
        except NoHealthyInstance as exc:
            return error_response(str(exc), "ServiceUnavailable", 503), Outcome.NO_INSTANCE
        decoder = plan.decoder
        trace |= plan.trace()
        if decoder is not None and plan.alone:
            return await self._alone(open_stream, client, req_id, decoder, started, trace, plan)
        spec = None
        if decoder is not None:
            assert decoder.receiver is not None
            host, init_port, alloc_port = decoder.receiver
            # Prefill need not push what decode's prefix cache holds (the index says so).
            spec = DisaggSpec(req_id, host, init_port, alloc_port, plan.decode_holds())
        outcome = Outcome.INTERNAL_ERROR
        # Each prefill attempt's spec, in order: each pushes under an id of its own.
        attempts: list[DisaggSpec] = []
        # The answer, once prefill's first token made one (the client may leave at any await).
        answers: list[Answer] = []
        try:
            with decoder.busy() if decoder is not None else contextlib.nullcontext():
                response, outcome = await self._answer(
                    open_stream, client, req_id, plan, spec, attempts, answers, started, trace
                )
                return response, outcome
        except asyncio.CancelledError:  # the client went away: say so in the drop notice
            outcome = _cancelled(trace)
            raise
        finally:
            pushed = attempts or ([spec] if spec is not None else [])
            self._drop_unloaded(pushed, answers[0] if answers else None, outcome)

    def _drop_unloaded(
        self, pushed: list[DisaggSpec], answer: Answer | None, outcome: Outcome
    ) -> None:
        """Tell decode to drop the KV of every prefill attempt it will not load, freed now
        rather than at its claim timeout (also when the client's cancellation brings us here):
        all but the answering attempt's, once decode was asked for it."""
        asked = outcome is Outcome.OK and answer is not None and answer.decode_asked
        loaded = answer.spec if asked and answer is not None else None
        for spec in pushed:
            if spec == loaded:
                continue
            self._metrics.kv_drops.inc()
            if spec is pushed[-1]:
                self._dropper.drop(spec, f"request ended ({outcome.value}) before decode loaded")
            else:
                self._dropper.drop(spec, "its prefill attempt failed; another was made")

    async def _answer(
        self,
        open_stream: OpenStream,
        client: ClientRequest,
        req_id: str,
        plan: Plan,
        spec: DisaggSpec | None,
        attempts: list[DisaggSpec],
        answers: list[Answer],
        started: float,
        trace: dict[str, Any],
    ) -> tuple[web.StreamResponse, Outcome]:
        """Prefill for the first token (each attempt's spec added to ``attempts``), then the
        answer (added to ``answers``), streamed or whole, with decode's rest."""
        decoder = plan.decoder
        try:
            prefilled, early = await self._first_token(client, req_id, plan, spec, attempts, trace)
        except NoHealthyInstance as exc:
            return error_response(str(exc), "ServiceUnavailable", 503), Outcome.NO_INSTANCE
        except UpstreamRejected as exc:
            if client.stream and not client.batch_part:
                return await self._refused_stream(
                    open_stream, client, req_id, plan, exc, started, trace
                )
            response = web.Response(
                body=exc.body, status=exc.status, content_type="application/json"
            )
            return response, Outcome.UPSTREAM_REJECTED
        except UpstreamFailed as exc:
            logger.error("req %s: lost before its first token: %s", req_id, exc)
            response = error_response(exc.client_message(req_id), "BadGateway", 502)
            return response, Outcome.PREFILL_FAILED
        trace |= {"prefill": prefilled.instance, "prefilled": time.time()}
        early = await self._keep_if_continued(early, prefilled, req_id)
        answer = Answer(
            self._flow,
            self._migrations,
            self._metrics,
            client,
            req_id,
            prefilled,
            decoder,
            prefilled.spec,
            trace,
            started,
            early,
        )
        answers.append(answer)
        try:
            if client.stream:
                response, outcome = await answer.stream(open_stream)
            else:
                response, outcome = await answer.whole()
        finally:
            if early is not None:  # read by the answer, or left unread if the client went
                await early.cancel()
        return response, outcome

    async def _refused_stream(
        self,
        open_stream: OpenStream,
        client: ClientRequest,
        req_id: str,
        plan: Plan,
        refusal: UpstreamRejected,
        started: float,
        trace: dict[str, Any],
    ) -> tuple[web.StreamResponse, Outcome]:
        """Prefill refused a streamed request, asked without streaming: vLLM refuses some
        fields before its stream opens (a 4xx, as prefill's) and others once it is open (an
        error event in a 200 stream: ``thinking_token_budget`` without a reasoning parser), and
        prefill's refusal cannot tell which. Decode is sent the client's own request alone and
        its answer passed on unread: the refusal one vLLM gives (or, where decode takes what
        prefill refused, its answer); counted as ``not_disaggregated{reason="prefill_refused"}``.
        With no decode instance up, prefill's refusal is the answer."""
        try:
            member = plan.decoder or self._placer.elsewhere(())
        except NoHealthyInstance:
            response = web.Response(
                body=refusal.body, status=refusal.status, content_type="application/json"
            )
            return response, Outcome.UPSTREAM_REJECTED
        logger.info(
            "req %s: prefill refused it (%d); decode is asked for the stream one vLLM sends",
            req_id,
            refusal.status,
        )
        alone = dataclasses.replace(client, alone_reason="prefill_refused")
        return await self._alone(open_stream, alone, req_id, member, started, trace)

    async def _alone(
        self,
        open_stream: OpenStream,
        client: ClientRequest,
        req_id: str,
        member: Upstream,
        started: float,
        trace: dict[str, Any],
        plan: Plan | None = None,
    ) -> tuple[web.StreamResponse, Outcome]:
        """Serve ``client`` on decode ``member`` alone, counted by why (``served_alone`` for a
        short prompt, else ``not_disaggregated`` by its ``alone_reason``); while it runs,
        ``member`` weighs the prompt ``plan`` says it computes (none without a plan)."""
        if client.alone_reason is None:
            self._metrics.served_alone.inc()
        else:
            self._metrics.not_disaggregated.labels(client.alone_reason).inc()
        load = () if plan is None else (plan.alone_computes, plan.alone_computed)
        with member.busy(*load) as computed:
            return await serve_alone(
                open_stream,
                self._flow,
                self._migrations,
                self._metrics,
                client,
                req_id,
                member,
                started,
                trace,
                computed,
            )

    async def _first_token(
        self,
        client: ClientRequest,
        req_id: str,
        plan: Plan,
        spec: DisaggSpec | None,
        attempts: list[DisaggSpec],
        trace: dict[str, Any],
    ) -> tuple[Prefilled, DecodeStream | None]:
        """Prefill's answer, and decode's stream if it was asked on a first-token notice that
        came first. On any failure, or if the client goes away, neither is left running."""
        params = KVTransferParams(ret_first_tok=True, disagg_spec=spec)
        decoder = plan.decoder
        prefill = asyncio.get_running_loop().create_task(
            self._flow.prefill(client, req_id, params, plan.work, attempts.append)
        )
        early: DecodeStream | None = None
        answered = False
        try:
            if decoder is not None and spec is not None and self._notices is not None:
                early = await self._decode_on_notice(prefill, client, req_id, decoder, spec, trace)
            prefilled = await prefill
            answered = True
        finally:
            if not answered:  # prefill failed, or the client went away while it ran
                prefill.cancel()
                if early is not None:
                    await early.cancel()
        return prefilled, early

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
        assert self._notices is not None
        notice = self._notices.expect(spec.req_id)
        try:
            await asyncio.wait((prefill, notice), return_when=asyncio.FIRST_COMPLETED)
        finally:
            self._notices.forget(spec.req_id)
        if prefill.done():  # else the wait ended on the notice
            self._metrics.first_token_notices.labels("after_answer").inc()
            return None
        got: FirstTokenNotice = notice.result()
        trace["notice"] = time.time()
        return DecodeStream(
            self._flow, client, decoder, req_id, spec, (got.token,), got.prompt_token_ids
        )

    async def _keep_if_continued(
        self, early: DecodeStream | None, prefilled: Prefilled, req_id: str
    ) -> DecodeStream | None:
        """Decode's stream asked on a notice, if it continues prefill's answer; else it is
        cancelled (prefill's answer is what the client sees: decode must continue exactly that),
        and decode will be asked again if the answer goes on."""
        if early is None:
            return None
        if prefilled.goes_on and early.matches(prefilled):
            self._metrics.first_token_notices.labels("used").inc()
            return early
        outcome = "mismatched" if prefilled.goes_on else "unused"
        self._metrics.first_token_notices.labels(outcome).inc()
        if outcome == "mismatched":
            logger.error(
                "req %s: the first-token notice (token %d) disagrees with prefill's answer "
                "(token %d); decode is asked again",
                req_id,
                early.forced[0],
                prefilled.first_token,
            )
        await early.cancel()
        return None


def _cancelled(trace: dict[str, Any]) -> Outcome:
    """The outcome of a request whose handler was cancelled: the client went away, unless it
    had its whole stream (``[DONE]``, ``done_sent`` in the trace: a client may hang up on it
    while the handler still closes upstream streams)."""
    return Outcome.OK if "done_sent" in trace else Outcome.CLIENT_DISCONNECTED
