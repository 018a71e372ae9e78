"""The proxy's KV index: vLLM's own event structs and publisher (with our authenticated sockets)
feeding the index over real ZMQ, the prefix keys the proxy computes from a prompt, and the
placement that reads them. No process is started: the publisher runs on its own thread here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from lmcache_pd.auth import DeploymentKeys, generate_secret
from lmcache_pd.auth import Role as KeyRole
from lmcache_pd.connector.kv_event_publisher import AuthenticatedEventPublisher
from lmcache_pd.harness.model_maker import ensure_model
from lmcache_pd.kv_events import BATCHES, LANDED_MEDIUM, prefix_keys
from lmcache_pd.proxy.client_request import ClientRequest, Endpoint
from lmcache_pd.proxy.config import KVEventsAddress
from lmcache_pd.proxy.kv_feed import REPLAY_TIMEOUT_S, EventFeed
from lmcache_pd.proxy.kv_index import SYNC_INTERVAL_S, KVIndex
from lmcache_pd.proxy.local_tokenizer import LocalTokenizer
from lmcache_pd.proxy.placement import Placer, Plan
from lmcache_pd.proxy.prefix_index import InstanceBlocks
from lmcache_pd.proxy.prompt_size import PromptSizer
from lmcache_pd.proxy.prompt_tokens import PromptTokens
from lmcache_pd.proxy.routing import Pool, Role, Upstream, cost
from tests.helpers import free_port
from tests.vllm_support import MODEL_DIR

BLOCK = 4


def stored(
    hashes: list[int], parent: int | None, tokens: list[int], extra: list | None = None
) -> BlockStored:
    """vLLM's own event for ``hashes`` (one per block of ``tokens``)."""
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BLOCK,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        extra_keys=extra,
    )


def encoded(*events: object) -> bytes:
    """A batch as vLLM's publisher encodes it."""
    return msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=list(events)))


def index_of(*events: object, max_blocks: int = 1000) -> InstanceBlocks:
    blocks = InstanceBlocks(max_blocks)
    for event in BATCHES.decode(encoded(*events)).events:
        blocks.apply(event)
    return blocks


PROMPT = list(range(100, 113))  # three full blocks and one token


def test_a_prompt_is_held_up_to_its_first_missing_block() -> None:
    blocks = index_of(stored([11, 12], None, PROMPT[:8]), stored([13], 12, PROMPT[8:12]))
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK)) == 12
    other = [*PROMPT[:4], 999, *PROMPT[5:]]  # differs in the second block
    assert blocks.held_tokens(prefix_keys(other, BLOCK)) == 4
    assert blocks.held_tokens(prefix_keys([7, *PROMPT], BLOCK)) == 0  # same tokens, shifted


def test_removed_and_cleared_blocks_are_not_held() -> None:
    blocks = index_of(stored([11, 12, 13], None, PROMPT[:12]), BlockRemoved([12], "CPU"))
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK)) == 4
    blocks.apply(BATCHES.decode(encoded(AllBlocksCleared())).events[0])
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK)) == 0 and len(blocks) == 0


def test_a_salted_prefix_is_held_for_its_salt_only() -> None:
    blocks = index_of(stored([11, 12], None, PROMPT[:8], extra=[("tenant-a",), None]))
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK, salt="tenant-a")) == 8
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK)) == 0
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK, salt="tenant-b")) == 0


def test_an_adapters_prefix_is_held_for_that_adapter_only() -> None:
    """vLLM 0.32 publishes a LoRA request's blocks with the adapter's name first among every
    block's extra keys, then the cache_salt on the first (``to_event_extra_keys``)."""
    blocks = index_of(stored([11, 12], None, PROMPT[:8], extra=[("tuned", "s"), ("tuned",)]))
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK, salt="s", lora="tuned")) == 8
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK, salt="s")) == 0  # the base model's
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK, salt="s", lora="other")) == 0
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK, lora="tuned")) == 0  # unsalted


def test_a_block_whose_parent_was_never_seen_is_not_indexed() -> None:
    blocks = index_of(stored([13], 12, PROMPT[8:12]))
    assert len(blocks) == 0 and blocks.orphans == 1


def test_the_index_forgets_its_oldest_blocks_past_its_bound() -> None:
    blocks = index_of(stored([11, 12, 13], None, PROMPT[:12]), max_blocks=2)
    assert len(blocks) == 2 and blocks.evicted == 1
    # The first block went: the prompt is held from nowhere on.
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK)) == 0


def test_a_batch_whose_tokens_do_not_fit_its_blocks_is_refused() -> None:
    with pytest.raises(ValueError, match="carries 3 token ids"):
        index_of(stored([11], None, PROMPT[:3]))


# ---- the feed, over vLLM's publisher with our sockets ----


def role_keys() -> tuple[DeploymentKeys, DeploymentKeys]:
    """A fresh deployment's keys as the proxy holds them, and as an instance (its publisher)."""
    secret = generate_secret()
    return (
        DeploymentKeys.from_secret(secret, KeyRole.PROXY),
        DeploymentKeys.from_secret(secret, KeyRole.PRODUCER),
    )


