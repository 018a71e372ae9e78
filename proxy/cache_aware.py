"""``routing: cache_aware``: vLLM's own router policy, to compare KV routing against.

vllm-router (and SGLang's gateway, from which it was forked) route by default with
``cache_aware``: each instance keeps a record of the prompts the router sent it; a request goes to
the instance whose record shares the longest prefix with it when that share is above a threshold
(0.3), else to the instance with the smallest record; and once the busiest instance has more than
64 requests over the idlest and 1.5 times as many, to the least loaded instead. The record is the
router's guess of each cache: it never learns what an instance evicted, nor what it holds that the
router did not send it (a pushed prefill, an answer it generated). Its PD mode disaggregates every
request.

This is that policy as we read its documentation (not its code), over token ids rather than text:
the record is the prompt's chained block keys (``kv_events.prefix_keys``, the blocks vLLM would
cache), least recently sent dropped first past ``max_blocks`` an instance. Only decode is chosen
by it; prefill goes by load (the benchmarks' pools have one prefill, where the two agree), and the
prompt's whole length decides whether it is disaggregated (``min_disagg_tokens``), as with
``routing: load``. The proxy's one event loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict

from lmcache_pd.kv_events import prefix_keys
from lmcache_pd.proxy.routing import Pool, Upstream

# vllm-router's defaults for cache_aware (its --cache-threshold, --balance-abs-threshold and
# --balance-rel-threshold).
CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5
# The block the record is kept in: vLLM's default KV block on these instances.
BLOCK_TOKENS = 16


class SentPrompts:
    """What the proxy sent each instance, and the instance ``cache_aware`` picks for a prompt."""

    def __init__(self, max_blocks: int, block_tokens: int = BLOCK_TOKENS) -> None:
        """``max_blocks``: the most block keys kept per instance."""
        self._max_blocks = max_blocks
        self._block_tokens = block_tokens
        self._sent: dict[str, OrderedDict[bytes, None]] = {}

    def pick(
        self, pool: Pool, tokens: list[int], salt: str | None = None, lora: str | None = None
    ) -> Upstream:
        """The instance for ``tokens`` (with the request's ``cache_salt`` and LoRA adapter),
        recorded as sent to it. ``NoHealthyInstance`` if none is up."""
        for gone in self._sent.keys() - {m.url for m in pool.members}:
            del self._sent[gone]  # an instance the pool no longer has
        healthy = [m for m in pool.members if m.healthy]
        if not healthy:
            return pool.pick()  # raises NoHealthyInstance
        keys = prefix_keys(tokens, self._block_tokens, salt, lora)
        loads = [m.outstanding for m in healthy]
        matched = {m: self._matched(m, keys) for m in healthy}
        best = max(matched.values())
        if max(loads) - min(loads) > BALANCE_ABS and max(loads) > BALANCE_REL * min(loads):
            chosen = min(healthy, key=lambda m: m.outstanding)
        elif tokens and best * self._block_tokens / len(tokens) > CACHE_THRESHOLD:
            chosen = next(m for m in healthy if matched[m] == best)
        else:
            chosen = min(healthy, key=lambda m: (self.blocks(m), m.outstanding))
        self._record(chosen, keys)
        return chosen

    def blocks(self, member: Upstream) -> int:
        """Block keys recorded for ``member``."""
        return len(self._sent.get(member.url, ()))

    def _matched(self, member: Upstream, keys: list[bytes]) -> int:
        """Leading blocks of the prompt in ``member``'s record."""
        sent = self._sent.get(member.url, {})
        count = 0
        while count < len(keys) and keys[count] in sent:
            count += 1
        return count

    def _record(self, member: Upstream, keys: list[bytes]) -> None:
        """Keys enter most recent first from the prompt's end, so that its start is the last
        to go, as a radix tree drops leaves before their parents."""
        sent = self._sent.setdefault(member.url, OrderedDict())
        for key in reversed(keys):
            sent[key] = None
            sent.move_to_end(key)
        while len(sent) > self._max_blocks:
            sent.popitem(last=False)
