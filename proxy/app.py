"""The proxy's HTTP server: OpenAI endpoints in front of prefill and decode pools.

This module holds the aiohttp application, its routes, ``/health``, ``/metrics`` and what the
proxy starts and stops (the upstream HTTP session, health checks, membership, the first-token
notice board, the KV dropper). Every ``/v1/*`` request passes the door first (``door.py``: the
clients' key, the admission limit); one request's path, from its body to its answer, is
``orchestration.py``'s; the upstream calls are ``flow.py``'s. asyncio end to end: nothing here
blocks the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable, Sequence

import aiohttp
import zmq
from aiohttp import web
from prometheus_client.registry import Collector

from lmcache_pd.affinity import unpin_this_thread
from lmcache_pd.first_token import NoticeBoard
from lmcache_pd.proxy.adapter_loads import AdapterLoads
from lmcache_pd.proxy.cache_aware import SentPrompts
from lmcache_pd.proxy.client_request import Endpoint
from lmcache_pd.proxy.config import ProxyConfig
from lmcache_pd.proxy.door import Door
from lmcache_pd.proxy.flow import MAX_EVENT_BYTES, UPSTREAM_KEEPALIVE_S, Disaggregator
from lmcache_pd.proxy.forwarding import Forwarder
from lmcache_pd.proxy.kv_drop import KVDropper
from lmcache_pd.proxy.kv_index import KVIndex
from lmcache_pd.proxy.local_tokenizer import LocalTokenizer
from lmcache_pd.proxy.membership import Membership, MemberSource
from lmcache_pd.proxy.metrics import ProxyMetrics
from lmcache_pd.proxy.migration import Migrations
from lmcache_pd.proxy.model_names import ModelNames
from lmcache_pd.proxy.orchestration import Orchestrator
from lmcache_pd.proxy.placement import Placer
from lmcache_pd.proxy.prompt_size import PromptSizer
from lmcache_pd.proxy.prompt_tokens import PromptTokens
from lmcache_pd.proxy.responses import error_response, json_response
from lmcache_pd.proxy.routing import HealthChecker, NoHealthyInstance, Pool, Role, Upstream
from lmcache_pd.trace import TraceFile

logger = logging.getLogger(__name__)


class Proxy:
    """Owns the pools, the upstream HTTP session, health checks and metrics of one proxy, and
    hands each client request to its ``Orchestrator``."""

    def __init__(
        self,
        config: ProxyConfig,
        members: MemberSource | None = None,
        collectors: Sequence[Collector] = (),
    ) -> None:
        """Serve the pools of ``config``; with ``members``, whatever it says the pools are now
        (a cluster engine that adds, restarts and drains instances); ``collectors``: more
        metrics for ``/metrics`` (serve's restarts). Reads the key files now: ``ConfigError`` if
        one cannot be read."""
        self.config = config
        # The instances' key, on every call to their /v1/* (never the client's headers).
        self._instance_headers = config.instance_headers()
        self.prefill = Pool(
            Role.PREFILL,
            [Upstream(p.url, Role.PREFILL, kv_events=p.kv_events) for p in config.prefill],
        )
        self.decode = Pool(
            Role.DECODE,
            [
                Upstream(
                    d.url,
                    Role.DECODE,
                    (d.receiver_host, d.init_port, d.alloc_port),
                    kv_events=d.kv_events,
                )
                for d in config.decode
            ],
        )
        self.metrics = ProxyMetrics(self._upstreams, lambda: self.door.in_flight)
        for collector in collectors:
            self.metrics.registry.register(collector)
        self._names = ModelNames(
            config.model,
            self._http,
            self._upstreams,
            self._instance_headers,
            config.timeouts.health_s,
        )
        self._adapter_loads = AdapterLoads(
            self._http,
            self._instance_headers,
            config.timeouts.prefill_read_s,
            self.metrics.adapter_replay_failures.inc,
        )
        self._forwarder = Forwarder(
            self._http,
            self._upstreams,
            self.decode,
            self._instance_headers,
            config.timeouts,
            self.metrics,
            self._names.refresh,
            self._adapter_loads,
        )
        self.door = Door(
            config.client_key(),
            config.max_in_flight,
            lambda reason: self.metrics.refused.labels(reason).inc(),
        )
        self._membership = (
            None
            if members is None
            else Membership(
                members,
                {Role.PREFILL: self.prefill, Role.DECODE: self.decode},
                self.metrics.membership_errors.inc,
                self.metrics.forget_instance,
            )
        )
        self._session: aiohttp.ClientSession | None = None
        self._index: KVIndex | None = None
        self._health: HealthChecker | None = None
        self._dropper: KVDropper | None = None
        self._notices: NoticeBoard | None = None
        self._tokens: PromptTokens | None = None
        self._orchestrator: Orchestrator | None = None
        self._trace = TraceFile(config.trace_path)
        self._sizer = PromptSizer(config.min_disagg_tokens, config.tokenizer)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes, middlewares=[self.door])
        app.router.add_post(Endpoint.COMPLETIONS.value, self.completions)
        app.router.add_post(Endpoint.CHAT.value, self.chat)
        app.router.add_get("/v1/models", self.models)
        self._forwarder.add_routes(app)
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
        keys = self.config.deployment_keys()
        if keys is None:
            logger.warning(
                "no deployment secret: first-token notices and KV drops reach only instances "
                "that have none either (set secret_file or LMCACHE_PD_SECRET)"
            )
        if self.config.first_token_notices:
            try:
                board = self._notices = NoticeBoard(self.config.host, keys, self.config.notice_port)
            except zmq.ZMQError as exc:  # serve anyway: a notice is only a head start
                logger.warning(
                    "no first-token notices (cannot listen on %s): %s", self.config.host, exc
                )
            else:
                board.start()
                self.metrics.count_notice_refusals(lambda: board.refused)
        self._dropper = KVDropper(keys, self.metrics.kv_drops_skipped.inc)
        placer = Placer(self.decode, self._sizer)
        if self.config.routing != "load":
            tokens = self._tokens = PromptTokens(
                self._session,
                self._upstreams,
                self._instance_headers,
                self.config.timeouts.health_s,
                await asyncio.to_thread(
                    LocalTokenizer.load, self.config.tokenizer or self.config.model
                ),
                self.metrics.local_render_timeouts.inc,
            )
        if self.config.routing == "cache_aware":
            sent = SentPrompts(self.config.kv_index_max_blocks)
            placer = Placer(self.decode, self._sizer, None, tokens, self.config.model, sent=sent)
        elif self.config.routing == "kv":
            self._index = KVIndex(self._upstreams, keys, self.config.kv_index_max_blocks)
            self.metrics.registry.register(self._index.collector())
            await self._index.sync()
            self._index.periodic.start()
            placer = Placer(
                self.decode, self._sizer, self._index, tokens, self.config.model, self.prefill
            )
        flow = Disaggregator(
            self._session,
            self.prefill,
            self.config.timeouts,
            self.metrics,
            self._notices,
            self._instance_headers,
        )
        await self._names.refresh()
        self._orchestrator = Orchestrator(
            names=self._names,
            flow=flow,
            placer=placer,
            migrations=Migrations(flow, placer, self.metrics, self.config.decode_migrations),
            metrics=self.metrics,
            dropper=self._dropper,
            notices=self._notices,
            trace=self._trace,
        )
        self._health = HealthChecker(
            self._upstreams,
            lambda: self._session,
            interval_s=self.config.health_interval_s,
            timeout_s=self.config.timeouts.health_s,
            on_up=self._adapter_loads.replay,
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

    def _http(self) -> aiohttp.ClientSession:
        """The upstream session (the app has started)."""
        assert self._session is not None
        return self._session

    def _upstreams(self) -> list[Upstream]:
        return [*self.prefill.members, *self.decode.members]

    async def _stop(self, _: web.Application) -> None:
        if self._tokens is not None:
            self._tokens.close()
        if self._membership is not None:
            await self._membership.periodic.stop()
        if self._health is not None:
            await self._health.periodic.stop()
        if self._index is not None:
            await self._index.periodic.stop()
            await self._index.close()
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

    async def models(self, _: web.Request) -> web.StreamResponse:
        """Prefill's own model card (vLLM's benchmark client reads the tokenizer from it)."""
        assert self._session is not None
        try:
            member = self.prefill.pick()
            async with self._session.get(
                f"{member.url}/v1/models",
                headers=self._instance_headers,
                timeout=aiohttp.ClientTimeout(total=self.config.timeouts.health_s),
            ) as response:
                body, status = await response.read(), response.status
        except (NoHealthyInstance, aiohttp.ClientError, TimeoutError) as exc:
            logger.warning("/v1/models: no prefill instance answered: %r", exc)
        else:
            if status == 200:
                return web.Response(body=body, content_type="application/json")
            logger.warning("/v1/models: %s answered %d: %r", member.url, status, body[:300])
        return error_response("no prefill instance answered /v1/models", "ServiceUnavailable", 503)

    # ---- the disaggregated endpoints ----

    async def completions(self, request: web.Request) -> web.StreamResponse:
        assert self._orchestrator is not None
        return await self._orchestrator.serve(request, Endpoint.COMPLETIONS)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        assert self._orchestrator is not None
        return await self._orchestrator.serve(request, Endpoint.CHAT)


async def serve(
    config: ProxyConfig,
    ready: Callable[[str], None] | None = None,
    stop: asyncio.Event | None = None,
    members: MemberSource | None = None,
    collectors: Sequence[Collector] = (),
) -> None:
    """Serve until ``stop`` is set (by default: until SIGINT or SIGTERM), calling ``ready`` with
    the base URL once listening.

    A client that disconnects cancels its handler (``handler_cancellation``), which closes both
    upstream connections; vLLM then aborts the request. ``members``, ``collectors``: see
    ``Proxy``."""
    proxy = Proxy(config, members, collectors)
    runner = web.AppRunner(proxy.app(), access_log=None, handler_cancellation=True)
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
    collectors: Sequence[Collector] = (),
) -> None:
    """``serve`` on a fresh event loop until SIGINT or SIGTERM (uvloop when installed: it comes
    with vLLM), on ``config.cpus`` (the threads it starts inherit them)."""
    if config.cpus is not None:
        unpin_this_thread(config.cpus, "proxy")
    served = serve(config, ready, members=members, collectors=collectors)
    try:
        import uvloop
    except ImportError:
        asyncio.run(served)
    else:
        uvloop.run(served)