class LateReplays(AuthenticatedEventPublisher):
    """vLLM's publisher whose replays go unanswered while ``late`` is set, as one whose engine
    is too busy to answer before it is restarted."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.late = threading.Event()
        super().__init__(*args, **kwargs)

    def _service_replay(self) -> None:
        if not self.late.is_set():
            super()._service_replay()
            return
        assert self._replay is not None
        self._replay.recv_multipart()  # asked; the answer would come later, if ever


@contextlib.contextmanager
def publisher(
    address: KVEventsAddress,
    keys: DeploymentKeys | None,
    kind: type[AuthenticatedEventPublisher] = AuthenticatedEventPublisher,
) -> Iterator[object]:
    published = kind(
        0,
        endpoint=address.endpoint(address.port),
        replay_endpoint=address.endpoint(address.replay_port),
        keys=keys,
    )
    try:
        yield published
    finally:
        published.shutdown()


@contextlib.contextmanager
def rebound(address: KVEventsAddress, keys: DeploymentKeys | None) -> Iterator[object]:
    """A publisher on the ports one just closed: ZMQ lets them go in the background."""
    deadline = time.monotonic() + 5
    while True:
        try:
            published = publisher(address, keys)
            pub = published.__enter__()
            break
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    try:
        yield pub
    finally:
        published.__exit__(None, None, None)


def follow(
    address: KVEventsAddress,
    keys: DeploymentKeys | None,
    steps: list,
    settle_s: float = 0.5,
) -> tuple[InstanceBlocks, dict[str, int]]:
    """Run a feed while ``steps`` (callables) run, each followed by a pause; what it indexed."""
    counts: dict[str, int] = {}

    async def run() -> InstanceBlocks:
        import zmq.asyncio

        context = zmq.asyncio.Context()
        blocks = InstanceBlocks(1000)
        feed = EventFeed(
            context,
            "test",
            address,
            keys,
            blocks,
            lambda w: counts.update({w: counts.get(w, 0) + 1}),
        )
        feed.start()
        try:
            for step in steps:  # off the loop, as an instance runs beside the proxy
                await asyncio.to_thread(step)
                await asyncio.sleep(settle_s)
        finally:
            await feed.stop()
            context.destroy(linger=0)
        return blocks

    return asyncio.run(run()), counts


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=1.0, events=list(events))


def test_a_late_subscriber_gets_earlier_events_by_replay() -> None:
    keys, instance = role_keys()
    address = KVEventsAddress("127.0.0.1", free_port(), free_port())
    with publisher(address, instance) as pub:
        pub.publish(batch(stored([11, 12], None, PROMPT[:8])))  # before anyone subscribed
        later = batch(stored([13], 12, PROMPT[8:12]))
        # The first pause lets the subscription connect (ZMQ's slow joiner).
        blocks, counts = follow(address, keys, [lambda: None, lambda: pub.publish(later)])
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK)) == 12
    assert counts["resyncs"] == 1 and counts["batches"] == 2


def test_a_subscriber_without_the_secret_hears_nothing() -> None:
    _, instance = role_keys()
    stranger, _ = role_keys()
    address = KVEventsAddress("127.0.0.1", free_port(), free_port())
    with publisher(address, instance) as pub:
        blocks, counts = follow(
            address,
            stranger,
            [lambda: pub.publish(batch(stored([11, 12], None, PROMPT[:8])))] * 2,
        )
    assert len(blocks) == 0 and "batches" not in counts
    assert counts["handshakes_refused"] >= 1  # said as a refusal, not as silence


def test_an_event_the_index_cannot_take_is_skipped_and_the_feed_goes_on() -> None:
    """A token id past 64 bits raised OverflowError in the index, which ended the feed's task
    (only ZMQ errors were caught): its instance's index froze. Now that event is counted and
    skipped, the rest of its batch applied, and later batches too."""
    keys, instance = role_keys()
    address = KVEventsAddress("127.0.0.1", free_port(), free_port())
    hostile = stored([99], None, [2**63, 1, 2, 3])
    with publisher(address, instance) as pub:
        blocks, counts = follow(
            address,
            keys,
            [
                lambda: None,
                lambda: pub.publish(batch(hostile, stored([11, 12], None, PROMPT[:8]))),
                lambda: pub.publish(batch(stored([13], 12, PROMPT[8:12]))),
            ],
        )
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK)) == 12
    assert counts["malformed"] == 1 and counts["batches"] == 2


def test_a_feed_that_ends_is_followed_anew_within_one_sync(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A feed whose task ends on an error (a bug of ours, here) clears its instance's index at
    once (never routing by blocks it can no longer see go), and the next sync follows the
    instance anew: its replay rebuilds the index, and routing reads it again."""
    keys, instance = role_keys()
    address = KVEventsAddress("127.0.0.1", free_port(), free_port())
    member = Upstream("http://d0", Role.DECODE, kv_events=address)
    real = EventFeed._on_batch
    failures = [RuntimeError("a bug")]

    async def once_broken(feed: EventFeed, seq: int, payload: bytes) -> None:
        if failures and seq == 1:
            raise failures.pop()
        await real(feed, seq, payload)

    monkeypatch.setattr(EventFeed, "_on_batch", once_broken)

    def held(index: KVIndex) -> int:
        return index.held_tokens(member, lambda size: prefix_keys(PROMPT, size))

    async def run(pub: object) -> list[int]:
        index = KVIndex(lambda: [member], keys, 1000)
        await index.sync()
        await asyncio.sleep(0.5)  # the subscription connects (ZMQ's slow joiner)
        pub.publish(batch(stored([11, 12, 13], None, PROMPT[:12])))  # seq 0
        await until(lambda: held(index) == 12, "the first batch indexed")
        pub.publish(batch(stored([21], None, PROMPT[:4])))  # seq 1: the feed fails on it
        await until(lambda: held(index) == 0, "the failed feed's index cleared")
        assert index.counts["feed_errors"] == 1
        await index.sync()
        await until(lambda: held(index) == 12, "the index rebuilt by the new feed's replay")
        seen = [index.counts["feed_restarts"], held(index)]
        await index.close()
        return seen

    with publisher(address, instance) as pub:
        assert asyncio.run(run(pub)) == [1, 12]


