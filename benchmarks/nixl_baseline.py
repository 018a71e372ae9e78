"""The serving benchmark's baseline: vLLM's own NixlConnector disaggregation, one prefill (P) and
one decode (D) vLLM on this machine, behind a small router that follows vLLM's protocol.

The protocol, as vLLM 0.32 defines it (its toy proxy,
``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``, and the connector's scheduler
side, ``vllm/distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py``):

1. P gets the client's body with ``max_tokens: 1`` (and ``max_completion_tokens: 1`` if present),
   ``stream: false``, no ``stream_options``, ``min_tokens`` or ``min_completion_tokens``, and
   ``kv_transfer_params: {"do_remote_decode": true, "do_remote_prefill": false, ...}``.
2. P prefills, answers its one token and returns ``kv_transfer_params`` (``do_remote_prefill``,
   ``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``,
   ``remote_port``...), holding those blocks until D has read them or a lease runs out.
3. D gets the client's own body plus P's ``kv_transfer_params``, reads the blocks from P over
   NIXL (a pull) and answers the whole request, first token included: its answer is the
   client's. Both calls carry the same ``X-Request-Id``.

The first P->D request pays a one-off NIXL handshake between the two (DESIGN.md: 5-12 s; here
also 0.7-1.4 s): call ``warm_up()`` before measuring.

Measured as the serving benchmark's system ``nixl``::

    .venv/bin/python -m benchmarks.serving --systems lmcache-pd,nixl
"""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import msgspec
from aiohttp import web

from lmcache_pd.deploy.launcher import unused_port
from lmcache_pd.deploy.vllm_server import VLLMServer, wait_until_healthy
from lmcache_pd.proxy.flow import UPSTREAM_KEEPALIVE_S
from lmcache_pd.proxy.responses import error_body

logger = logging.getLogger(__name__)

# The same deadlines as our own proxy's defaults (proxy/config.py), so both systems fail alike.
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 120.0  # for prefill's answer; between two reads of decode's stream
HEALTH_TIMEOUT_S = 2.0
WARM_UP_TIMEOUT_S = 120.0
ROUTER_START_TIMEOUT_S = 30.0
ROUTER_STOP_TIMEOUT_S = 10.0
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
# P's kv_transfer_params: "decode elsewhere", the rest to be filled in by P's answer.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body as P must get it (step 1 of the protocol)."""
    drop = ("stream_options", "min_tokens", "min_completion_tokens")
    prefill = {key: value for key, value in body.items() if key not in drop}
    prefill |= {"max_tokens": 1, "stream": False, "kv_transfer_params": dict(PREFILL_PARAMS)}
    if "max_completion_tokens" in body:
        prefill["max_completion_tokens"] = 1
    return prefill


def _error(message: str, status: int, kind: str = "BadGateway") -> web.Response:
    return web.json_response(error_body(message, kind, status), status=status)


def _upstream_error(role: str, status: int, raw: bytes) -> web.Response:
    """An upstream's non-200 answer: a 4xx is the client's (vLLM's own error body, as is);
    anything else becomes a 502."""
    if 400 <= status < 500:
        return web.Response(body=raw, status=status, content_type="application/json")
    return _error(f"{role} answered {status}: {raw[:300]!r}", 502)


