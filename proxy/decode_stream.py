"""Decode's answer, asked for at once and read later.

The proxy asks decode as soon as it knows the first token: from prefill's engine directly (a
first-token notice, ``lmcache_pd/first_token.py``) or from prefill's HTTP answer, whichever comes
first. On a notice, decode's request goes out while the first token itself is still on its way
to the client, so the request's first read runs as a task of its own; the answer reads decode's
once it has sent the first token, and keeps it only if prefill's answer names the same prompt and
token (``matches``). Cancelling closes the upstream connection, and vLLM aborts the request.
A stream continued on another decode after one failed (``migration.py``) is one of these too,
with no KV pushed for it and more tokens forced.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from lmcache_pd.protocol import DisaggSpec, KVTransferParams
from lmcache_pd.proxy.client_request import ClientRequest
from lmcache_pd.proxy.routing import Upstream

if TYPE_CHECKING:
    from lmcache_pd.proxy.flow import Disaggregator, Prefilled


class DecodeStream:
    """One decode request: the client's own, its output beginning with the ``forced`` tokens
    (prefill's first token, and after a failed decode what the client has), loading the KV
    pushed under ``spec`` (None: none was pushed to this decode; it computes the prompt)."""

    def __init__(
        self,
        flow: Disaggregator,
        client: ClientRequest,
        member: Upstream,
        req_id: str,
        spec: DisaggSpec | None,
        forced: tuple[int, ...],
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        """Send the request now (it needs a running event loop); ``prompt_token_ids``: the
        prompt's, as prefill gave them (for ``matches``)."""
        self.member, self.spec, self.forced = member, spec, forced
        self.prompt_token_ids = prompt_token_ids
        params = KVTransferParams(
            disagg_spec=spec, first_tok=forced[0] if forced else None, next_toks=forced[1:]
        )
        body = client.decode_body(params)
        self.sent_at = time.time()
        self._batches = flow.relay(member, client, req_id, body)
        self._first = asyncio.get_running_loop().create_task(self._first_batch())

    async def _first_batch(self) -> list[bytes] | None:
        return await anext(self._batches, None)

    def matches(self, prefilled: Prefilled) -> bool:
        """Whether this stream continues the prompt and token of prefill's answer, on the KV of
        the attempt that answered (another's may have been pushed, then dropped)."""
        return (
            (prefilled.first_token,) == self.forced
            and prefilled.prompt_token_ids == self.prompt_token_ids
            and prefilled.spec == self.spec
        )

    async def batches(self) -> AsyncIterator[list[bytes]]:
        """Decode's events' data (or its whole JSON answer), a list per network read; raises
        ``UpstreamRejected`` and ``UpstreamFailed`` as ``Disaggregator.relay`` does."""
        first = await self._first
        if first is None:
            return
        yield first
        async for batch in self._batches:
            yield batch

    async def cancel(self) -> None:
        """Stop reading and close the upstream request (a no-op once it has ended)."""
        self._first.cancel()
        await asyncio.gather(self._first, return_exceptions=True)
        await self._batches.aclose()