def test_a_restarted_instance_reenters_the_index_within_one_resync() -> None:
    keys, instance = role_keys()
    address = KVEventsAddress("127.0.0.1", free_port(), free_port())
    with contextlib.ExitStack() as running:

        def start() -> None:
            pub = running.enter_context(publisher(address, instance))
            time.sleep(0.3)  # the subscription connects (ZMQ's slow joiner)
            for _ in range(3):  # seq 0-2: the whole prompt, announced three times
                pub.publish(batch(stored([11, 12, 13], None, PROMPT[:12])))

        def restart() -> None:
            running.close()  # the instance dies with its cache
            pub = running.enter_context(rebound(address, instance))
            time.sleep(0.3)
            pub.publish(batch(stored([21], None, PROMPT[:4])))  # seq 0 of the new one

        blocks, counts = follow(address, keys, [lambda: None, start, restart])
    assert blocks.held_tokens(prefix_keys(PROMPT, BLOCK)) == 4, "old blocks gone, new indexed"
    assert counts["reconnects"] == 1


def test_an_instance_restarted_while_a_replay_is_late_is_routed_by_its_new_cache() -> None:
    """Decode ``d0``'s publisher loses batches (its numbers jump), so the feed asks a replay,
    which the busy publisher does not answer; meanwhile it publishes a hundred more batches
    (its instance is about to go: they are stale) and restarts: a new publisher on the same
    address, holding another prompt, published before the subscription found it (in its replay
    only). Within one resync interval of the restart, and before the late replay would have
    timed out, the index holds the new publisher's blocks and none of the old one's, checked by
    what it routes: the new prompt goes to ``d0`` alone, the stale one is not held there.
    Before: the late replay held the feed for its whole timeout, and the old publisher's last
    batches, read after the new publisher's replay, were taken for a gap in the new numbering:
    the index kept the dead instance's blocks and lacked the new ones until the new instance
    published again (seen: routed to ``d1``)."""
    keys = instance = None  # on loopback; the sockets' keys are not what is tested here
    addresses = [KVEventsAddress("127.0.0.1", free_port(), free_port()) for _ in range(2)]
    members = [Upstream(f"http://d{i}", Role.DECODE, kv_events=a) for i, a in enumerate(addresses)]
    d0 = members[0]
    old_prompt, stale_prompt, new_prompt = (list(range(n, n + 240)) for n in (500, 2000, 4000))

    def held(index: KVIndex, prompt: list[int]) -> int:
        return index.held_tokens(d0, lambda size: prefix_keys(prompt, size))

    async def routes(placer: Placer) -> tuple[Plan, Plan]:
        return (
            await placer.plan(completion([*new_prompt, 1, 2])),
            await placer.plan(completion([*stale_prompt, 1, 2])),
        )

    async def run(running: contextlib.ExitStack, old: LateReplays) -> tuple[Plan, Plan, float]:
        index = KVIndex(lambda: members, keys, 1000)
        await index.sync()
        await until(lambda: index.counts.get("resyncs", 0) >= 2, "both subscriptions connected")
        old.publish(batch(stored(list(range(1, 61)), None, old_prompt)))  # seq 0
        await until(lambda: held(index, old_prompt) == 240, "the old prompt indexed")
        old.late.set()
        old._seq_gen = itertools.count(5)  # batches 1-4 lost: the feed asks them of it
        old.publish(batch(stored([61], 60, [9, 9, 9, 9])))  # seq 5
        asked = time.monotonic()
        await asyncio.sleep(0.3)
        for _ in range(100):  # seq 6-105: a busy engine's steps, more than a turn of the feed
            old.publish(batch(stored(list(range(101, 161)), None, stale_prompt)))
        await asyncio.sleep(0.3)
        await asyncio.to_thread(running.close)  # the instance dies with its cache
        new = await asyncio.to_thread(running.enter_context, rebound(addresses[0], instance))
        new.publish(batch(stored(list(range(201, 261)), None, new_prompt)))  # its seq 0
        restarted = time.monotonic()
        tokens = PromptTokens(None, lambda: members, {}, 1.0)
        placer = Placer(Pool(Role.DECODE, members), PromptSizer(8, None), index, tokens, "m")
        # Routed as the new instance's cache says once it is right, and for good: at the end
        # of one resync interval (a stale batch read later would undo it).
        took = float("inf")
        while time.monotonic() < restarted + SYNC_INTERVAL_S:
            plans = await routes(placer)
            right = plans[0].alone and plans[1].decode_holds() == 0
            if right and held(index, old_prompt) == 0:
                took = min(took, time.monotonic() - restarted)
            await asyncio.sleep(0.02)
        plans = await routes(placer)
        await index.close()
        return (*plans, restarted + took - asked)

    with contextlib.ExitStack() as stack, contextlib.ExitStack() as running:
        stack.enter_context(publisher(addresses[1], instance))
        old = running.enter_context(publisher(addresses[0], instance, LateReplays))
        new_route, stale_route, recovered = asyncio.run(run(running, old))
    assert new_route.decoder is d0 and new_route.alone, "the new instance's prompt, held there"
    assert new_route.decode_holds() == 240
    assert stale_route.decode_holds() == 0, "the dead instance's last blocks are not held"
    # Given up at the restart, not held for the late replay's whole timeout.
    assert recovered < REPLAY_TIMEOUT_S


