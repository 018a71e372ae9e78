"""The proxy's upstream calls: prefill for the first token (retried once on another prefill
instance if it fails before answering), and decode's answer to the client's own request (going
on from that token, or served alone for a short prompt); and the reading of their answers.

Every call has a connect and a read deadline; every failure becomes an ``UpstreamFailed`` that
names the instance, counted and logged by the caller; the client is told only the role that
failed and its request's id (``client_message``), never an instance's address. Every call carries
the instances' own key, never the client's headers. Cancelling the calling task (the client
went away) closes the upstream connection, and vLLM aborts a request whose client is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec

from lmcache_pd.errors import ProtocolError
from lmcache_pd.first_token import NoticeBoard
from lmcache_pd.protocol import DisaggSpec, KVTransferParams, KVTransferReturn
from lmcache_pd.proxy.client_request import ClientRequest
from lmcache_pd.proxy.config import Timeouts
from lmcache_pd.proxy.metrics import ProxyMetrics
from lmcache_pd.proxy.routing import NoHealthyInstance, Pool, Upstream

logger = logging.getLogger(__name__)

# Longest SSE line accepted from decode (a chunk with many top logprobs is a few KiB).
MAX_EVENT_BYTES = 1 << 20
PREFILL_ATTEMPTS = 2
# How long an idle upstream connection is kept for reuse: under vLLM's own 5 s
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE), so that we close it first. A request sent on a connection just
# as the server closes it is lost (ServerDisconnectedError, seen in a test); aiohttp's 15 s
# default invites exactly that.
UPSTREAM_KEEPALIVE_S = 4.0
# An instance refusing the proxy itself (its key): the proxy's fault, not the client's.
UNAUTHORIZED_STATUSES = (401, 403)


class UpstreamFailed(Exception):
    """An upstream call failed: ``kind`` is a short label for metrics, the message is for the
    proxy's log (it names the instance)."""

    def __init__(self, member: Upstream, kind: str, message: str) -> None:
        super().__init__(f"{member.role.value} instance {member.url}: {message}")
        self.member = member
        self.kind = kind

    def client_message(self, req_id: str) -> str:
        """What the client is told: the role and the request, not where or why."""
        return (
            f"the {self.member.role.value} instance failed on this request (req {req_id}); "
            "the proxy's log says why"
        )


class UpstreamRejected(Exception):
    """An instance refused the request itself (a 4xx: ``max_tokens`` past the model's length,
    say): the client gets vLLM's own answer, with its status."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"an instance answered {status}")
        self.status = status
        self.body = body


@dataclass(frozen=True, slots=True)
class Prefilled:
    """Prefill's answer: its JSON (what the client's first token is shown from), the first
    token, and the prompt's token ids."""

    answer: dict[str, Any]
    prompt_token_ids: list[int]
    first_token: int
    instance: str = ""  # the prefill instance that answered
    spec: DisaggSpec | None = None  # the answering attempt's (``DisaggSpec.for_attempt``)

    @property
    def goes_on(self) -> bool:
        """Prefill stopped at its one-token limit: the answer goes on at decode (unless it
        really ended there: EOS, a stop string)."""
        return self.answer["choices"][0].get("finish_reason") == "length"


def _prefilled(answer: dict[str, Any]) -> Prefilled | None:
    """Read prefill's JSON answer; None if it lacks what decode needs, ``ProtocolError`` if
    its ``kv_transfer_params`` are malformed."""
    choices = answer.get("choices") or []
    if len(choices) != 1 or not isinstance(choices[0], dict):
        return None
    choice = choices[0]
    prompt_ids = choice.get("prompt_token_ids") or answer.get("prompt_token_ids")
    first = KVTransferReturn.from_dict(answer.get("kv_transfer_params")).first_tok
    if first is None and choice.get("token_ids"):
        first = choice["token_ids"][0]
    if not prompt_ids or not isinstance(first, int):
        return None
    return Prefilled(answer, list(prompt_ids), first)


