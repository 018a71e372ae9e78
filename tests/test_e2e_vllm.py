"""End to end with real vLLM: a producer instance pushes prompt KV into a consumer instance,
whose greedy output must equal a plain instance's token for token and logprob for logprob.

The plain instance (the reference vLLM the vLLM test modules share, tests/conftest.py) answers
first, then the producer and the consumer start side by side, each pinned to its own core.
Every check also reads the consumer's counters, so a run that silently recomputed instead of
loading fails.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import torch
import yaml
import zmq

from lmcache_pd import protocol
from lmcache_pd.auth import Door, Role, generate_secret, load_keys
from lmcache_pd.config import load_config
from lmcache_pd.deploy.vllm_server import VLLMServer
from lmcache_pd.errors import PeerTimeout
from lmcache_pd.metrics_scrape import prompt_tokens_by_source, scrape
from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.transfer import landed_board
from lmcache_pd.transfer.landed_keys import POST_INTERVAL_S
from lmcache_pd.transfer.producer import Producer
from tests.helpers import free_port, make_keyer, wait_for
from tests.vllm_support import (
    LOGPROB_TOLERANCE,
    SERVER_ARGS,
    PlainVLLM,
    answer,
    assert_close_answer,
    body,
    prompt,
)

# Starting three vLLM instances takes minutes on two cores: the first test pays for it.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
LENGTHS = [1, 31, 255, 256, 257, 1000, 3000]
BATCH = 8
OUTPUT_TOKENS = 6
LOAD_TIMEOUT_S = 8.0

PROMPTS = {f"len-{n}": prompt(n, n) for n in LENGTHS}
PROMPTS |= {f"batch-{i}": prompt(300 + 97 * i, 10_000 + i) for i in range(BATCH)}
PROMPTS["orphan"] = prompt(700, 777)
# Pairs of prompts sharing a prefix of 1, 2 or 3 whole vLLM blocks (128 tokens) and a few tokens
# more: once the first was served, decode's own cache ends inside the first 256-token chunk, on
# a chunk boundary, or inside the second chunk. And one prompt sent twice.
BLOCK_TOKENS = 128
CHUNK_TOKENS = 256
SHARED_BLOCKS = (1, 2, 3)
for _blocks in SHARED_BLOCKS:
    _prefix = prompt(_blocks * BLOCK_TOKENS + 16, 40 + _blocks)
    PROMPTS[f"shared{_blocks}-a"] = _prefix + prompt(200, 50 + _blocks)
    PROMPTS[f"shared{_blocks}-b"] = _prefix + prompt(300, 60 + _blocks)
PROMPTS["repeat"] = prompt(640, 43)
# Two requests on one prefix sent together; a prefix decode's vLLM forgot between two requests.
_prefix = prompt(700, 70)
PROMPTS |= {f"together-{i}": _prefix + prompt(90 + 40 * i, 71 + i) for i in range(2)}
_prefix = prompt(600, 80)
PROMPTS |= {f"evicted-{i}": _prefix + prompt(150 + 30 * i, 81 + i) for i in range(2)}
# A three-turn chat that resends the conversation (its answers are fixed tokens here).
CHAT = [prompt(300, 90) + prompt(40, 91)]
for _turn in (2, 3):
    CHAT.append(CHAT[-1] + prompt(30, 90 + 2 * _turn) + prompt(40, 91 + 2 * _turn))
PROMPTS |= {f"chat-{turn}": tokens for turn, tokens in enumerate(CHAT, 1)}
# Fresh prompts for the rogue-producer tests: one the consumer had cached would be partly
# computed from its own prefix cache and never reach the checks under test.
PROMPTS |= {
    f"rogue-{kind}": prompt(1000, seed)
    for kind, seed in (
        ("bad-sum", 31),
        ("bad-kv", 32),
        ("dies", 33),
        ("sync-bad-sum", 34),
        ("outsider", 37),
    )
}
# Served while decode is busy with another request: its synchronous load goes into a step that
# decodes that one too.
PROMPTS["while-busy"] = prompt(900, 35)
# Sent with unusable kv_transfer_params, straight to each instance.
PROMPTS["hostile"] = prompt(400, 36)
# Sent under two cache salts (tenants): three chunks, the last partial.
PROMPTS["salted"] = prompt(640, 3801)

# Pushed once, then served by decode alone: two whole chunks and a partial one.
PROMPTS["local"] = prompt(700, 3902)
# A follow-up whose first 384 tokens (3 blocks, half of its second chunk) decode holds.
PROMPTS["tail-1"] = prompt(400, 3903)
PROMPTS["tail-2"] = PROMPTS["tail-1"] + prompt(300, 3904)
# Pushed and loaded once, while the time the connector holds vLLM's threads is counted.
PROMPTS["timed"] = prompt(600, 3905)
# Pushed while decode's consumer process is stopped.
PROMPTS["consumer-stopped"] = prompt(600, 3906)
# Sent to decode as the client's own prompt, its first output token forced to prefill's.
CONTINUED = [31, 257, 1000]
PROMPTS |= {f"continued-{n}": prompt(n, 4000 + n) for n in CONTINUED}


@pytest.fixture(scope="module")
def reference(plain_vllm: PlainVLLM) -> dict[str, tuple]:
    """The plain vLLM's answers (its stop checks that it took its files with it)."""
    return plain_vllm.answers(PROMPTS, OUTPUT_TOKENS)