# ---- placement ----


def upstream(name: str, outstanding: int = 0) -> Upstream:
    member = Upstream(f"http://{name}", Role.DECODE)
    member.outstanding = outstanding
    return member


def test_the_instance_holding_the_prompt_is_chosen() -> None:
    a, b = upstream("a"), upstream("b")
    pool = Pool(Role.DECODE, [a, b])
    work = {a: 1000, b: 40}  # b holds all but 40 of the prompt's tokens
    assert [pool.pick(work=work.__getitem__) for _ in range(4)] == [b] * 4


def test_a_hot_prefix_spreads_once_its_instance_is_loaded() -> None:
    a, b = upstream("a", outstanding=4), upstream("b", outstanding=1)
    pool = Pool(Role.DECODE, [a, b])
    # a holds the prompt, but has more than twice b's requests (and two more): b gets it.
    assert pool.pick(work={a: 0, b: 3000}.__getitem__) is b
    a.outstanding = 3  # within the bound: a again
    assert pool.pick(work={a: 0, b: 3000}.__getitem__) is a


def test_load_weighs_against_held_tokens() -> None:
    a, b = upstream("a", outstanding=2), upstream("b")
    a.queued_tokens = 2000  # a is busy computing other prompts
    work = {a: 0, b: 600}.__getitem__
    assert cost(a, work) > cost(b, work)
    assert Pool(Role.DECODE, [a, b]).pick(work=work) is b


def test_a_request_weighs_its_prompt_as_queued_only_until_its_first_token() -> None:
    """Prompt tokens an instance computes count against it while they are computed; an answer
    that is streaming counts as one outstanding request, no more (a holder of a conversation
    must not lose it for a prompt it finished computing)."""
    a = upstream("a")
    with a.busy(500) as computed:
        assert (a.outstanding, a.queued_tokens) == (1, 500)
        computed()
        computed()  # said twice: taken off once
        assert (a.outstanding, a.queued_tokens) == (1, 0)
    assert (a.outstanding, a.queued_tokens) == (0, 0)
    with a.busy(300):  # never said: taken off at the end
        assert a.queued_tokens == 300
    assert (a.outstanding, a.queued_tokens) == (0, 0)


