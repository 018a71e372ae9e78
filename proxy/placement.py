"""Where one request goes: which decode instance, whether it is served there alone, and how prefill
instances are weighed.

With ``routing: kv`` and a KV index that holds anything, the prompt's token ids are looked up in
every instance's prefix cache (``kv_index.py``). Decode is the instance that would cost least
against its load (``routing.py``): a decode costs as it would be served: the tokens it lacks, where
it would serve the request alone (the rules below), else, through prefill, what the best prefill
lacks plus what decode lacks at ``RECEIVE_DISCOUNT`` (received, not computed); if what the chosen
instance would still compute is under ``min_disagg_tokens``, it serves the request alone, however
long the prompt (a follow-up turn whose history it holds). What decode holds counts its prefix cache
and the run of chunks landed in its consumer that goes on from there, which it loads for a request
it serves alone and which a push to it skips; the blocks prefill is told to skip count its prefix
cache alone. It serves a request alone too when prefill has nothing to spare it: when even the
prefill instance that holds most of the prompt would compute at least ``RECOMPUTE_FACTOR`` times
what decode would, and ``min_disagg_tokens`` more (decode holds a history prefill lost to eviction
or never saw: a conversation's answers, which decode generated). Else prefill runs, chosen the same
way for its own cache, and pushes what decode lacks. A conversation stays where its history is
without any session id. Without the index (``routing: load``, no instance publishes, nothing stored
yet, or the tokens cannot be had) the choice is by load alone and the prompt's whole length decides,
as before; so is a LoRA adapter's request (its blocks are keyed with the adapter). ``routing:
cache_aware`` picks decode as vLLM's own router does (``cache_aware.py``), for comparison.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from dataclasses import dataclass

from lmcache_pd.kv_events import prefix_keys
from lmcache_pd.proxy.cache_aware import SentPrompts
from lmcache_pd.proxy.client_request import ClientRequest
from lmcache_pd.proxy.kv_index import KVIndex
from lmcache_pd.proxy.prompt_size import PromptSizer
from lmcache_pd.proxy.prompt_tokens import PromptTokens
from lmcache_pd.proxy.routing import Pool, Upstream

# Decode serves a request alone, rather than have prefill compute it, when the best prefill would
# compute this many times the tokens decode would (and min_disagg_tokens more): disaggregation
# would then cost more compute than it spares decode, and more time to the first token.
RECOMPUTE_FACTOR = 2
# What a prompt token decode lacks weighs when prefill would push it rather than decode compute
# it: 1/16 of a computed token. Measured here on the tiny model, pushing a token's KV takes
# ~1/100 of computing it (a 2.3k-token first turn: ~400 ms to its first token, 9.4 MB pushed,
# ~3 ms at the 3 GB/s of benchmarks/transfer.py; results/multi_turn-1p2d-small-cache-rate1.json).
# So a decode that holds only a shared prefix (a system prompt) wins a new conversation by
# little, and loses it to one with fewer requests running: a hot prefix does not pile every
# conversation onto its holder at light load. A history decode would serve alone, or prefill
# has lost, still keeps its conversation where it is.
RECEIVE_DISCOUNT = 16


@dataclass(frozen=True, slots=True)
class Plan:
    """One request's placement."""

    decoder: Upstream | None  # None: prefill's one token is the whole answer
    alone: bool  # served by ``decoder`` alone
    # Prompt tokens an instance would compute (None: unknown, pick by load).
    work: Callable[[Upstream], int] | None = None
    prompt_tokens: int | None = None
    # Prompt tokens ``decoder`` computes serving it alone: what neither its prefix cache nor
    # its landed chunks hold (0: unknown, or not alone).
    alone_computes: int = 0
    # Whether decode's KV events show those computed (``KVIndex.holds_last_block``; None:
    # nothing tells): a whole answer has no first event to say it (``Upstream.busy``).
    alone_computed: Callable[[], bool] | None = None

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
        prefill: Pool | None = None,
        sent: SentPrompts | None = None,
    ) -> None:
        """Without ``index`` and ``tokens``: by load, as ``routing: load``; ``model``: the base
        model's name (a request for another names a LoRA adapter); ``prefill``: its
        pool, whose caches weigh for decode alone (None: they do not); ``sent`` (with
        ``tokens``, no ``index``): decode as ``routing: cache_aware`` picks it."""
        self._sent = sent
        self._decode = decode
        self._prefill = prefill
        self._sizer = sizer
        self._index = index
        self._tokens = tokens
        self._model = model

    async def plan(self, client: ClientRequest) -> Plan:
        """``NoHealthyInstance`` if decode is needed and none is up."""
        if client.alone_reason is not None:  # served unchanged by decode, by load
            return Plan(self._decode.pick(), alone=True)
        # A LoRA adapter's request: vLLM mixes the adapter's name into every block's key and
        # publishes it with the block, so its prefix cache is its own here too.
        lora = client.model if client.model != self._model else None
        if self._sent is not None and self._tokens is not None and client.needs_decode:
            token_ids = await self._tokens.of(client, self._model)
            if token_ids is not None:
                decoder = self._sent.pick(self._decode, token_ids, _salt(client), lora)
                return Plan(decoder, self._sizer.is_short(client))
        index, token_ids = self._index, None
        if index is not None and self._tokens is not None and not index.empty:
            token_ids = await self._tokens.of(client, self._model)
        if index is None or token_ids is None:
            decoder = self._decode.pick() if client.needs_decode else None
            return Plan(decoder, decoder is not None and self._sizer.is_short(client))
        # Decode is weighed by what it would compute or receive: chunks landed in its consumer
        # are not pushed again.
        keys = _keys(token_ids, _salt(client), lora)
        work, receive = _work(index, token_ids, keys)
        prefill_least = self._prefill_least(work)

        def cost(member: Upstream) -> int:
            # Alone it computes what it lacks; through prefill it receives that, far cheaper
            # than computing it, while prefill computes what prefill lacks. Each instance is
            # weighed as it would be served: alone only where ``_alone`` would send it alone
            # (a holder of a shared prefix weighed as if alone would win every long new
            # conversation that then goes through prefill anyway).
            alone = receive(member)
            if prefill_least is None or self._alone(alone, prefill_least):
                return alone
            return prefill_least + alone // RECEIVE_DISCOUNT

        decoder = self._decode.pick(work=cost) if client.needs_decode else None
        # Served alone, decode loads its landed chunks too (its consumer's cache).
        computes = 0 if decoder is None else receive(decoder)
        alone = decoder is not None and self._alone(computes, prefill_least)
        if not alone or not computes:
            return Plan(decoder, alone, work, len(token_ids))
        assert decoder is not None
        computed = None
        if not index.holds_last_block(decoder, keys):  # else its events cannot tell
            computed = functools.partial(index.holds_last_block, decoder, keys)
        return Plan(decoder, alone, work, len(token_ids), computes, computed)

    def elsewhere(self, failed: Collection[Upstream]) -> Upstream:
        """Another decode for a request whose decode instances in ``failed`` failed under it
        (``migration.py``), by load: none was pushed its KV, and it computes the prompt.
        ``NoHealthyInstance`` if there is none."""
        return self._decode.pick(exclude=failed)

    def _alone(self, own: int, prefill_least: int | None) -> bool:
        """Whether decode, which would compute ``own`` prompt tokens, serves the request alone:
        they are fewer than ``min_disagg_tokens`` (0: never alone), or every healthy prefill
        instance that publishes its cache would compute (``prefill_least`` at the fewest)
        ``RECOMPUTE_FACTOR`` times as many and ``min_disagg_tokens`` more."""
        threshold = self._sizer.min_tokens
        if own < threshold:
            return True
        if threshold <= 0 or prefill_least is None:
            return False
        return prefill_least >= max(RECOMPUTE_FACTOR * own, own + threshold)

    def _prefill_least(self, work: Callable[[Upstream], int]) -> int | None:
        """The fewest prompt tokens a healthy prefill instance that publishes its cache would
        compute; None if there is none (of the others nothing is known)."""
        members = [] if self._prefill is None else self._prefill.members
        prefill = [m for m in members if m.healthy and m.kv_events is not None]
        return min((work(member) for member in prefill), default=None)