class Disaggregator:
    """Makes the upstream calls of one request, on a shared HTTP session."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        prefill: Pool,
        timeouts: Timeouts,
        metrics: ProxyMetrics,
        notices: NoticeBoard | None = None,
        instance_headers: dict[str, str] | None = None,
    ) -> None:
        """With ``notices``, prefill is asked to send each disaggregated request's first token
        there too, the moment its engine has it. ``instance_headers`` go with every call (the
        instances' key)."""
        self._session = session
        self._headers = {"Content-Type": "application/json", **(instance_headers or {})}
        self._prefill = prefill
        self._metrics = metrics
        self._notices = notices
        self._prefill_timeout = aiohttp.ClientTimeout(
            sock_connect=timeouts.connect_s, sock_read=timeouts.prefill_read_s
        )
        self._decode_timeout = aiohttp.ClientTimeout(
            sock_connect=timeouts.connect_s, sock_read=timeouts.decode_read_s
        )

    async def prefill(
        self,
        request: ClientRequest,
        req_id: str,
        kv_transfer_params: KVTransferParams,
        work: Callable[[Upstream], int] | None = None,
        attempted: Callable[[DisaggSpec], None] = lambda _: None,
    ) -> Prefilled:
        """The first token, from the prefill instance that ``work`` (the prompt tokens each
        would compute; None: unknown) and load make cheapest, or from a second one if the first
        fails without answering. A 4xx is the client's problem and is not retried. Each
        attempt pushes under a spec of its own (``DisaggSpec.for_attempt``), told to
        ``attempted`` before it is sent."""
        failed: UpstreamFailed | None = None
        for attempt in range(PREFILL_ATTEMPTS):
            try:
                member = self._prefill.pick(exclude=[failed.member] if failed else [], work=work)
            except NoHealthyInstance:
                if failed is None:
                    raise
                raise failed from None
            if failed is not None:
                self._metrics.prefill_retries.inc()
                logger.warning(
                    "req %s: retrying prefill on %s after: %s", req_id, member.url, failed
                )
            params = kv_transfer_params
            if params.disagg_spec is not None:
                spec = params.disagg_spec.for_attempt(attempt)
                attempted(spec)
                params = msgspec.structs.replace(params, disagg_spec=spec)
                if self._notices is not None:
                    address = self._notices.address_for(member.url)
                    params = msgspec.structs.replace(params, first_tok_to=address)
            body = request.prefill_body(params)
            try:
                with member.busy(0 if work is None else work(member)):
                    prefilled = await self._prefill_once(member, request, req_id, body)
                return dataclasses.replace(prefilled, instance=member.url, spec=params.disagg_spec)
            except UpstreamFailed as exc:
                self._metrics.upstream_error(member, exc.kind)
                failed = exc
        assert failed is not None
        raise failed

    @contextlib.asynccontextmanager
    async def _call(
        self,
        member: Upstream,
        request: ClientRequest,
        req_id: str,
        body: dict[str, Any],
        timeout: aiohttp.ClientTimeout,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST ``body`` to ``member`` on ``request``'s endpoint, named as vLLM names its answer
        (``ClientRequest.answer_name``); any failure in the call or in reading its answer inside
        the block becomes an ``UpstreamFailed``, and a refused connection marks it down."""
        try:
            async with self._session.post(
                f"{member.url}{request.endpoint.value}",
                data=msgspec.json.encode(body),
                headers={**self._headers, "X-Request-Id": request.answer_name(req_id)},
                timeout=timeout,
            ) as response:
                yield response
        except TimeoutError as exc:  # aiohttp's connect and read timeouts are TimeoutErrors
            raise UpstreamFailed(
                member, "timeout", "nothing came before the deadline (connect_s, *_read_s)"
            ) from exc
        except aiohttp.ClientConnectorError as exc:
            member.mark(False, f"connection failed: {exc!r}")
            raise UpstreamFailed(member, "connect", f"cannot reach it: {exc!r}") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamFailed(member, "broken", f"answer cut short: {exc!r}") from exc
        except (msgspec.DecodeError, ProtocolError, KeyError, TypeError, ValueError) as exc:
            raise UpstreamFailed(member, "bad_answer", f"unreadable answer: {exc}") from exc

    async def _prefill_once(
        self, member: Upstream, request: ClientRequest, req_id: str, body: dict[str, Any]
    ) -> Prefilled:
        async with self._call(member, request, req_id, body, self._prefill_timeout) as response:
            await _ensure_ok(member, response)
            prefilled = _prefilled(msgspec.json.decode(await response.read()))
        if prefilled is None:
            raise UpstreamFailed(member, "bad_answer", "answer lacks token ids")
        return prefilled

    async def relay(
        self,
        member: Upstream,
        request: ClientRequest,
        req_id: str,
        body: dict[str, Any],
    ) -> AsyncIterator[list[bytes]]:
        """``body`` (the client's own request, or decode's continuation of it) served by
        ``member``: the data of its SSE events, a list per network read, ending with
        ``[DONE]``; or, not streamed, its JSON body as the one item. Raises
        ``UpstreamRejected`` for a 4xx and ``UpstreamFailed`` for any other failure, including
        a stream that ends without ``[DONE]``."""
        async with self._call(member, request, req_id, body, self._decode_timeout) as response:
            await _ensure_ok(member, response)
            if not request.stream:
                yield [await response.read()]
                return
            async for events in _sse_batches(member, response):
                yield events
                if events[-1] == b"[DONE]":
                    await response.content.read()  # to the body's end, so the connection is reused
                    return
            raise UpstreamFailed(member, "truncated", "stream ended without [DONE]")


async def _ensure_ok(member: Upstream, response: aiohttp.ClientResponse) -> None:
    """Raise ``UpstreamRejected`` for a 4xx (the client's request was refused: it gets vLLM's own
    answer) and ``UpstreamFailed`` for any other status but 200, and for an instance that refuses
    the proxy's key."""
    if response.status == 200:
        return
    raw = await response.read()
    if response.status in UNAUTHORIZED_STATUSES:
        raise UpstreamFailed(
            member,
            "unauthorized",
            f"refused the proxy's key ({response.status}): is "
            "instance_api_key the key the instance was started with?",
        )
    if 400 <= response.status < 500:
        raise UpstreamRejected(response.status, raw)
    raise UpstreamFailed(member, "status", f"answered {response.status}: {raw[:300]!r}")


async def _sse_batches(
    member: Upstream, response: aiohttp.ClientResponse
) -> AsyncIterator[list[bytes]]:
    """The data fields of an SSE body's complete lines, one list per network read."""
    partial = b""
    while data := await response.content.readany():
        *lines, partial = (partial + data).split(b"\n")
        if len(partial) > MAX_EVENT_BYTES:
            raise UpstreamFailed(member, "bad_answer", f"an event over {MAX_EVENT_BYTES} bytes")
        events = [line[5:].strip() for line in lines if line.startswith(b"data:")]
        if events:  # blank separators and comments alone are not worth a write
            yield events