def test_a_whole_answer_served_alone_weighs_its_prompt_only_until_decode_computed_it() -> None:
    """A request decode serves alone weighs its prompt on decode until the prompt is computed,
    which a stream's first event says. A whole (non-streamed) answer has no first event, and
    vLLM sends its headers only at its end: it weighed until its answer ended, seconds of
    decoding after. Now until decode's KV events show the prompt's last full block stored
    (vLLM stores a block when it schedules the step that computes it and publishes the step's
    events when the step is done), or the answer ends. Over real HTTP to a stand-in decode
    whose answer takes 3 s, and vLLM's publisher for its events; the control: before the
    events, the prompt weighs."""
    import httpx

    from lmcache_pd.harness.app_thread import AppThread
    from lmcache_pd.harness.standin import Standin, StandinState
    from lmcache_pd.proxy.app import Proxy
    from lmcache_pd.proxy.config import proxy_config
    from lmcache_pd.proxy.routing import TOKENS_PER_OUTSTANDING
    from tests.helpers import metric_sample, wait_for

    address = KVEventsAddress("127.0.0.1", free_port(), free_port())
    prefill_port, decode_port = free_port(), free_port()
    decode = Standin(StandinState(first_delay_s=3.0))
    prompt = list(range(100, 140))  # ten blocks of 4, under min_disagg_tokens: served alone
    events = {"host": "127.0.0.1", "port": address.port, "replay_port": address.replay_port}
    config = proxy_config(
        {
            "model": "tiny",
            "port": free_port(),
            "min_disagg_tokens": 100,
            "prefill": [{"url": f"http://127.0.0.1:{prefill_port}"}],
            "decode": [
                {
                    "url": f"http://127.0.0.1:{decode_port}",
                    "receiver_host": "127.0.0.1",
                    "init_port": 1,
                    "alloc_port": 2,
                    "kv_events": events,
                }
            ],
        }
    )
    proxy = Proxy(config)
    answers: list[httpx.Response] = []
    with contextlib.ExitStack() as running:
        pub = running.enter_context(publisher(address, None))
        running.enter_context(AppThread(Standin().app(), "127.0.0.1", prefill_port))
        running.enter_context(AppThread(decode.app(), "127.0.0.1", decode_port))
        url = running.enter_context(AppThread(proxy.app(), "127.0.0.1", config.port, 20)).url
        [member] = proxy.decode.members
        pub.publish(batch(stored([1], None, [7, 7, 7, 7])))  # the index holds something
        wait_for(
            lambda: metric_sample(url, "lmcache_pd_proxy_kv_index_blocks", instance=member.url),
            5,
            "decode's first block indexed",
        )
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4}
        ask = functools.partial(httpx.post, f"{url}/v1/completions", json=body, timeout=30)
        asking = threading.Thread(target=lambda: answers.append(ask()))
        asking.start()
        wait_for(lambda: decode.state.in_flight == 1, 5, "decode serving it")

        def weighs() -> int:  # read from here: no other request runs meanwhile
            return cost(member, lambda _: 0) - TOKENS_PER_OUTSTANDING

        assert weighs() == 40  # its prompt, still being computed
        pub.publish(batch(stored(list(range(11, 21)), None, prompt)))  # decode computed it
        wait_for(lambda: weighs() == 0, 2, "the computed prompt to weigh no more")
        assert decode.state.in_flight == 1  # while its answer is still to come
        asking.join(10)
    assert [answer.status_code for answer in answers] == [200]


def test_without_a_work_measure_the_pick_is_least_outstanding_round_robin() -> None:
    a, b = upstream("a"), upstream("b")
    pool = Pool(Role.DECODE, [a, b])
    assert [pool.pick() for _ in range(4)] == [a, b, a, b]


async def until(condition: Callable[[], bool], what: str, timeout_s: float = 5.0) -> None:
    """Poll ``condition`` on the running loop (the feeds run on it) until true, or fail."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.01)


def completion(tokens: list[int]) -> ClientRequest:
    """A client's completions request for ``tokens``, as the proxy parses it."""
    body = {"model": "m", "prompt": tokens, "max_tokens": 4}
    return ClientRequest.from_json(Endpoint.COMPLETIONS, msgspec.json.encode(body))


def test_placement_sends_a_prompt_decode_mostly_holds_to_decode_alone() -> None:
    """Two decode instances publishing over real sockets; one holds 240 of a prompt's 246.
    With ``min_disagg_tokens`` 8, the prompt goes to it alone; one it holds less of goes
    through prefill; and with no index (``routing: load``) the holder is not preferred."""
    keys, instance = role_keys()
    addresses = [KVEventsAddress("127.0.0.1", free_port(), free_port()) for _ in range(2)]
    members = [Upstream(f"http://d{i}", Role.DECODE, kv_events=a) for i, a in enumerate(addresses)]
    held = list(range(500, 740))  # 60 blocks of 4: more than a running request weighs

    async def run() -> list[Plan]:
        index = KVIndex(lambda: members, keys, 1000)
        await index.sync()
        # Each subscription's first connection asks a replay: both connected, then indexed.
        await until(lambda: index.counts.get("resyncs", 0) >= 2, "both subscriptions connected")
        pubs[1].publish(batch(stored(list(range(1, 61)), None, held)))
        await until(lambda: not index.empty, "the holder's blocks indexed")
        placer_tokens = PromptTokens(None, lambda: members, {}, 1.0)  # token ids: no call
        placer = Placer(Pool(Role.DECODE, members), PromptSizer(8, None), index, placer_tokens, "m")
        by_load = Placer(Pool(Role.DECODE, members), PromptSizer(8, None))
        plans = [
            await placer.plan(completion([*held, 1, 2, 3, 4, 5, 6])),
            await placer.plan(completion([*held[:8], *range(900, 922)])),
            await by_load.plan(completion([*held, 1, 2, 3, 4, 5, 6])),
        ]
        await index.close()
        return plans

    with contextlib.ExitStack() as stack:
        pubs = [stack.enter_context(publisher(a, instance)) for a in addresses]
        alone, through_prefill, by_load = asyncio.run(run())
    assert alone.decoder is members[1] and alone.alone
    assert alone.trace() == {"prompt_tokens": 246, "decode_held_tokens": 240}
    assert alone.decode_holds() == 240  # what the DisaggSpec tells prefill it need not push
    assert alone.alone_computes == 6  # what weighs on it as queued until its first token
    assert not through_prefill.alone and through_prefill.alone_computes == 0
    assert by_load.decoder is members[0] and not by_load.alone  # 246 tokens: not short
    assert by_load.decode_holds() == 0  # unknown: prefill pushes every chunk