class PDPair:
    """A producer and a consumer vLLM, with the consumer's ports and counters."""

    def __init__(self, model: Path, workdir: Path) -> None:
        self.model = model
        self.init_port, self.alloc_port = free_port(), free_port()
        # The deployment secret both instances authenticate their KV channel with.
        self.secret_file = workdir / "secret"
        self.secret_file.write_text(generate_secret())
        configs = {
            role: self._transfer_config(workdir, role) for role in ("kv_producer", "kv_consumer")
        }
        self.producer = VLLMServer(
            model,
            free_port(),
            workdir / "producer.log",
            kv_transfer_config=configs["kv_producer"],
            cpu=0,
            extra_args=SERVER_ARGS,
            log_stats=True,
            wait=False,
        )
        self.consumer = VLLMServer(
            model,
            free_port(),
            workdir / "consumer.log",
            kv_transfer_config=configs["kv_consumer"],
            cpu=1,
            env={"VLLM_SERVER_DEV_MODE": "1"},  # for /reset_prefix_cache
            extra_args=SERVER_ARGS,
            log_stats=True,
            wait=False,
        )
        try:  # both start at once
            self.producer.wait_until_healthy()
            self.consumer.wait_until_healthy()
        except BaseException:
            self.stop()
            raise

    def _transfer_config(self, workdir: Path, role: str) -> dict[str, Any]:
        path = workdir / f"{role}.yaml"
        settings = {
            "kv_role": role,
            "chunk_size": 256,
            "buffer_size_bytes": 1 << 28,
            "init_port": self.init_port,
            "alloc_port": self.alloc_port,
            "load_timeout_s": LOAD_TIMEOUT_S,
            # Short, so that pages allocated by a producer that then died come back in a test.
            "transfer_timeout_s": 4.0,
            "alloc_lease_s": 6.0,
            "secret_file": str(self.secret_file),
        }
        path.write_text(yaml.safe_dump(settings))
        return {
            "kv_connector": "LMCachePDConnector",
            "kv_connector_module_path": "lmcache_pd.connector",
            "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config_path": str(path)},
        }

    def spec(self, req_id: str) -> dict[str, Any]:
        return {
            "req_id": req_id,
            "receiver_host": "127.0.0.1",
            "receiver_init_port": self.init_port,
            "receiver_alloc_port": self.alloc_port,
        }

    def stats(self, side: str = "consumer") -> defaultdict[str, float]:
        """A connector's counters and gauges, from its vLLM's ``/metrics`` (as of the
        instance's last step; zero before its first push or load)."""
        server = self.consumer if side == "consumer" else self.producer
        return defaultdict(float, scrape(server.url))

    def stats_after_a_step(self, side: str = "consumer") -> defaultdict[str, float]:
        """``stats`` after a step of the instance's own: vLLM passes a connector's counters on
        at steps, and a push or load that ends after its request's last step (the instance then
        idle) is counted only at the next one."""
        server = self.consumer if side == "consumer" else self.producer
        server.complete(body(self.model, [7], 1))
        return self.stats(side)

    def tokens_by_source(self) -> defaultdict[str, float]:
        """vLLM's own record of where decode's prompt tokens came from."""
        return defaultdict(float, prompt_tokens_by_source(self.consumer.url))

    def disaggregated(
        self,
        name: str,
        tokens: list[int],
        landed_first: bool = False,
        cache_salt: str | None = None,
        decode_holds: int = 0,
        tags: dict[str, str] | None = None,
    ) -> tuple[list[str], list[float]]:
        """Prefill on the producer (one token), then decode on the consumer, as the proxy will
        (with ``landed_first``, once the consumer posted all of the KV landed: the push may end a
        moment after prefill's answer, which it never holds back; with ``cache_salt``, in both
        requests, as the proxy forwards a client's; with ``decode_holds``, the spec says so, as
        the proxy's KV index would; with ``tags``, LMCache's ``lmcache.tag.*`` in both
        requests' params, as the proxy passes a client's on)."""
        spec = self.spec(f"{name}-{time.monotonic_ns()}") | {"decode_holds": decode_holds}
        salted = {} if cache_salt is None else {"cache_salt": cache_salt}
        tagged = {f"lmcache.tag.{key}": value for key, value in (tags or {}).items()}
        first = self.producer.complete(
            body(self.model, tokens, 1, {"ret_first_tok": True, "disagg_spec": spec} | tagged)
            | salted
        )
        first_tok = first["kv_transfer_params"]["first_tok"]
        if landed_first:
            wait_landed(self, spec["req_id"], len(tokens))
        params = {"disagg_spec": spec} | tagged
        rest = self.consumer.complete(
            body(self.model, [*tokens, first_tok], OUTPUT_TOKENS - 1, params) | salted
        )
        head, tail = answer(first), answer(rest)
        return head[0] + tail[0], head[1] + tail[1]

    def continued(self, name: str, tokens: list[int], force: int | None = None) -> dict:
        """Prefill on the producer (one token), then the client's own request on the consumer,
        its first output token forced to prefill's (or to ``force``), as the proxy sends it:
        decode's whole answer."""
        spec = self.spec(f"{name}-{time.monotonic_ns()}")
        first = self.producer.complete(
            body(self.model, tokens, 1, {"ret_first_tok": True, "disagg_spec": spec})
        )
        first_tok = first["kv_transfer_params"]["first_tok"] if force is None else force
        params = {"disagg_spec": spec, "first_tok": first_tok}
        request = body(self.model, tokens, OUTPUT_TOKENS, params) | {"return_token_ids": True}
        return self.consumer.complete(request)

    def stop(self) -> None:
        self.consumer.stop()
        self.producer.stop()


@pytest.fixture(scope="module")
def pair(
    model: Path, reference: dict, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PDPair]:
    pair = PDPair(model, tmp_path_factory.mktemp("pd"))
    try:
        yield pair
    finally:
        pair.stop()


