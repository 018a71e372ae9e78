"""``routing: cache_aware`` (vllm-router's default policy, for comparison): a prompt that shares
more than 0.3 of itself with what an instance was sent goes there, else to the instance sent
least; a load gap past both balance thresholds sends it to the least loaded; the record is bounded
and forgets an instance the pool dropped."""

from __future__ import annotations

from lmcache_pd.kv_events import prefix_keys
from lmcache_pd.proxy.cache_aware import BALANCE_ABS, BLOCK_TOKENS, SentPrompts
from lmcache_pd.proxy.routing import Pool, Role, Upstream


def pool_of(count: int) -> Pool:
    return Pool(Role.DECODE, [Upstream(f"http://d{i}", Role.DECODE) for i in range(count)])


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def test_a_shared_prefix_over_the_threshold_follows_its_instance_and_others_spread() -> None:
    pool, sent = pool_of(2), SentPrompts(max_blocks=10_000)
    history = prompt(0, 640)
    first = sent.pick(pool, history)
    # A follow-up that extends it (640 of 800 tokens shared) goes where it went...
    assert sent.pick(pool, history + prompt(5_000, 160)) is first
    # ... and so does one that shares 0.4 of itself; control: one that shares 0.2 does not
    # (it goes to the instance sent least).
    assert sent.pick(pool, history[:320] + prompt(6_000, 480)) is first
    other = sent.pick(pool, history[:160] + prompt(7_000, 640))
    assert other is not first
    # A new prompt goes to the instance with the smaller record (``other``: 50 blocks to 80).
    assert sent.blocks(other) < sent.blocks(first)
    assert sent.pick(pool, prompt(9_000, 64)) is other


def test_a_load_gap_past_both_thresholds_goes_to_the_least_loaded() -> None:
    pool, sent = pool_of(2), SentPrompts(max_blocks=10_000)
    history = prompt(0, 640) + prompt(3_000, 320)
    holder = sent.pick(pool, history)
    other = next(m for m in pool.members if m is not holder)
    holder.outstanding = BALANCE_ABS + 1  # more than 64 over the idlest, and 1.5x it
    assert sent.pick(pool, history[:640] + prompt(5_000, 16)) is other
    other.outstanding = BALANCE_ABS  # the gap is 1 now: affinity again, to the longer match
    assert sent.pick(pool, history + prompt(4_000, 16)) is holder


def test_the_record_is_bounded_drops_a_prompts_end_first_and_forgets_a_gone_instance() -> None:
    pool, sent = pool_of(1), SentPrompts(max_blocks=20)
    [member] = pool.members
    sent.pick(pool, prompt(0, 30 * BLOCK_TOKENS))
    assert sent.blocks(member) == 20
    # The prompt's first 20 blocks stayed (its end went first): a prompt sharing them matches.
    assert sent._matched(member, prefix_keys(prompt(0, 20 * BLOCK_TOKENS), BLOCK_TOKENS)) == 20
    pool.replace([Upstream("http://d9", Role.DECODE)])
    sent.pick(pool, prompt(0, BLOCK_TOKENS))
    assert sent.blocks(member) == 0