def test_token_ids_are_their_own_prompt_one_token_or_a_batch_of_one() -> None:
    """A prompt of one token id is that id (it once was taken for a batch of one, and its
    bare id sent to an instance's /tokenize, which refused it); a batch of one prompt is that
    prompt. No instance is asked: none is given."""
    tokens = PromptTokens(None, lambda: [], {}, 1.0)

    async def ids(prompt: object) -> list[int] | None:
        body = msgspec.json.encode({"model": "m", "prompt": prompt, "max_tokens": 4})
        request = ClientRequest.from_json(Endpoint.COMPLETIONS, body)
        return await tokens.of(request, "m")

    async def run() -> list[list[int] | None]:
        return [await ids(p) for p in ([1472], [[1472, 5]], [7, 8], "text")]

    assert asyncio.run(run()) == [[1472], [1472, 5], [7, 8], None]


def test_a_prompt_vllm_truncates_has_no_known_ids_and_is_routed_by_load() -> None:
    """vLLM computes the last (or first) ``truncate_prompt_tokens`` of a prompt: its uncut ids
    named blocks of another prompt, and the index could say decode held blocks it lacks (and
    prefill skip pushing them). Control: the same prompt uncut is its own ids."""
    tokens = PromptTokens(None, lambda: [], {}, 1.0)

    async def ids(**fields: object) -> list[int] | None:
        body = msgspec.json.encode({"model": "m", "prompt": [7, 8, 9], **fields})
        return await tokens.of(ClientRequest.from_json(Endpoint.COMPLETIONS, body), "m")

    assert asyncio.run(ids(truncate_prompt_tokens=2)) is None
    assert asyncio.run(ids(truncate_prompt_tokens=2, truncation_side="right")) is None
    assert asyncio.run(ids()) == [7, 8, 9]


# ---- the proxy's own tokenizer ----


def test_the_proxys_tokenizer_renders_plain_prompts_and_leaves_the_rest_to_an_instance() -> None:
    """Text and plain chats are tokenized here, as vLLM serves them (its chat template, no
    second BOS); what only vLLM renders alike (tools, a template of the request's, non-text
    content), anything malformed, and a model whose files are not here: None."""
    local = LocalTokenizer.load(str(ensure_model(MODEL_DIR)))
    assert local is not None
    text = local.text("def main():", True)
    assert text is not None and text[0] == 0 and len(text) > 2  # BOS first
    assert local.text("def main():", False) == text[1:]
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    ids = local.chat({"messages": chat})
    assert ids is not None and ids.count(0) == 1  # the template's one BOS
    assert local.chat({"messages": chat, "add_generation_prompt": False}) != ids
    for odd in (
        {"messages": chat, "tools": []},
        {"messages": chat, "chat_template": "{{ messages }}"},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"messages": [{"role": "user", "content": "hi", "name": "x"}]},
        {"messages": "hello"},
        {"messages": chat, "chat_template_kwargs": "x"},
        {"messages": chat, "add_special_tokens": "yes"},
    ):
        assert local.chat(odd) is None, odd
    assert local.text(["a"], True) is None
    assert LocalTokenizer.load("/nowhere/model") is None


