"""vLLM's routes the proxy does not disaggregate, forwarded to an instance as they are, behind
the instances' key: ``/tokenize``, ``/detokenize`` and ``/version`` to the least busy instance
of either pool, and the Responses API (``/v1/responses``) to a decode instance by load, which
serves it alone (counted as ``not_disaggregated{reason="responses"}``), its answer streamed
through as it comes (SSE with vLLM's ``event:`` lines, or one JSON body). Loading or unloading a
LoRA adapter at run time (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``; vLLM serves them
where ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set) goes to every instance, prefill and decode
alike, since either may serve the adapter's requests; the first refusal is the answer, else the
first instance's, and the proxy lists the served names again. What every instance took is
recorded (``adapter_loads.py``) and loaded again on an instance that comes back up without it.

vLLM keeps a response only where ``VLLM_ENABLE_RESPONSES_API_STORE`` is set (off by default),
and then in one instance's memory: retrieving or cancelling one, or going on from one
(``previous_response_id``), is answered as one vLLM without the store answers it (not found);
with the store on, a response lives on one decode instance and a later call may reach another
(README: not offered). What vLLM would read as transfer parameters (``kv_transfer_params`` but
for LMCache's options, ``ec_transfer_params``, ``vllm_xargs`` carrying either) is refused on the
Responses API as on completions (``client_request.check_transfer_fields``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import aiohttp
import msgspec
from aiohttp import web

from lmcache_pd.proxy.adapter_loads import AdapterLoads
from lmcache_pd.proxy.client_request import BadRequest, check_transfer_fields
from lmcache_pd.proxy.config import Timeouts
from lmcache_pd.proxy.metrics import Outcome, ProxyMetrics
from lmcache_pd.proxy.responses import ClientGone, close_after_done, error_response, write
from lmcache_pd.proxy.routing import NoHealthyInstance, Pool, Upstream
from lmcache_pd.request_body import refusal

logger = logging.getLogger(__name__)

# Path -> method: answered by any instance (nothing is generated).
INSTANCE_ROUTES = {"/tokenize": "POST", "/detokenize": "POST", "/version": "GET"}
# Path -> method: what every instance must do alike (its LoRA adapters).
ADAPTER_ROUTES = {"/v1/load_lora_adapter": "POST", "/v1/unload_lora_adapter": "POST"}
# Path -> method: generation that decode serves alone (the Responses API).
RESPONSES_ROUTES = {
    "/v1/responses": "POST",
    "/v1/responses/{response_id}": "GET",
    "/v1/responses/{response_id}/cancel": "POST",
}


class Forwarder:
    """Forwards one request of ``INSTANCE_ROUTES`` or ``RESPONSES_ROUTES`` to an instance."""

    def __init__(
        self,
        session: Callable[[], aiohttp.ClientSession],
        instances: Callable[[], list[Upstream]],
        decode: Pool,
        headers: dict[str, str],
        timeouts: Timeouts,
        metrics: ProxyMetrics,
        adapters_changed: Callable[[], Awaitable[None]],
        adapter_loads: AdapterLoads,
    ) -> None:
        """``adapters_changed`` is awaited after an adapter was loaded or unloaded;
        ``adapter_loads`` records what every instance took."""
        self._adapters_changed = adapters_changed
        self._adapter_loads = adapter_loads
        self._session = session
        self._instances = instances
        self._decode = decode
        self._headers = {**headers, "Content-Type": "application/json"}
        self._metrics = metrics
        self._short = aiohttp.ClientTimeout(total=timeouts.prefill_read_s)
        # Generation: each read within decode's deadline, as the proxy's own streams.
        self._long = aiohttp.ClientTimeout(
            sock_connect=timeouts.connect_s, sock_read=timeouts.decode_read_s
        )

    def add_routes(self, app: web.Application) -> None:
        for path, method in (*INSTANCE_ROUTES.items(), *RESPONSES_ROUTES.items()):
            app.router.add_route(method, path, self.forward)
        for path, method in ADAPTER_ROUTES.items():
            app.router.add_route(method, path, self.to_every_instance)

    async def to_every_instance(self, request: web.Request) -> web.Response:
        """The request made of every healthy instance, one at a time (what one refuses, the
        rest are not asked); the first refusal, else the first answer; 503 with none healthy,
        502 where one cannot be reached."""
        body = await request.read()
        if body and (reason := refusal(body)) is not None:
            return error_response(reason, "BadRequestError", 400)
        members = [m for m in self._instances() if m.healthy]
        if not members:
            return error_response("no healthy instance", "ServiceUnavailable", 503)
        first: web.Response | None = None
        try:
            for member in members:
                async with self._session().request(
                    request.method,
                    f"{member.url}{request.path}",
                    data=body or None,
                    headers=self._headers,
                    timeout=self._short,
                ) as response:
                    answer = web.Response(
                        body=await response.read(),
                        status=response.status,
                        content_type=response.content_type,
                    )
                if answer.status != 200:
                    logger.warning(
                        "%s: %s refused it (%d)", request.path, member.url, answer.status
                    )
                    return answer
                if first is None:
                    first = answer
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._metrics.upstream_error(member, "broken")
            logger.warning("%s: %s failed: %r", request.path, member.url, exc)
            return error_response(f"an instance failed on {request.path}", "BadGateway", 502)
        finally:
            await self._adapters_changed()
        assert first is not None
        self._adapter_loads.done(request.path, body)
        return first

    async def forward(self, request: web.Request) -> web.StreamResponse:
        """The instance's answer, its status and type, streamed through as it comes; 400 for
        a body the instances' guard would refuse, 503 with no healthy instance, 502 where the
        instance fails before answering (after, the answer ends where it broke)."""
        body = await request.read()
        generates = request.path.startswith("/v1/responses")
        if body and (refused := self._refusal(request, body, generates)) is not None:
            return refused
        try:
            member = self._decode.pick() if generates else self._least_busy()
        except NoHealthyInstance as exc:
            return error_response(str(exc), "ServiceUnavailable", 503)
        if generates and request.method == "POST" and request.path == "/v1/responses":
            self._metrics.not_disaggregated.labels("responses").inc()
        out: web.StreamResponse | None = None
        try:
            with member.busy():
                async with self._session().request(
                    request.method,
                    f"{member.url}{request.path_qs}",
                    data=body or None,
                    headers=self._headers,
                    timeout=self._long if generates else self._short,
                ) as response:
                    out = web.StreamResponse(status=response.status)
                    out.content_type = response.content_type
                    await out.prepare(request)
                    async for data in response.content.iter_any():
                        await write(out, data)
            await close_after_done(out)
            return out
        except ClientGone:
            logger.info("%s: client disconnected; upstream request cancelled", request.path)
            assert out is not None
            return out
        except (aiohttp.ClientError, TimeoutError) as exc:
            self._metrics.upstream_error(member, "broken")
            logger.warning("%s: %s failed: %r", request.path, member.url, exc)
            if out is not None:  # its status is out: the client sees the answer cut short
                return out
            return error_response(f"the instance failed on {request.path}", "BadGateway", 502)

    def _refusal(self, request: web.Request, body: bytes, generates: bool) -> web.Response | None:
        """The 400 for a body the instances' guard would refuse, or, on the Responses API
        (``generates``), one carrying transfer parameters (vLLM reads them there as on
        completions: ``check_transfer_fields``), counted and logged; None for any other (a
        body that is no JSON object is vLLM's to refuse)."""
        refused = None
        if (reason := refusal(body)) is not None:
            refused = BadRequest(reason)
        elif generates:
            try:
                parsed = msgspec.json.decode(body)
            except (msgspec.DecodeError, UnicodeDecodeError):
                parsed = None
            try:
                if isinstance(parsed, dict):
                    check_transfer_fields(parsed)
            except BadRequest as exc:
                refused = exc
        if refused is None:
            return None
        self._metrics.requests.labels(request.path, Outcome.BAD_REQUEST.value).inc()
        logger.info("refused %s from %s: %s", request.path, request.remote, refused)
        return error_response(str(refused), refused.kind, refused.status, refused.param)

    def _least_busy(self) -> Upstream:
        members = [m for m in self._instances() if m.healthy]
        if not members:
            raise NoHealthyInstance("no healthy instance")
        return min(members, key=lambda m: m.outstanding)