def test_the_time_the_connector_holds_vllms_threads_is_counted_and_within_the_wall_time(
    pair: PDPair, reference: dict
) -> None:
    """Both instances count the microseconds their connector's hooks held vLLM's model-runner
    and scheduler threads; a pushed and loaded request adds some to each, and never more than
    the wall time it took (a unit slip, nanoseconds for microseconds, would be 1,000 times
    over)."""
    sides = ("producer", "consumer")
    names = ("model_thread_microseconds", "scheduler_thread_microseconds")
    before = {side: pair.stats_after_a_step(side) for side in sides}
    started = time.monotonic()
    assert pair.disaggregated("timed", PROMPTS["timed"]) == reference["timed"]
    after = {side: pair.stats_after_a_step(side) for side in sides}
    wall_us = (time.monotonic() - started) * 1e6
    for side in sides:
        for name in names:
            added = after[side][name] - before[side][name]
            assert 0 < added < wall_us, (side, name, added, wall_us)


@pytest.mark.parametrize("length", LENGTHS)
def test_consumer_output_equals_one_instance_and_prompt_was_loaded(
    pair: PDPair, reference: dict, length: int
) -> None:
    before, pushes = pair.stats()["tokens_loaded"], pair.stats("producer")["pushes"]
    sources = pair.tokens_by_source()
    got = pair.disaggregated(f"len-{length}", PROMPTS[f"len-{length}"])
    assert got == reference[f"len-{length}"]  # tokens and logprobs, exactly
    # The consumer's prompt is the producer's plus its first token: all of the producer's is loaded.
    stats = pair.stats()
    assert stats["tokens_loaded"] - before == length
    # and vLLM's own record agrees: those tokens came from the transfer, one was computed
    after = pair.tokens_by_source()
    assert after["external_kv_transfer"] - sources["external_kv_transfer"] == length
    assert after["local_compute"] - sources["local_compute"] == 1
    assert stats["consumer_used_pages"] == 0
    # Chunked prefill: one push per prefill step, as each step completes its chunks (the
    # producer counts a push when its sender thread is done with it, a moment after it landed).
    steps = -(-length // int(SERVER_ARGS[1]))
    wait_for(
        lambda: pair.stats_after_a_step("producer")["pushes"] - pushes >= steps,
        what="pushes counted",
    )
    assert pair.stats("producer")["pushes"] - pushes == steps


@pytest.mark.parametrize("length", CONTINUED)
def test_decode_going_on_from_prefills_token_answers_the_clients_prompt_as_one_instance(
    pair: PDPair, reference: dict, length: int
) -> None:
    """Decode is sent the client's own prompt (not the prompt plus prefill's token) naming
    prefill's token as its first output: its whole answer is the plain instance's, token for
    token and logprob for logprob, and by vLLM's own counts it loaded all of the prompt but the
    last token, which it computed. The control: forcing another token makes that token the
    answer's first, with the model's own logprob for it (raw, not the mask's), and the answer
    goes on from it."""
    name = f"continued-{length}"
    sources = pair.tokens_by_source()
    continued = pair.continued(name, PROMPTS[name])
    assert answer(continued) == reference[name]
    after = pair.tokens_by_source()
    assert after["external_kv_transfer"] - sources["external_kv_transfer"] == length - 1
    assert after["local_compute"] - sources["local_compute"] == 1
    want = continued["choices"][0]["token_ids"]
    forced = pair.continued(name, PROMPTS[name], force=(want[0] + 1) % 1000)
    ids, logprobs = forced["choices"][0]["token_ids"], answer(forced)[1]
    assert ids[0] == (want[0] + 1) % 1000 and -50 < logprobs[0] < 0
    assert logprobs[0] != reference[name][1][0] and ids[1:] != want[1:]


def test_a_batch_of_concurrent_requests_matches_one_instance(pair: PDPair, reference: dict) -> None:
    before = pair.stats()["tokens_loaded"]
    names = [f"batch-{i}" for i in range(BATCH)]
    with ThreadPoolExecutor(BATCH) as pool:
        results = dict(
            zip(names, pool.map(lambda n: pair.disaggregated(n, PROMPTS[n]), names), strict=True)
        )
    for name in names:  # batched steps: see LOGPROB_TOLERANCE
        assert_close_answer(results[name], reference[name], name)
    assert pair.stats()["tokens_loaded"] - before == sum(len(PROMPTS[n]) for n in names)


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before.get(name, 0.0) for name in after}


def chunks_skipped(pair: PDPair, before: float, expected: int) -> None:
    """Prefill counted ``expected`` chunks as held by the consumer already (not written)."""
    wait_for(
        lambda: pair.stats_after_a_step("producer")["chunks_skipped"] - before >= expected,
        what="pushes counted",
    )
    assert pair.stats("producer")["chunks_skipped"] - before == expected


@pytest.mark.parametrize("blocks", SHARED_BLOCKS)
def test_a_prompt_sharing_a_prefix_loads_only_what_decode_lacks(
    pair: PDPair, reference: dict, blocks: int
) -> None:
    """Decode's own cache hit ends inside a chunk or on its boundary: decode keeps its blocks and
    loads the rest, a chunk's later block included, instead of computing the rest itself; the
    chunks wholly in the shared prefix stayed in the consumer's buffer and are not resent."""
    first, second = f"shared{blocks}-a", f"shared{blocks}-b"
    assert_close_answer(pair.disaggregated(first, PROMPTS[first]), reference[first])
    before, skipped = pair.tokens_by_source(), pair.stats("producer")["chunks_skipped"]
    assert_close_answer(pair.disaggregated(second, PROMPTS[second]), reference[second], second)
    tokens = moved(before, pair.tokens_by_source())
    hit = blocks * BLOCK_TOKENS
    assert tokens["local_cache_hit"] == hit
    assert tokens["external_kv_transfer"] == len(PROMPTS[second]) - hit
    assert tokens["local_compute"] == 1
    chunks_skipped(pair, skipped, (hit + 16) // CHUNK_TOKENS)


def test_two_requests_sharing_a_prefix_sent_together(pair: PDPair, reference: dict) -> None:
    names = ["together-0", "together-1"]
    before = pair.tokens_by_source()
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda n: pair.disaggregated(n, PROMPTS[n]), names))
    for name, got in zip(names, results, strict=True):
        assert_close_answer(got, reference[name], name)
    tokens = moved(before, pair.tokens_by_source())
    # Every prompt token but the last of each came from the transfer or decode's own cache.
    assert tokens["local_compute"] == 2
    assert tokens["external_kv_transfer"] + tokens["local_cache_hit"] == sum(
        len(PROMPTS[n]) for n in names
    )
    assert tokens["external_kv_transfer"] > 0