def test_a_prompt_prefill_would_recompute_goes_to_the_decode_holding_it_alone() -> None:
    """Decode holds 24 of a prompt's 38 tokens: 14 to compute, over ``min_disagg_tokens`` 8. A
    prefill holding none would compute all 38 (more than twice as many): decode serves it alone.
    The control: a prefill that holds the same 24 tokens gets it (through prefill, as before);
    so does one that publishes nothing (nothing known of its cache)."""
    keys, instance = role_keys()
    addresses = [KVEventsAddress("127.0.0.1", free_port(), free_port()) for _ in range(3)]
    decode = Upstream("http://d0", Role.DECODE, kv_events=addresses[0])
    cold, warm = (
        Upstream(f"http://p{i}", Role.PREFILL, kv_events=a) for i, a in enumerate(addresses[1:])
    )
    silent = Upstream("http://p9", Role.PREFILL)
    held = list(range(500, 524))  # six blocks of 4
    prompt = [*held, *range(900, 914)]
    client = completion(prompt)

    async def run() -> list[Plan]:
        members = [decode, cold, warm]
        index = KVIndex(lambda: members, keys, 1000)
        await index.sync()
        await until(lambda: index.counts.get("resyncs", 0) >= 3, "every subscription connected")
        for pub in (pubs[0], pubs[2]):  # decode and the warm prefill hold the 24 tokens
            pub.publish(batch(stored(list(range(1, 7)), None, held)))
        await until(
            lambda: (
                len(list(index.by_instance())) == 3
                and all(len(blocks) == 6 for url, blocks in index.by_instance() if url != cold.url)
            ),
            "decode's and the warm prefill's blocks indexed",
        )
        tokens = PromptTokens(None, lambda: members, {}, 1.0)
        plans = [
            await Placer(Pool(Role.DECODE, [decode]), PromptSizer(8, None), index, tokens, "m",
                         Pool(Role.PREFILL, prefill)).plan(client)
            for prefill in ([cold], [warm], [cold, warm], [silent])
        ]  # fmt: skip
        await index.close()
        return plans

    with contextlib.ExitStack() as stack:
        pubs = [stack.enter_context(publisher(a, instance)) for a in addresses]
        by_cold, by_warm, by_both, by_silent = asyncio.run(run())
    assert by_cold.alone and by_cold.decoder is decode
    assert not by_warm.alone and by_warm.decode_holds() == 24
    assert not by_both.alone  # the warm one would compute as little as decode
    assert not by_silent.alone


def test_a_shared_prefix_alone_does_not_pile_new_conversations_onto_its_holder() -> None:
    """Decode ``a`` and the prefill hold a 200-token shared prefix (a system prompt), decode
    ``b`` nothing. A new conversation (the prefix and 40 new tokens) goes through prefill either
    way, so ``a``'s holding spares only a push (a prompt token received weighs
    1/``RECEIVE_DISCOUNT`` of one computed), less than a running request weighs: idle, the two
    are equals and take turns; ``b`` gets it once ``a`` has one more request running. The
    controls: a follow-up ``a`` would serve alone (it holds all but 4 of 804 tokens; prefill
    lost all but the shared 200) stays on ``a`` with two more running; and with the old
    weighing (every lacking token as if computed) ``a`` kept every new conversation (fails
    with ``RECEIVE_DISCOUNT`` 1: tried), and weighed as if alone it kept every long one (fails
    without ``_alone`` in the cost: tried)."""
    keys, instance = role_keys()
    addresses = [KVEventsAddress("127.0.0.1", free_port(), free_port()) for _ in range(3)]
    a, b = (Upstream(f"http://d{i}", Role.DECODE, kv_events=addresses[i]) for i in (0, 1))
    prefill = Upstream("http://p0", Role.PREFILL, kv_events=addresses[2])
    members = [a, b, prefill]
    shared = list(range(1000, 1200))  # 50 blocks of 4
    history = [*shared, *range(2000, 2600)]  # a's conversation so far: 200 blocks

    async def run() -> list[Plan]:
        index = KVIndex(lambda: members, keys, 1000)
        await index.sync()
        await until(lambda: index.counts.get("resyncs", 0) >= 3, "every subscription connected")
        pubs[0].publish(batch(stored(list(range(1, 201)), None, history)))
        pubs[2].publish(batch(stored(list(range(1, 51)), None, shared)))
        held = {a.url: 200, b.url: 0, prefill.url: 50}
        await until(
            lambda: {url: len(blocks) for url, blocks in index.by_instance()} == held,
            "a's and prefill's blocks indexed",
        )
        tokens = PromptTokens(None, lambda: members, {}, 1.0)
        placer = Placer(
            Pool(Role.DECODE, [a, b]), PromptSizer(8, None), index, tokens, "m",
            Pool(Role.PREFILL, [prefill]),
        )  # fmt: skip
        new_chat = completion([*shared, *range(5000, 5040)])
        plans = [await placer.plan(new_chat), await placer.plan(new_chat)]  # both idle
        # A long new conversation: ``a`` alone would compute less than either through prefill,
        # but it is not sent alone, so its holding spares it only a push, as above.
        long_chat = completion([*shared, *range(6000, 7200)])
        plans += [await placer.plan(long_chat), await placer.plan(long_chat)]
        a.outstanding = 1
        plans.append(await placer.plan(new_chat))
        a.outstanding = 2
        plans.append(await placer.plan(completion([*history, 7, 8, 9, 10])))
        await index.close()
        return plans

    with contextlib.ExitStack() as stack:
        pubs = [stack.enter_context(publisher(address, instance)) for address in addresses]
        idle, again, long_idle, long_again, busier, follow_up = asyncio.run(run())
    assert (idle.decoder, again.decoder) == (a, b) and not idle.alone  # equals: round-robin
    assert (long_idle.decoder, long_again.decoder) == (a, b) and not long_idle.alone
    assert busier.decoder is b and not busier.alone
    assert follow_up.decoder is a and follow_up.alone


