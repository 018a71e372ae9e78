"""Where one request goes: which decode instance, whether it is served there alone, and how
prefill instances are weighed.

With ``routing: kv`` and a KV index that holds anything, the prompt's token ids are looked up in
every instance's prefix cache (``kv_index.py``). Decode is the instance that would compute the
fewest of them, against its load (``routing.py``); if what that instance would still compute is
under ``min_disagg_tokens``, it serves the request alone, however long the prompt (a follow-up
turn whose history it holds); else prefill runs, chosen the same way for its own cache, and
pushes what decode lacks. A conversation stays where its history is without any session id.
Without the index (``routing: load``, no instance publishes, nothing stored yet, or the tokens
cannot be had) the choice is by load alone and the prompt's whole length decides, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from lmcache_pd.kv_events import prefix_keys
from lmcache_pd.proxy.client_request import ClientRequest
from lmcache_pd.proxy.kv_index import KVIndex
from lmcache_pd.proxy.prompt_size import PromptSizer
from lmcache_pd.proxy.prompt_tokens import PromptTokens
from lmcache_pd.proxy.routing import Pool, Upstream


@dataclass(frozen=True, slots=True)
class Plan:
    """One request's placement."""

    decoder: Upstream | None  # None: prefill's one token is the whole answer
    alone: bool  # served by ``decoder`` alone
    # Prompt tokens an instance would compute (None: unknown, pick by load).
    work: Callable[[Upstream], int] | None = None
    prompt_tokens: int | None = None

    def work_at(self, member: Upstream) -> int:
        return 0 if self.work is None else self.work(member)

    def decode_holds(self) -> int:
        """Leading prompt tokens the chosen decode's prefix cache holds (0: unknown)."""
        if self.prompt_tokens is None or self.decoder is None:
            return 0
        return self.prompt_tokens - self.work_at(self.decoder)

    def trace(self) -> dict[str, int]:
        """What the trace file records of the placement."""
        if self.prompt_tokens is None or self.decoder is None:
            return {}
        return {"prompt_tokens": self.prompt_tokens, "decode_held_tokens": self.decode_holds()}


class Placer:
    """Plans each request on the pools' state now."""

    def __init__(
        self,
        decode: Pool,
        sizer: PromptSizer,
        index: KVIndex | None = None,
        tokens: PromptTokens | None = None,
        model: str = "",
    ) -> None:
        """Without ``index`` and ``tokens``: by load, as ``routing: load``."""
        self._decode = decode
        self._sizer = sizer
        self._index = index
        self._tokens = tokens
        self._model = model

    async def plan(self, client: ClientRequest) -> Plan:
        """``NoHealthyInstance`` if decode is needed and none is up."""
        index, token_ids = self._index, None
        if index is not None and self._tokens is not None and not index.empty:
            token_ids = await self._tokens.of(client, self._model)
        if index is None or token_ids is None:
            decoder = self._decode.pick() if client.needs_decode else None
            return Plan(decoder, decoder is not None and self._sizer.is_short(client))
        work = _work(index, token_ids, client.body.get("cache_salt"))
        decoder = self._decode.pick(work=work) if client.needs_decode else None
        alone = decoder is not None and work(decoder) < self._sizer.min_tokens
        return Plan(decoder, alone, work, len(token_ids))


def _work(index: KVIndex, tokens: list[int], salt: object) -> Callable[[Upstream], int]:
    """Prompt tokens each instance would compute: those its prefix cache does not hold (the
    prompt's keys hashed once per block size, looked up once per instance)."""
    salt = salt if isinstance(salt, str) else None
    keys = functools.cache(lambda block_size: prefix_keys(tokens, block_size, salt))
    held: dict[Upstream, int] = {}

    def work(member: Upstream) -> int:
        if member not in held:
            held[member] = index.held_tokens(member, keys)
        return len(tokens) - held[member]

    return work