class NixlRouter:
    """vLLM's NixlConnector protocol in front of one P and one D, as an aiohttp app."""

    def __init__(
        self,
        prefill_url: str,
        decode_url: str,
        *,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
    ) -> None:
        self.prefill_url, self.decode_url = prefill_url, decode_url
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _: web.Application) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S),
            timeout=self._timeout,
        )

    async def _close(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    async def health(self, _: web.Request) -> web.Response:
        """200 when P and D both answer their /health."""
        assert self._session is not None
        up = {}
        for role, url in (("prefill", self.prefill_url), ("decode", self.decode_url)):
            try:
                timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
                async with self._session.get(f"{url}/health", timeout=timeout) as response:
                    up[role] = response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                up[role] = False
        return web.json_response({"up": up}, status=200 if all(up.values()) else 503)

    async def models(self, _: web.Request) -> web.Response:
        """P's model card (vLLM's benchmark client reads the model and tokenizer from it)."""
        assert self._session is not None
        try:
            async with self._session.get(f"{self.prefill_url}/v1/models") as response:
                raw = await response.read()
                return web.Response(
                    body=raw, status=response.status, content_type="application/json"
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _error(f"prefill {self.prefill_url} did not answer /v1/models: {exc!r}", 502)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        """P for the KV and one token, then D for the whole answer (module docstring)."""
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            return _error(f"malformed JSON body: {exc}", 400, "BadRequestError")
        if not isinstance(body, dict):
            return _error("the body must be a JSON object", 400, "BadRequestError")
        assert self._session is not None
        request_id = f"nixl-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": request_id}
        try:
            async with self._session.post(
                f"{self.prefill_url}{request.path}", json=prefill_body(body), headers=headers
            ) as response:
                raw = await response.read()
            if response.status != 200:
                return _upstream_error("prefill", response.status, raw)
            answer = msgspec.json.decode(raw)
            params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        except (aiohttp.ClientError, TimeoutError, msgspec.DecodeError) as exc:
            logger.error("req %s: prefill %s failed: %r", request_id, self.prefill_url, exc)
            return _error(f"prefill {self.prefill_url} failed: {exc!r}", 502)
        if not params:  # as vLLM's proxy does: D then computes the prompt itself
            logger.warning("req %s: prefill returned no kv_transfer_params", request_id)
        decode = {**body, "kv_transfer_params": params} if params else body
        return await self._decode(request, decode, request_id)

    async def _decode(
        self, request: web.Request, body: dict[str, Any], request_id: str
    ) -> web.StreamResponse:
        """D's answer passed through: whole, or streamed as it comes. Leaving this (the client
        gone, the handler cancelled) closes the connection to D, and vLLM aborts the request."""
        assert self._session is not None
        url, headers = f"{self.decode_url}{request.path}", {"X-Request-Id": request_id}
        try:
            async with self._session.post(url, json=body, headers=headers) as upstream:
                if upstream.status != 200:
                    return _upstream_error("decode", upstream.status, await upstream.read())
                if not body.get("stream"):
                    raw = await upstream.read()
                    return web.Response(body=raw, content_type="application/json")
                response = web.StreamResponse(headers=SSE_HEADERS)
                await response.prepare(request)
                try:
                    await self._relay(upstream, response, request_id)
                except ConnectionError:  # only writes to the client raise it out of _relay
                    logger.info("req %s: client disconnected; decode request closed", request_id)
                return response
        except (aiohttp.ClientError, TimeoutError) as exc:  # before anything went to the client
            return _error(f"decode {self.decode_url} failed: {exc!r}", 502)

    async def _relay(
        self, upstream: aiohttp.ClientResponse, response: web.StreamResponse, request_id: str
    ) -> None:
        """Copy D's stream to the client; if D fails mid-stream, end with an error event."""
        last = b"\n\n"
        while True:
            try:
                chunk = await upstream.content.readany()
            except (aiohttp.ClientError, TimeoutError) as exc:
                logger.error("req %s: decode failed mid-stream: %r", request_id, exc)
                message = f"decode {self.decode_url} failed mid-stream: {exc!r}"
                event = msgspec.json.encode(error_body(message, "BadGateway", 502))
                separator = b"" if last.endswith(b"\n\n") else b"\n\n"  # end a cut event
                await response.write(separator + b"data: " + event + b"\n\ndata: [DONE]\n\n")
                break
            if not chunk:
                break
            await response.write(chunk)
            last = chunk
        await response.write_eof()


class NixlBaseline:
    """P and D vLLM with NixlConnector, each on its own core, and the router in a thread of
    this process; a context manager that leaves nothing running."""

    def __init__(
        self,
        model: Path,
        workdir: Path,
        *,
        extra_args: Sequence[str] = (),
        log_stats: bool = False,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        read_timeout_s: float = READ_TIMEOUT_S,
        whole_instance_on_its_cpu: bool = False,
    ) -> None:
        """Nothing starts before ``start()`` (or ``with``). ``extra_args`` go to both vLLM
        instances; ``log_stats`` keeps their Prometheus metrics on;
        ``whole_instance_on_its_cpu`` keeps every process of an instance on its core (vLLM's
        ``process_cpus``), not its inference threads alone."""
        self.model, self.workdir = model, workdir
        self.extra_args, self.log_stats = list(extra_args), log_stats
        self.connect_timeout_s, self.read_timeout_s = connect_timeout_s, read_timeout_s
        self.whole_instance_on_its_cpu = whole_instance_on_its_cpu
        self.prefill: VLLMServer | None = None
        self.decode: VLLMServer | None = None
        self.url = ""
        self._router: subprocess.Popen | None = None

    def _instance(self, role: str, cpu: int, ports: set[int]) -> VLLMServer:
        kv_role = {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        return VLLMServer(
            self.model,
            unused_port(ports),
            self.workdir / f"nixl-{role}.log",
            kv_transfer_config={
                "kv_connector": "NixlConnector",
                "kv_role": kv_role,
                "kv_buffer_device": "cpu",
            },
            cpu=cpu,
            process_cpus=str(cpu) if self.whole_instance_on_its_cpu else None,
            env={
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(unused_port(ports)),
            },
            extra_args=self.extra_args,
            log_stats=self.log_stats,
            wait=False,
        )

    def start(self) -> None:
        """Start P (cpu 0) and D (cpu 1) at once, wait until both are healthy, then the router.
        On any failure everything started is stopped again."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        ports: set[int] = set()
        try:
            self.prefill = self._instance("prefill", 0, ports)
            self.decode = self._instance("decode", 1, ports)
            self.prefill.wait_until_healthy()
            self.decode.wait_until_healthy()
            # In its own process, as our proxy runs: neither shares a core's GIL with clients.
            port = unused_port(ports)
            self._router = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.nixl_baseline",
                    self.prefill.url,
                    self.decode.url,
                    str(port),
                    str(self.connect_timeout_s),
                    str(self.read_timeout_s),
                ],
                stdout=(self.workdir / "nixl-router.log").open("w"),
                stderr=subprocess.STDOUT,
            )
            self.url = f"http://127.0.0.1:{port}"
            wait_until_healthy(self.url, self._router, ROUTER_START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise
        logger.info(
            "nixl baseline: router %s, P %s, D %s", self.url, self.prefill.url, self.decode.url
        )

    def warm_up(self, prompt_tokens: int = 256, max_tokens: int = 4) -> float:
        """One request through the router, paying the first P->D handshake; its seconds."""
        generator = random.Random(-1)  # a prompt no caller's prompt shares a block with
        body = {
            "model": str(self.model),
            "prompt": [generator.randrange(10, 1000) for _ in range(prompt_tokens)],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        started = time.perf_counter()
        response = httpx.post(f"{self.url}/v1/completions", json=body, timeout=WARM_UP_TIMEOUT_S)
        response.raise_for_status()
        return time.perf_counter() - started

    def stop(self) -> None:
        """Stop the router, then D, then P. Idempotent."""
        if self._router is not None:
            self._router.terminate()
            self._router.wait(ROUTER_STOP_TIMEOUT_S)
            self._router = None
        for server in (self.decode, self.prefill):
            if server is not None:
                server.stop()

    def __enter__(self) -> NixlBaseline:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_router(argv: Sequence[str]) -> None:
    """``PREFILL_URL DECODE_URL PORT CONNECT_S READ_S``: the router until SIGTERM or SIGINT."""
    prefill, decode, port, connect_s, read_s = argv
    router = NixlRouter(
        prefill, decode, connect_timeout_s=float(connect_s), read_timeout_s=float(read_s)
    )
    web.run_app(router.app(), host="127.0.0.1", port=int(port), access_log=None, print=None)


if __name__ == "__main__":
    serve_router(sys.argv[1:])