@pytest.mark.parametrize("past_a_prefix", [False, True], ids=["from_the_start", "past_a_prefix"])
def test_decode_is_chosen_and_served_alone_for_the_chunks_landed_in_it(past_a_prefix: bool) -> None:
    """Two idle decode instances; one's consumer holds a chunk of 240 tokens of a prompt landed,
    and the rest is 6 tokens. It is chosen, and serves the request alone (it would compute 6,
    under ``min_disagg_tokens`` 8: it loads the rest from its landed chunks); what prefill would
    be told to skip is its prefix cache's. From the start: the chunk is the prompt's first, and
    no prefix cache holds any of it. Past a prefix: the chunk is the second, landed without its
    parent (a push skipped the first, which both decode instances' prefix caches hold). The
    control: the same chunk landed on the other instance moves the choice."""
    keys, instance = role_keys()
    size = 240
    first = list(range(500, 500 + size))
    prompt = [*first, *range(900, 900 + size + 6)] if past_a_prefix else [*first, *range(6)]
    chunk_keys = prefix_keys(prompt, size)
    index_of_chunk = 1 if past_a_prefix else 0
    landed = BlockStored(
        block_hashes=[chunk_keys[index_of_chunk]],
        parent_block_hash=chunk_keys[0] if past_a_prefix else None,
        token_ids=prompt[index_of_chunk * size : (index_of_chunk + 1) * size],
        block_size=size,
        lora_id=None,
        medium=LANDED_MEDIUM,
        lora_name=None,
    )
    held_prefix = stored(list(range(size // BLOCK)), None, first)
    client = completion(prompt)

    def plan_with_chunks_on(holder: int) -> tuple[Plan, str]:
        addresses = [KVEventsAddress("127.0.0.1", free_port(), free_port()) for _ in range(3)]
        decode = [Upstream(f"http://d{i}", Role.DECODE, kv_events=addresses[i]) for i in (0, 1)]
        prefill = Upstream("http://p0", Role.PREFILL, kv_events=addresses[2])
        members = [*decode, prefill]

        async def run() -> list[Plan]:
            index = KVIndex(lambda: members, keys, 1000)
            await index.sync()
            await until(lambda: index.counts.get("resyncs", 0) >= 3, "subscriptions connected")
            if past_a_prefix:
                for pub in pubs[:2]:
                    pub.publish(batch(held_prefix))
            pubs[holder].publish(batch(landed))
            pubs[2].publish(batch(stored([1], None, list(range(4)))))  # prefill holds some
            await until(
                lambda: (
                    dict((u, len(c.landed)) for u, c in index.by_instance())[decode[holder].url]
                    == 1
                    and all(
                        len(c.prefix) == past_a_prefix * size // BLOCK
                        for u, c in index.by_instance()
                        if u != prefill.url
                    )
                ),
                "the landed chunk indexed",
            )
            tokens = PromptTokens(None, lambda: members, {}, 1.0)
            placer = Placer(
                Pool(Role.DECODE, decode), PromptSizer(8, None), index, tokens, "m",
                Pool(Role.PREFILL, [prefill]),
            )  # fmt: skip
            plans = [await placer.plan(client) for _ in range(2)]
            await index.close()
            return plans

        with contextlib.ExitStack() as stack:
            pubs = [stack.enter_context(publisher(a, instance)) for a in addresses]
            plans = asyncio.run(run())
        assert plans[0].decoder is plans[1].decoder  # no round-robin between the two
        assert plans[0].decoder is not None
        return plans[0], plans[0].decoder.url

    (on_d1, url1), (_, url0) = plan_with_chunks_on(1), plan_with_chunks_on(0)
    assert (url1, url0) == ("http://d1", "http://d0")
    assert on_d1.alone and on_d1.decode_holds() == (size if past_a_prefix else 0)
    assert on_d1.alone_computes == 6  # the landed chunk is loaded, not computed


def test_kv_events_published_beyond_loopback_without_a_secret_are_said_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """They carry every cached prompt's token ids: a SECURITY warning naming the address, and
    True (the connector shows it as ``kv_events_unauthenticated`` 1). The controls: with the
    secret, or on loopback, neither."""
    from lmcache_pd.connector import kv_event_publisher
    from lmcache_pd.connector.counters import GAUGES

    _, instance = role_keys()
    with caplog.at_level("INFO"):
        assert kv_event_publisher.install(None, ("tcp://*:5557", None))
    assert "SECURITY" in caplog.text and "tcp://*:5557" in caplog.text
    assert not kv_event_publisher.install(instance, ("tcp://*:5557",))
    assert not kv_event_publisher.install(None, ("tcp://127.0.0.1:5557", "tcp://[::1]:5558"))
    assert "kv_events_unauthenticated" in GAUGES
