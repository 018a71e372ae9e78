"""A decode answer that goes on on another decode instance when its own fails under it.

When decode fails (it cannot be reached, answers a 5xx, breaks off, is silent past
``decode_read_s``, or answers what cannot be read), the request goes to another decode: the
client's own request again, its output forced through every token the client already has
(``continuation.DecodeRelay.resume``; before any, prefill's first token) by the forcing logits
processor (``connector/forced_tokens.py``). No KV is pushed for it: the new decode computes the
prompt (what its prefix cache holds, it loads). Its events are passed on from where the client
is, so the client's stream reads as one: no error, no token twice, none missing, one usage total
(the new decode's, which counts the forced tokens as output).

Exact, not only for greedy requests: the forced tokens are output to vLLM, so penalties, stop
strings, ``min_tokens``, grammars (each forced token advances a structured output's grammar as
it did) and seeded sampling (each forced position draws its random numbers as it did) go on as
one vLLM would. What it costs: the prompt computed again, then one engine step per forced token
before the first new one.

Bounded: at most ``decode_migrations`` times per request, each a new call with the usual
deadlines. A stream whose events are not one choice's plain text (tool-call or reasoning
deltas, several choices, an echoed prompt: ``DecodeRelay``'s ``plain``, and what decode serves
alone for a field, whose events are passed on unread) goes on elsewhere only before the client
has any of it; after, it ends with an error event, as before. Each migration is counted by
its cause, each refusal by why; the decode that broke off is marked down until its health
check passes again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from lmcache_pd.proxy.client_request import ClientRequest
from lmcache_pd.proxy.continuation import CannotContinue
from lmcache_pd.proxy.decode_stream import DecodeStream
from lmcache_pd.proxy.flow import Disaggregator, UpstreamFailed
from lmcache_pd.proxy.metrics import ProxyMetrics
from lmcache_pd.proxy.placement import Placer
from lmcache_pd.proxy.routing import NoHealthyInstance, Upstream

logger = logging.getLogger(__name__)

# Failures that say the instance itself is gone or going (its connection cut in the middle of
# an answer): it is marked down at once, not at its next health check.
LOST_KINDS = frozenset({"broken", "truncated"})


class Migrations:
    """Where a request whose decode failed goes on, within its bound; counted and logged."""

    def __init__(
        self, flow: Disaggregator, placer: Placer, metrics: ProxyMetrics, limit: int
    ) -> None:
        """``limit``: migrations per request (0: none; the stream ends with an error)."""
        self._flow = flow
        self._placer = placer
        self._metrics = metrics
        self._limit = limit

    async def decoded(
        self,
        client: ClientRequest,
        req_id: str,
        stream: DecodeStream,
        resume: Callable[[], tuple[int, ...]],
    ) -> AsyncIterator[list[bytes]]:
        """``stream``'s batches, then, each time decode fails under it, those of the request
        gone on elsewhere, forced through ``resume()``'s tokens (which raises
        ``CannotContinue`` where it cannot go on). Raises the last ``UpstreamFailed`` where it
        cannot go on (bound, no other instance, a stream that cannot be matched), and
        ``UpstreamRejected`` as decode answers it."""
        failed: list[Upstream] = []
        with contextlib.ExitStack() as busy:  # each decode gone on to counts its request
            while True:
                try:
                    async for batch in stream.batches():
                        yield batch
                    return
                except UpstreamFailed as exc:
                    failure = exc
                finally:
                    await stream.cancel()
                self._failed(req_id, failure)
                failed.append(failure.member)
                member, forced = self._elsewhere(req_id, failed, failure, resume)
                busy.enter_context(member.busy())
                stream = DecodeStream(self._flow, client, member, req_id, None, forced)

    def _failed(self, req_id: str, exc: UpstreamFailed) -> None:
        self._metrics.upstream_error(exc.member, exc.kind)
        if exc.kind in LOST_KINDS:
            exc.member.mark(False, f"its answer to req {req_id} broke off ({exc.kind})")
        logger.error("req %s: decode failed: %s", req_id, exc)

    def _elsewhere(
        self,
        req_id: str,
        failed: list[Upstream],
        exc: UpstreamFailed,
        resume: Callable[[], tuple[int, ...]],
    ) -> tuple[Upstream, tuple[int, ...]]:
        """Another decode and the tokens to force there; raises ``exc`` where there is none."""
        if len(failed) > self._limit:
            self._refused(req_id, "limit", f"it went on elsewhere {self._limit} times already")
            raise exc
        try:
            forced = resume()
        except CannotContinue as why:
            self._refused(req_id, "not_plain", str(why))
            raise exc from None
        try:
            member = self._placer.elsewhere(failed)
        except NoHealthyInstance:
            self._refused(req_id, "no_instance", "no other decode instance is healthy")
            raise exc from None
        self._metrics.decode_migrations.labels(exc.kind).inc()
        logger.warning(
            "req %s: going on on %s, forced through the %d tokens the client has",
            req_id,
            member.url,
            len(forced),
        )
        return member, forced

    def _refused(self, req_id: str, reason: str, why: str) -> None:
        self._metrics.migrations_refused.labels(reason).inc()
        logger.warning("req %s: its answer cannot go on on another decode: %s", req_id, why)