def test_a_prefix_decode_forgot_is_loaded_from_the_consumers_buffer(
    pair: PDPair, reference: dict
) -> None:
    """vLLM's own prefix cache on decode is emptied between two requests on one prefix: the
    second loads all of its prompt, the shared chunks from the consumer's buffer, not resent."""
    assert_close_answer(
        pair.disaggregated("evicted-0", PROMPTS["evicted-0"]), reference["evicted-0"]
    )
    response = httpx.post(f"{pair.consumer.url}/reset_prefix_cache", timeout=30.0)
    response.raise_for_status()
    before, skipped = pair.tokens_by_source(), pair.stats("producer")["chunks_skipped"]
    got = pair.disaggregated("evicted-1", PROMPTS["evicted-1"])
    assert_close_answer(got, reference["evicted-1"], "evicted-1")
    tokens = moved(before, pair.tokens_by_source())
    assert tokens["local_cache_hit"] == 0  # control: decode's own cache had nothing
    assert tokens["external_kv_transfer"] == len(PROMPTS["evicted-1"])
    chunks_skipped(pair, skipped, 600 // CHUNK_TOKENS)


def test_a_request_decode_serves_alone_loads_the_chunks_landed_for_an_earlier_one(
    pair: PDPair, reference: dict
) -> None:
    """The consumer's landed chunks are a second tier of decode's cache: a prompt pushed once,
    then sent straight to decode after vLLM's own prefix cache there was emptied, loads its two
    whole chunks from the consumer's buffer (a synchronous load, vLLM counting them transferred)
    and computes the rest; its answer equals the plain vLLM's. The control: the same prompt
    under a cache salt no push was made for loads nothing and computes it all. What decode
    computed there it kept (``computed_prompts.py``): that salted request again, its prefix
    cache emptied, loads the two chunks and answers as plain vLLM."""
    tokens = PROMPTS["local"]
    assert_close_answer(pair.disaggregated("local", tokens), reference["local"])

    def alone(salt: str | None = None) -> tuple[tuple, dict[str, float], dict[str, float]]:
        httpx.post(f"{pair.consumer.url}/reset_prefix_cache", timeout=30.0).raise_for_status()
        before, stats = pair.tokens_by_source(), pair.stats()
        salted = {} if salt is None else {"cache_salt": salt}
        got = answer(pair.consumer.complete(body(pair.model, tokens, OUTPUT_TOKENS) | salted))
        return got, moved(before, pair.tokens_by_source()), moved(stats, pair.stats())

    got, sources, stats = alone()
    assert_close_answer(got, reference["local"], "local, alone")
    assert sources["external_kv_transfer"] == 2 * CHUNK_TOKENS
    assert sources["local_compute"] == len(tokens) - 2 * CHUNK_TOKENS
    assert sources["local_cache_hit"] == 0  # decode's own cache had nothing
    assert stats["loads_local"] == 1 and stats["sync_load_failures"] == 0
    kept = pair.stats_after_a_step()["consumer_chunks_kept"]
    _, sources, stats = alone(salt="another-tenant")
    assert sources["external_kv_transfer"] == 0 and stats["loads_local"] == 0
    assert sources["local_compute"] == len(tokens)
    wait_for(
        lambda: pair.stats_after_a_step()["consumer_chunks_kept"] == kept + 2,
        what="the chunks decode computed kept",
    )
    time.sleep(2 * POST_INTERVAL_S)  # the keys board the scheduler reads is posted that often
    got, sources, stats = alone(salt="another-tenant")
    assert_close_answer(got, reference["local"], "local, alone, kept")
    assert sources["external_kv_transfer"] == 2 * CHUNK_TOKENS
    assert stats["loads_local"] == 1 and stats["sync_load_failures"] == 0


def test_a_follow_up_gets_only_the_tail_of_the_chunk_decode_holds_the_head_of(
    pair: PDPair, reference: dict
) -> None:
    """A follow-up whose first 384 tokens decode's prefix cache holds (3 blocks: the second
    chunk's first half), the spec saying so: prefill pushes that chunk's tail and the last
    chunk, 3 blocks where the whole chunk made 4, and decode loads them past its own hit and
    answers as plain vLLM. The first turn, pushed whole (4 blocks), gives a block's bytes."""
    first, tokens = PROMPTS["tail-1"], PROMPTS["tail-2"]

    def pushed() -> float:
        return pair.stats_after_a_step("producer")["bytes_pushed"]

    start = pushed()
    assert_close_answer(pair.disaggregated("tail-1", first), reference["tail-1"])
    wait_for(lambda: pushed() > start, what="the first turn's push counted")
    block_bytes = (pushed() - start) / 4  # 400 tokens: blocks of 128 in chunks of 256
    held = len(first) // BLOCK_TOKENS * BLOCK_TOKENS
    assert held % CHUNK_TOKENS == BLOCK_TOKENS
    before, start = pair.tokens_by_source(), pushed()
    got = pair.disaggregated("tail-2", tokens, decode_holds=held)
    assert_close_answer(got, reference["tail-2"], "tail-2")
    sources = moved(before, pair.tokens_by_source())
    assert sources["local_cache_hit"] == held
    assert sources["external_kv_transfer"] == len(tokens) - held
    assert sources["local_compute"] == 1
    wait_for(lambda: pushed() > start, what="the follow-up's push counted")
    assert pushed() - start == 3 * block_bytes


def test_a_chat_that_resends_the_conversation_loads_only_each_turns_news(
    pair: PDPair, reference: dict
) -> None:
    for turn, tokens in enumerate(CHAT, 1):
        before, skipped = pair.tokens_by_source(), pair.stats("producer")["chunks_skipped"]
        name = f"chat-{turn}"
        assert_close_answer(pair.disaggregated(name, tokens), reference[name], name)
        sources = moved(before, pair.tokens_by_source())
        assert sources["local_compute"] == 1, name
        assert sources["external_kv_transfer"] + sources["local_cache_hit"] == len(tokens)
        if turn > 1:  # the earlier turns: decode's own cache, and not resent
            earlier = len(CHAT[turn - 2])
            assert sources["local_cache_hit"] == earlier // BLOCK_TOKENS * BLOCK_TOKENS, name
            chunks_skipped(pair, skipped, earlier // CHUNK_TOKENS)


def test_a_prompt_decode_already_holds_loads_nothing_and_frees_its_pages_at_once(
    pair: PDPair, reference: dict
) -> None:
    tokens = PROMPTS["repeat"]  # 640 tokens: five whole blocks, all in decode's cache next time
    assert_close_answer(pair.disaggregated("repeat", tokens), reference["repeat"])
    before, sources = pair.stats(), pair.tokens_by_source()
    pushed = pair.stats("producer")
    assert_close_answer(pair.disaggregated("repeat", tokens), reference["repeat"])
    assert pair.tokens_by_source()["external_kv_transfer"] == sources["external_kv_transfer"]
    assert pair.stats()["loads_unneeded"] - before["loads_unneeded"] == 1
    # and its three chunks were still in the consumer's buffer: none was written again
    wait_for(
        lambda: (
            pair.stats_after_a_step("producer")["chunks_skipped"] - pushed["chunks_skipped"] == 3
        ),
        what="chunks counted skipped",
    )
    assert pair.stats("producer")["bytes_pushed"] == pushed["bytes_pushed"]

    def pages_freed() -> bool:
        return pair.stats_after_a_step()["consumer_used_pages"] == 0

    # well before the claim timeout (30 s) that held them before
    wait_for(pages_freed, timeout_s=5.0, what="pushed pages of a request decode did not need")


@pytest.mark.parametrize("scope", ["cache_salt", "lmcache_tag"])
def test_requests_of_different_cache_salts_share_no_chunk(
    pair: PDPair, reference: dict, scope: str
) -> None:
    """vLLM's ``cache_salt`` keeps tenants' prefix caches apart, and so must the chunk keys: the
    same prompt served under a second salt is pushed and loaded in full again, none of its chunks
    found already held in the consumer's buffer; the first salt again shares every chunk (the
    control). LMCache's tags (``lmcache.tag.tenant`` in ``kv_transfer_params``) alike. Decode's
    own prefix cache is emptied before each, so that only the consumer's buffer could share; the
    answers equal the plain vLLM's, which had no salt nor tag."""
    tokens = PROMPTS["salted"]
    chunks = -(-len(tokens) // CHUNK_TOKENS)

    def served(salt: str) -> dict[str, float]:
        """Serve the prompt under ``salt`` (or the tag ``tenant: salt``): chunks prefill wrote
        and found held (skipped), the consumer's cache hits, decode's tokens loaded, and its
        prompt-token sources."""
        httpx.post(f"{pair.consumer.url}/reset_prefix_cache", timeout=30.0).raise_for_status()
        producer, consumer = pair.stats("producer"), pair.stats()
        sources = pair.tokens_by_source()
        if scope == "cache_salt":
            got = pair.disaggregated("salted", tokens, cache_salt=salt)
        else:
            got = pair.disaggregated("salted", tokens, tags={"tenant": salt})
        assert_close_answer(got, reference["salted"], salt)

        def pushed() -> defaultdict[str, float]:
            return defaultdict(float, moved(producer, pair.stats_after_a_step("producer")))

        def all_counted() -> bool:
            chunks_moved = pushed()
            return chunks_moved["chunks_pushed"] + chunks_moved["chunks_skipped"] >= chunks

        wait_for(all_counted, what="pushes counted")
        prefill = pushed()
        decode = defaultdict(float, moved(consumer, pair.stats_after_a_step()))
        sourced = defaultdict(float, moved(sources, pair.tokens_by_source()))
        return {
            "written": prefill["chunks_pushed"],
            "skipped": prefill["chunks_skipped"],
            "cache_hits": decode["consumer_cache_hits"],
            "loaded": decode["tokens_loaded"],
            "transferred": sourced["external_kv_transfer"],
            "decode_hit": sourced["local_cache_hit"],
        }

    first = served("tenant-a")
    assert (first["written"], first["skipped"]) == (chunks, 0)
    second = served("tenant-b")
    assert (second["written"], second["skipped"], second["cache_hits"]) == (chunks, 0, 0)
    assert second["loaded"] == second["transferred"] == len(tokens)
    assert second["decode_hit"] == 0
    hits = pair.stats()["consumer_cache_hits"]
    again = served("tenant-a")  # control: the same salt shares what the first request pushed
    assert (again["written"], again["skipped"]) == (0, chunks)
    assert again["loaded"] == again["transferred"] == len(tokens)
    wait_for(
        lambda: pair.stats_after_a_step()["consumer_cache_hits"] - hits >= chunks,
        what="hits counted",
    )
    assert pair.stats()["consumer_cache_hits"] - hits == chunks


def test_kv_that_never_comes_is_recomputed_within_the_deadline(
    pair: PDPair, reference: dict
) -> None:
    """The producer's push goes nowhere (its consumer address is dead, as if it died with the
    request): the consumer waits its deadline, recomputes the prompt, and still answers right."""
    tokens = PROMPTS["orphan"]
    dead = {
        **pair.spec("orphan"),
        "receiver_init_port": free_port(),
        "receiver_alloc_port": free_port(),
    }
    first = pair.producer.complete(
        body(pair.model, tokens, 1, {"ret_first_tok": True, "disagg_spec": dead})
    )
    first_tok = first["kv_transfer_params"]["first_tok"]
    before = pair.stats()
    started = time.monotonic()
    rest = pair.consumer.complete(
        body(
            pair.model,
            [*tokens, first_tok],
            OUTPUT_TOKENS - 1,
            {"disagg_spec": pair.spec("orphan")},
        )
    )
    assert LOAD_TIMEOUT_S <= time.monotonic() - started < LOAD_TIMEOUT_S + 30
    head, tail = answer(first), answer(rest)
    assert_close_answer((head[0] + tail[0], head[1] + tail[1]), reference["orphan"])
    after = pair.stats()
    assert after["load_timeouts"] == before["load_timeouts"] + 1
    assert after["tokens_loaded"] == before["tokens_loaded"]
    assert after["consumer_used_pages"] == 0
    # and it keeps serving disaggregated requests
    assert pair.disaggregated("len-257", PROMPTS["len-257"]) == reference["len-257"]


def stream_gaps(server: VLLMServer, model: Path, tokens: int) -> list[float]:
    """The gaps between a streamed answer's events (decode serving it alone)."""
    request = body(model, prompt(40, 3907), tokens) | {"stream": True, "ignore_eos": True}
    stamps = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json=request, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                stamps.append(time.monotonic())
    return [later - earlier for earlier, later in itertools.pairwise(stamps)]


def test_a_stopped_consumer_process_never_stalls_decodes_engine(
    pair: PDPair, reference: dict
) -> None:
    """Decode's consumer process is stopped (SIGSTOP) for 10 s while decode serves: a request
    pushed meanwhile waits out its load deadline, is recomputed and answered right; a stream
    decode serves alone meanwhile never pauses a second (vLLM's model thread never waits on
    the stopped process); continued, the process serves loads again."""
    services = [
        child
        for child in psutil.Process(pair.consumer.pid).children(recursive=True)
        if "lmcache_pd.transfer.consumer_service" in " ".join(child.cmdline())
    ]
    assert services
    before = pair.stats()
    for service in services:
        service.suspend()
    try:
        with ThreadPoolExecutor(1) as pool:
            gaps = pool.submit(stream_gaps, pair.consumer, pair.model, 120)
            got = answer(pair.continued("consumer-stopped", PROMPTS["consumer-stopped"]))
            assert max(gaps.result()) < 1.0
    finally:
        for service in services:
            service.resume()
    assert_close_answer(got, reference["consumer-stopped"])
    assert pair.stats_after_a_step()["loads_failed"] > before["loads_failed"]
    assert pair.disaggregated("len-257", PROMPTS["len-257"]) == reference["len-257"]


def test_no_kv_transfer_params_crash_an_instance_or_change_its_answer(
    pair: PDPair, reference: dict
) -> None:
    """Values a client can send straight to an instance's HTTP port (any JSON object as
    ``kv_transfer_params``; a string, number or list smuggled in ``vllm_xargs``): those that
    reach the connector are counted and the request is answered as a plain vLLM answers it.
    Before, a first-token address that ZMQ refuses ended the prefill engine ("EngineCore
    encountered an issue", dead until restarted), and a value not an object made the connector
    call ``.get`` on it inside vLLM's scheduler. A truthy non-object in ``vllm_xargs`` never
    reaches the connector: vLLM's own API server fails that one request (its output processor
    calls ``.get`` on it too), and the instance serves on; behind ``serve`` the proxy refuses
    ``vllm_xargs`` and the instances answer only the proxy."""
    nowhere = {**pair.spec("hostile"), "receiver_init_port": free_port()}
    reaching: list[tuple[str, object]] = [
        ("kv_transfer_params", {"disagg_spec": "x"}),
        ("kv_transfer_params", {"disagg_spec": {**nowhere, "receiver_alloc_port": [1, 2]}}),
        ("vllm_xargs", {"kv_transfer_params": ""}),
        ("vllm_xargs", {"kv_transfer_params": 0}),
    ]
    refused_by_vllm = [{"kv_transfer_params": bad} for bad in ("x", [1, "a"], 5)]
    crash = ("kv_transfer_params", {"disagg_spec": nowhere, protocol.NOTICE_KEY: "tcp://-:1"})
    tokens = PROMPTS["hostile"]
    for side, extra in (("producer", [crash]), ("consumer", [])):
        server = pair.producer if side == "producer" else pair.consumer
        before = pair.stats(side)["bad_transfer_params"]
        for field, value in reaching + extra:
            got = answer(server.complete({**body(pair.model, tokens, OUTPUT_TOKENS), field: value}))
            assert_close_answer(got, reference["hostile"], f"{side} {field}={value}")
        for xargs in refused_by_vllm:
            with pytest.raises(httpx.HTTPStatusError):
                server.complete({**body(pair.model, tokens, 1), "vllm_xargs": xargs})
        assert server.running

        def all_counted(
            side: str = side, before: float = before, sent: int = len(reaching) + len(extra)
        ) -> bool:
            return pair.stats_after_a_step(side)["bad_transfer_params"] - before == sent

        wait_for(all_counted, timeout_s=30.0, what=f"{side} counted every unusable value")
    # and disaggregation still works on both
    assert pair.disaggregated("after-hostile", PROMPTS["len-257"]) == reference["len-257"]


class RogueProducer:
    """Pushes chunks of our choosing, under the keys the real producer would use, from this
    test process: stands for a producer whose bytes went wrong in flight (it has the
    deployment's secret), or with ``outsider``, for any other process on the network."""

    BLOCK_BYTES = 2 * 128 * 2 * 64 * 4  # KV heads x block size x (K+V) x head size x fp32
    LAYERS = 4

    def __init__(self, pair: PDPair, outsider: bool = False) -> None:
        self.pair = pair
        self.secret_file = None if outsider else str(pair.secret_file)
        self.keyer = make_keyer(model_name=str(pair.model), chunk_size=CHUNK_TOKENS)

    def chunks(self, tokens: list[int]) -> list[tuple[bytes, torch.Tensor]]:
        """Finite but wrong KV for every chunk of ``tokens``, under the real keys and sizes."""
        generator = torch.Generator().manual_seed(1)
        chunks = []
        for chunk in self.keyer.chunk_keys(tokens):
            blocks = -(-(chunk.end - chunk.start) // 128)
            nbytes = blocks * self.LAYERS * self.BLOCK_BYTES
            chunks.append(
                (chunk.key, torch.randn(nbytes // 4, generator=generator).view(torch.uint8))
            )
        return chunks

    def push(self, req_id: str, tokens: list[int]) -> None:
        config = load_config(
            None,
            environ={},
            kv_role="kv_producer",
            page_bytes=1 << 20,
            buffer_size_bytes=16 << 20,
            secret_file=self.secret_file,
            handshake_timeout_s=1.0,
        )
        with Producer(config) as producer:
            spec = DisaggSpec.from_dict(self.pair.spec(req_id))
            chunks = self.chunks(tokens)
            assert producer.push(spec, chunks).chunks_sent == len(chunks)

    def allocate_and_die(self, req_id: str, tokens: list[int]) -> None:
        """Ask for pages as a producer would, then never write: as if it died right there."""
        request = protocol.AllocRequest(
            version=protocol.PROTOCOL_VERSION,
            req_id=req_id,
            chunks=[protocol.ChunkSpec(key, data.numel()) for key, data in self.chunks(tokens)],
        )
        with zmq.Context.instance().socket(zmq.DEALER) as socket:
            socket.setsockopt(zmq.LINGER, 0)
            keys = load_keys(self.secret_file, Role.PRODUCER)
            assert keys is not None
            keys.connect(socket, Door.ALLOC)
            socket.connect(f"tcp://127.0.0.1:{self.pair.alloc_port}")
            socket.send(protocol.encode(request))
            assert socket.poll(5000), "the consumer did not answer the allocation"
            reply = protocol.ALLOC_REPLIES.decode(socket.recv())
        assert isinstance(reply, protocol.AllocResponse)
        assert all(page is not None for page in reply.pages)


def prefill_pushing_nowhere(pair: PDPair, name: str) -> tuple[str, dict]:
    """A fresh req_id, and the producer's one-token answer for ``name``'s prompt, whose push
    went to a dead address (so the test decides what the consumer receives)."""
    req_id = f"{name}-{time.monotonic_ns()}"
    nowhere = {**pair.spec(req_id + "-p"), "receiver_init_port": free_port()}
    first = pair.producer.complete(
        body(pair.model, PROMPTS[name], 1, {"ret_first_tok": True, "disagg_spec": nowhere})
    )
    return req_id, first


def decode_rest(pair: PDPair, tokens: list[int], first: dict, req_id: str) -> tuple[list, list]:
    """Decode the rest of ``first`` (the producer's answer) on the consumer under ``req_id``;
    the whole answer's tokens and logprobs."""
    rest = pair.consumer.complete(
        body(
            pair.model,
            [*tokens, first["kv_transfer_params"]["first_tok"]],
            OUTPUT_TOKENS - 1,
            {"disagg_spec": pair.spec(req_id)},
        )
    )
    head, tail = answer(first), answer(rest)
    return head[0] + tail[0], head[1] + tail[1]


def decode_after_rogue_push(pair: PDPair, name: str) -> tuple[list, list]:
    """Prefill on the producer with nowhere to push, put the rogue chunks into the consumer
    under the request's id, then decode there."""
    tokens = PROMPTS[name]
    req_id, first = prefill_pushing_nowhere(pair, name)
    RogueProducer(pair).push(req_id, tokens)
    return decode_rest(pair, tokens, first, req_id)


def wait_landed(pair: PDPair, req_id: str, tokens: int) -> None:
    """Until a consumer process has posted every chunk of a ``tokens``-token prompt landed for
    ``req_id``: what decode's scheduler reads to load it synchronously."""
    chunks = -(-tokens // CHUNK_TOKENS)
    pattern = landed_board.board_path(pair.consumer.runtime_dir, "*", 0)
    wait_for(
        lambda: any(
            landed_board.read(board).get(req_id, 0) >= chunks
            for board in pattern.parent.glob(pattern.name)
        ),
        what="KV posted landed",
    )


@contextlib.contextmanager
def decode_busy(pair: PDPair) -> Iterator[None]:
    """Decode streams a long answer of its own meanwhile; the stream is closed at the end (vLLM
    then aborts that request)."""
    request = {
        "model": str(pair.model),
        "prompt": prompt(20, 36),
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    streaming, stop, ended_early = threading.Event(), threading.Event(), threading.Event()

    def generate() -> None:
        url = f"{pair.consumer.url}/v1/completions"
        with httpx.stream("POST", url, json=request, timeout=120.0) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):  # a token: decode is stepping
                    streaming.set()
                if stop.is_set():
                    return
        ended_early.set()

    with ThreadPoolExecutor(1) as pool:
        busy = pool.submit(generate)
        wait_for(lambda: streaming.is_set() or busy.done(), timeout_s=60, what="decode streaming")
        assert streaming.is_set(), busy.result()
        try:
            yield
        finally:
            stop.set()
            busy.result(timeout=30)
    assert not ended_early.is_set(), "decode's own request ended before the test did"


def test_kv_landed_before_decode_steps_to_its_request_is_loaded_before_that_step(
    pair: PDPair, reference: dict
) -> None:
    """The request's KV landed before the request reaches decode (which is busy decoding
    another): it is loaded synchronously (before the step that computes its last token, not in
    a step of its own), and the answer is still the reference's."""
    before, sources = pair.stats(), pair.tokens_by_source()
    with decode_busy(pair):
        got = pair.disaggregated("while-busy", PROMPTS["while-busy"], landed_first=True)
    assert_close_answer(got, reference["while-busy"])  # batched with the busy request
    after = pair.stats()
    assert after["loads_sync"] - before["loads_sync"] == 1
    assert after["sync_load_failures"] == before["sync_load_failures"]
    assert after["tokens_loaded"] - before["tokens_loaded"] == len(PROMPTS["while-busy"])
    tokens = moved(sources, pair.tokens_by_source())
    assert tokens["external_kv_transfer"] == len(PROMPTS["while-busy"])


def test_a_corrupted_chunk_loaded_before_the_step_is_caught_and_recomputed(
    pair: PDPair, reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The synchronous load's failure path: a chunk whose checksum does not match is found in
    the pass that scatters it, its blocks are reported invalid, vLLM drops what the step
    computed from them and recomputes the prompt; the answer is still the reference's."""
    import lmcache_pd.transfer.producer

    real = lmcache_pd.transfer.producer.checksum
    monkeypatch.setattr(lmcache_pd.transfer.producer, "checksum", lambda data: real(data) ^ 1)
    name = "rogue-sync-bad-sum"
    before = pair.stats()
    with decode_busy(pair):
        req_id, first = prefill_pushing_nowhere(pair, name)
        RogueProducer(pair).push(req_id, PROMPTS[name])
        wait_landed(pair, req_id, len(PROMPTS[name]))
        got = decode_rest(pair, PROMPTS[name], first, req_id)
    assert_close_answer(got, reference[name])
    after = pair.stats()
    assert after["loads_sync"] - before["loads_sync"] == 1
    assert after["sync_load_failures"] - before["sync_load_failures"] == 1
    assert after["integrity_failures"] - before["integrity_failures"] == 1
    assert after["tokens_loaded"] == before["tokens_loaded"]


def test_chunk_corrupted_in_flight_is_caught_and_the_prompt_recomputed(
    pair: PDPair, reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rogue bytes arrive with checksums that do not match them, as if changed in flight:
    the consumer must refuse them and recompute, so the answer is still the reference."""
    import lmcache_pd.transfer.producer

    real = lmcache_pd.transfer.producer.checksum
    monkeypatch.setattr(lmcache_pd.transfer.producer, "checksum", lambda data: real(data) ^ 1)
    before = pair.stats()
    assert_close_answer(decode_after_rogue_push(pair, "rogue-bad-sum"), reference["rogue-bad-sum"])
    after = pair.stats()
    assert after["integrity_failures"] == before["integrity_failures"] + 1
    assert after["tokens_loaded"] == before["tokens_loaded"]
    assert after["consumer_used_pages"] == 0


def test_wrong_kv_with_good_checksums_changes_the_answer(pair: PDPair, reference: dict) -> None:
    """Negative control for every comparison above: KV that is loaded but wrong must show in
    the output, so matching outputs do prove the transferred KV was right."""
    before = pair.stats()
    got = decode_after_rogue_push(pair, "rogue-bad-kv")
    assert pair.stats()["tokens_loaded"] == before["tokens_loaded"] + 1000
    assert got[0][0] == reference["rogue-bad-kv"][0][0]  # the producer's own first token
    assert got[0][1:] != reference["rogue-bad-kv"][0][1:]
    # and far beyond the tolerance used where vLLM's own rounding differs
    drift = max(
        abs(a - b) for a, b in zip(got[1][1:], reference["rogue-bad-kv"][1][1:], strict=True)
    )
    assert drift > 100 * LOGPROB_TOLERANCE


def test_a_process_without_the_secret_puts_no_kv_into_decode(pair: PDPair, reference: dict) -> None:
    """The poisoning of issue 31: any process that reached decode's ports could allocate pages
    under a request's (computable) chunk keys and write its own bytes with their own checksums.
    Without the deployment's secret, its handshake is never answered: nothing of it lands, and
    decode's answer is the plain vLLM's. The test above is its control: the same push made with
    the secret changes the answer."""
    tokens = PROMPTS["rogue-outsider"]
    req_id, first = prefill_pushing_nowhere(pair, "rogue-outsider")
    before = pair.stats()
    with pytest.raises(PeerTimeout, match="secret"):
        RogueProducer(pair, outsider=True).push(req_id, tokens)
    with zmq.Context.instance().socket(zmq.DEALER) as socket:  # nor a bare allocation
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://127.0.0.1:{pair.alloc_port}")
        socket.send(
            protocol.encode(protocol.KVAbandoned.of(req_id, protocol.AbandonReason.CLIENT_GONE))
        )
        assert not socket.poll(1000)
    assert_close_answer(decode_rest(pair, tokens, first, req_id), reference["rogue-outsider"])
    after = pair.stats()
    assert after["tokens_loaded"] == before["tokens_loaded"]
    assert after["consumer_chunks_landed"] == before["consumer_chunks_landed"]


def test_producer_that_dies_after_allocating_costs_a_recompute_and_no_pages(
    pair: PDPair, reference: dict
) -> None:
    """Pages were allocated for the prompt, then nothing came: the consumer recomputes at its
    deadline, answers right, and the lease gives the pages back."""
    name = "rogue-dies"
    tokens = PROMPTS[name]
    req_id, first = prefill_pushing_nowhere(pair, name)
    RogueProducer(pair).allocate_and_die(req_id, tokens)
    before = pair.stats()
    started = time.monotonic()
    got = decode_rest(pair, tokens, first, req_id)
    assert LOAD_TIMEOUT_S <= time.monotonic() - started < LOAD_TIMEOUT_S + 30
    assert_close_answer(got, reference[name])
    after = pair.stats()
    assert after["load_timeouts"] == before["load_timeouts"] + 1
    assert after["consumer_used_pages"] == 0  # the 6 s lease ran out before the 8 s deadline