def _salt(client: ClientRequest) -> str | None:
    """The request's ``cache_salt``, which vLLM mixes into its first block's key (None unless it
    is a string)."""
    salt = client.body.get("cache_salt")
    return salt if isinstance(salt, str) else None


def _keys(tokens: list[int], salt: str | None, lora: str | None) -> Callable[[int], list[bytes]]:
    """The prompt's block keys for a block size, hashed once per block size."""
    return functools.cache(lambda block_size: prefix_keys(tokens, block_size, salt, lora))


def _work(
    index: KVIndex, tokens: list[int], keys: Callable[[int], list[bytes]]
) -> tuple[Callable[[Upstream], int], Callable[[Upstream], int]]:
    """Prompt tokens each instance would compute: those its prefix cache does not hold; and
    those it would compute or receive: those neither its prefix cache nor the run of landed
    chunks that goes on from it hold (``keys``: the prompt's). Each instance is looked up once
    (and kept: a plan reads them after the index may have changed)."""
    held: dict[Upstream, int] = {}
    landed: dict[Upstream, int] = {}

    def work(member: Upstream) -> int:
        if member not in held:
            held[member] = index.held_tokens(member, keys)
        return len(tokens) - held[member]

    def receive(member: Upstream) -> int:
        # Past its prefix cache, decode loads the run of landed chunks that goes on from there.
        if member not in landed:
            landed[member] = index.landed_after(member, keys, len(tokens) - work(member))
        return len(tokens) - landed[member]

    return work, receive
