"""The connector's halves without vLLM's engine: scheduler logic on stand-in requests, and the
two workers moving a paged cache from one to the other over real NIXL."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch
import zmq
from vllm.v1.request import RequestStatus

from lmcache_pd.config import load_config
from lmcache_pd.connector.adapter_identity import AdapterIdentities, AdapterState, folder_digest
from lmcache_pd.connector.computed_prompts import ComputedPrompts
from lmcache_pd.connector.consumer_worker import SYNC_LOAD_WAIT_S, ConsumerWorker
from lmcache_pd.connector.counters import StatsRecorder
from lmcache_pd.connector.landed_chunks import LandedChunks
from lmcache_pd.connector.metadata import (
    KeepRequest,
    LoadRequest,
    PDConnectorMetadata,
    SaveRequest,
)
from lmcache_pd.connector.scheduler import ConsumerScheduler, ProducerScheduler
from lmcache_pd.connector.worker import ProducerWorker
from lmcache_pd.errors import AllocationError, BufferFull, PeerTimeout, TransferError
from lmcache_pd.first_token import FirstTokenNotice
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.protocol import CANCEL_TIMEOUT_S, NOTICE_KEY, PROBE_AREA_BYTES, DisaggSpec
from lmcache_pd.transfer import landed_board
from lmcache_pd.transfer.landed_keys import KeysWriter
from lmcache_pd.transfer.producer import Producer
from tests.helpers import free_port, make_keyer, wait_for

BLOCK = 32
CHUNK = 64
SPEC = {
    "req_id": "d-1",
    "receiver_host": "127.0.0.1",
    "receiver_init_port": 1,
    "receiver_alloc_port": 2,
}


def request(
    req_id: str,
    prompt: list[int],
    params: dict | None,
    outputs: list[int] = (),
    computed: int | None = None,
    status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED,
    cache_salt: str | None = None,
    lora: str | None = None,
    mm: tuple[tuple[int, int, str], ...] = (),
    lora_path: Path | None = None,
) -> SimpleNamespace:
    """A stand-in vLLM Request; ``mm``: its images as (offset, length, identifier); ``lora``:
    its adapter's name, loaded from ``lora_path`` (by default a path that holds nothing)."""
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=prompt,
        kv_transfer_params=params,
        cache_salt=cache_salt,
        lora_request=(
            None
            if lora is None
            else SimpleNamespace(lora_name=lora, lora_path=str(lora_path or f"/a/{lora}"))
        ),
        mm_features=[
            SimpleNamespace(mm_position=SimpleNamespace(offset=o, length=n), identifier=i)
            for o, n, i in mm
        ],
        output_token_ids=list(outputs),
        num_computed_tokens=len(prompt) if computed is None else computed,
        num_preemptions=0,
        status=status,
    )


def step(new=(), cached=(), scheduled=None, finished=()) -> SimpleNamespace:
    """A stand-in SchedulerOutput: new requests (id, blocks, computed) and cached ones."""
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c) for r, b, c in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            resumed_req_ids=set(),
            new_block_ids=[(b,) if b else None for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
        ),
        num_scheduled_tokens=scheduled or {},
        finished_req_ids=set(finished),
    )


def test_producer_scheduler_follows_chunked_prefill_and_returns_the_first_token() -> None:
    scheduler = ProducerScheduler()
    prompt = list(range(150))
    req = request("r", prompt, {"ret_first_tok": True, "disagg_spec": SPEC}, outputs=[7])
    scheduler.update_state_after_alloc(req, None, 0)
    first = scheduler.build_connector_meta(step(new=[("r", [4, 5], 0)], scheduled={"r": 64}))
    [save] = first.saves
    assert (save.computed_end, save.block_ids, save.spec.req_id) == (64, [4, 5], "d-1")
    assert save.prompt == prompt
    second = scheduler.build_connector_meta(
        step(cached=[("r", [6, 7, 9], 64)], scheduled={"r": 86})
    )
    # Only what changed travels: the blocks added since, and no second copy of the prompt.
    assert second.saves[0].computed_end == 150
    assert (second.saves[0].block_ids, second.saves[0].prompt) == ([6, 7, 9], None)
    assert scheduler.request_finished(req) == {"first_tok": 7, "disagg_req_id": "d-1"}
    # vLLM lists it as finished a step later: the worker is told to forget it then
    last = scheduler.build_connector_meta(step(finished=["r"]))
    assert (last.finished, last.aborted) == ({"r"}, set())
    assert scheduler.build_connector_meta(step()).finished == set()


def test_a_prefill_that_ends_before_its_prompt_is_computed_is_reported_aborted() -> None:
    scheduler = ProducerScheduler()
    req = request("r", list(range(300)), {"ret_first_tok": True, "disagg_spec": SPEC}, computed=64)
    scheduler.update_state_after_alloc(req, None, 0)
    scheduler.build_connector_meta(step(new=[("r", [4, 5], 0)], scheduled={"r": 64}))
    assert scheduler.request_finished(req) is None
    meta = scheduler.build_connector_meta(step(finished=["r"]))
    assert (meta.aborted, meta.finished) == ({"r"}, {"r"})
    assert scheduler.build_connector_meta(step()).aborted == set()


def test_the_producer_sends_the_first_token_to_the_proxy_only_when_decode_goes_on() -> None:
    """A notice when the request stopped at its token limit; none when it stopped on EOS or a
    stop token (decode has nothing to add), was aborted, or named no valid address."""
    context = zmq.Context()
    proxy = context.socket(zmq.PULL)
    port = proxy.bind_to_random_port("tcp://127.0.0.1")
    scheduler = ProducerScheduler()
    try:
        cases = {
            "length": (RequestStatus.FINISHED_LENGTH_CAPPED, f"tcp://127.0.0.1:{port}"),
            "eos": (RequestStatus.FINISHED_STOPPED, f"tcp://127.0.0.1:{port}"),
            "aborted": (RequestStatus.FINISHED_ABORTED, f"tcp://127.0.0.1:{port}"),
            "bad_address": (RequestStatus.FINISHED_LENGTH_CAPPED, "127.0.0.1; rm -rf"),
        }
        for name, (status, address) in cases.items():
            spec = {**SPEC, "req_id": f"d-{name}"}
            params = {"ret_first_tok": True, "disagg_spec": spec, NOTICE_KEY: address}
            req = request(name, [1, 2, 3], params, outputs=[9], status=status)
            scheduler.update_state_after_alloc(req, None, 0)
            returned = scheduler.request_finished(req)
            assert returned == {"first_tok": 9, "disagg_req_id": f"d-{name}"}
        assert proxy.poll(2000)
        notice = msgspec.msgpack.decode(proxy.recv(), type=FirstTokenNotice)
        assert notice == FirstTokenNotice("d-length", [1, 2, 3], 9)
        assert not proxy.poll(300)  # and no other
    finally:
        scheduler.close()
        proxy.close(linger=0)
        context.term()


def test_requests_without_or_with_a_bad_spec_are_left_alone() -> None:
    scheduler = ProducerScheduler()
    scheduler.update_state_after_alloc(request("plain", [1, 2], None), None, 0)
    scheduler.update_state_after_alloc(
        request("bad", [1, 2], {"disagg_spec": {"req_id": 5}}), None, 0
    )
    meta = scheduler.build_connector_meta(
        step(new=[("plain", [1], 0), ("bad", [2], 0)], scheduled={"plain": 2, "bad": 2})
    )
    assert meta.saves == []
    consumer = ConsumerScheduler()
    assert consumer.get_num_new_matched_tokens(request("plain", [1, 2, 3], None), 0) == (0, False)


# kv_transfer_params as a client can send them: straight to an instance's HTTP port (any JSON
# object), or smuggled in vllm_xargs (a string, a number or a list).
HOSTILE_PARAMS = [
    "x",
    7,
    1.5,
    [1, "a"],
    {"disagg_spec": "x"},
    {"disagg_spec": [1, 2]},
    {"disagg_spec": {"req_id": 5}},
    {"disagg_spec": {**SPEC, "receiver_init_port": [1, 2]}},  # two ranks' init ports, one alloc
    {"disagg_spec": {**SPEC, "receiver_host": "a b"}},
    {"disagg_spec": {**SPEC, "req_id": "r" * 10_000}},
    {"disagg_spec": {**SPEC, "surprise": {"deep": [[[[]]]]}}},
    {"disagg_spec": SPEC, "lmcache.tag.tenant": ["a"]},  # LMCache's options, malformed
    {"disagg_spec": SPEC, "lmcache.tag.tenant": "a" * 10_000},
    {"disagg_spec": SPEC, **{f"lmcache.tag.t{i}": "a" for i in range(100)}},
    {"disagg_spec": SPEC, "lmcache.skip_save": "yes"},
]


def test_no_kv_transfer_params_crash_a_scheduler_half() -> None:
    """Each is counted and logged, and the request is served as if it had none."""
    counted: list[str] = []
    producer, consumer = ProducerScheduler(counted.append), ConsumerScheduler(counted.append)
    try:
        for index, params in enumerate(HOSTILE_PARAMS):
            req = request(f"h{index}", list(range(300)), params, outputs=[9])
            assert consumer.get_num_new_matched_tokens(req, 0) == (0, False)
            consumer.update_state_after_alloc(req, None, 0)
            assert consumer.request_finished(req) is None
            producer.update_state_after_alloc(req, None, 0)
            assert producer.request_finished(req) is None
        assert producer.build_connector_meta(step()).saves == []
        assert consumer.build_connector_meta(step()).loads == []
        # Once per request and role: decoded at the door, not again in each hook.
        assert counted == ["bad_transfer_params"] * 2 * len(HOSTILE_PARAMS)
        # negative control: a good spec is not counted and is pushed
        counted.clear()
        good = request("good", list(range(300)), {"disagg_spec": SPEC})
        producer.update_state_after_alloc(good, None, 0)
        meta = producer.build_connector_meta(step(new=[("good", [1], 0)], scheduled={"good": 64}))
        assert [save.req_id for save in meta.saves] == ["good"] and counted == []
    finally:
        producer.close()


def test_a_notice_address_zmq_refuses_costs_the_notice_only() -> None:
    """The address "tcp://-:1" passed a loose pattern and made ZMQ's connect raise inside vLLM's
    scheduler, which ended the engine; now the push goes on without a notice, counted."""
    counted: list[str] = []
    scheduler = ProducerScheduler(counted.append)
    try:
        for index, address in enumerate(("tcp://-:1", "tcp://h:0", "tcp://h:99999", "tcp://a b:1")):
            params = {"ret_first_tok": True, "disagg_spec": SPEC, NOTICE_KEY: address}
            req = request(f"n{index}", [1, 2, 3], params, outputs=[9])
            scheduler.update_state_after_alloc(req, None, 0)
            assert scheduler.request_finished(req) == {"first_tok": 9, "disagg_req_id": "d-1"}
        assert counted == ["bad_transfer_params"] * 4
    finally:
        scheduler.close()


def test_consumer_scheduler_loads_all_but_the_last_token_past_decodes_own_hit() -> None:
    scheduler = ConsumerScheduler()
    req = request("c", list(range(201)), {"disagg_spec": SPEC})
    assert scheduler.get_num_new_matched_tokens(req, 0) == (200, True)
    assert scheduler.get_num_new_matched_tokens(req, 64) == (136, True)
    # decode's own hit ends inside a chunk (a block boundary): the rest is still loaded
    assert scheduler.get_num_new_matched_tokens(req, 32) == (168, True)
    assert scheduler.get_num_new_matched_tokens(req, 200) == (0, False)  # decode has it all
    assert scheduler.get_num_new_matched_tokens(request("one", [5], {"disagg_spec": SPEC}), 0) == (
        0,
        False,
    )
    blocks = SimpleNamespace(get_block_ids=lambda: ([3, 1, 4, 1, 5, 9, 2],))
    scheduler.update_state_after_alloc(req, blocks, 168)
    [load] = scheduler.build_connector_meta(step()).loads
    assert (load.disagg_req_id, len(load.prompt), load.start, load.block_ids[0]) == (
        "d-1",
        200,
        32,
        3,
    )
    assert scheduler.build_connector_meta(step()).loads == []


def test_a_request_decode_needs_no_kv_for_has_its_chunks_released_at_once() -> None:
    """Decode's own prefix cache covered the prompt: nothing is loaded, and the consumer is told
    to let the request's chunks go (not hold them until the claim timeout)."""
    scheduler = ConsumerScheduler()
    req = request("c", list(range(201)), {"disagg_spec": SPEC})
    assert scheduler.get_num_new_matched_tokens(req, 200) == (0, False)
    scheduler.update_state_after_alloc(req, None, 0)
    meta = scheduler.build_connector_meta(step())
    assert (meta.loads, meta.unneeded) == ([], {"d-1"})
    assert scheduler.build_connector_meta(step()).unneeded == set()
    plain = request("plain", [1, 2, 3], None)  # control: no spec, nothing to release
    scheduler.update_state_after_alloc(plain, None, 0)
    assert scheduler.build_connector_meta(step()).unneeded == set()


def test_decode_keeps_the_chunks_of_a_prompt_it_computed_once_the_prompt_is_computed() -> None:
    """A request decode serves alone, its prompt computed over two steps past a one-block hit:
    the step that computes its last token lists its whole chunks for the worker to keep, from
    the chunk its hit ends in, with every block it has by then. Controls: a disaggregated
    request (its KV was pushed), one shorter than a chunk, and one that ends before its prompt
    is computed are not kept."""
    scheduler = ConsumerScheduler(computed=ComputedPrompts(CHUNK))
    prompt = list(range(1000, 1200))
    alone = request("a", prompt, None, cache_salt="s")
    pushed = request("p", list(range(200)), {"disagg_spec": SPEC})
    short = request("s", list(range(CHUNK - 1)), None)
    ended = request("e", list(range(300, 500)), None)
    for req in (alone, pushed, short, ended):
        scheduler.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([],)), 0)
    new = [("a", [0, 1, 2, 3], BLOCK), ("p", [9], 199), ("s", [8], 0), ("e", [20, 21], 0)]
    first = scheduler.build_connector_meta(
        step(new=new, scheduled={"a": 100, "p": 1, "s": CHUNK - 1, "e": 100})
    )
    assert first.keeps == []  # "a" computed 132 of 200 tokens; "s" has no whole chunk
    scheduler.request_finished(ended)
    second = scheduler.build_connector_meta(
        step(cached=[("a", [4, 5, 6], 132), ("e", [], 100)], scheduled={"a": 68, "e": 100})
    )
    assert second.keeps == [KeepRequest("a", prompt[:192], [0, 1, 2, 3, 4, 5, 6], 0, "s")]
    assert scheduler.build_connector_meta(step(cached=[("a", [], 200)])).keeps == []


IMAGES = ((40, 19, "a1b2"), (3, 19, "c3d4"))  # out of order: vLLM's are sorted, ours are


def write_adapter(folder: Path, weights: bytes) -> Path:
    """An adapter folder with the files vLLM reads (their bytes only: nothing parses them)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


def settled(half: ProducerScheduler | ConsumerScheduler, req: SimpleNamespace) -> tuple:
    """``get_num_new_matched_tokens``'s answer once it is not "ask again" (the request's
    adapter's files read)."""
    answers: list[tuple] = []
    wait_for(
        lambda: (
            answers.append(half.get_num_new_matched_tokens(req, 0)) or answers[-1][0] is not None
        ),
        what="the adapter's files read",
    )
    return answers[-1]


@pytest.mark.parametrize(
    ("salt", "lora", "tags", "mm"),
    [
        ("tenant-a", None, (), ()),
        (None, "tuned", (), ()),
        (None, None, (("tenant", "a"), ("user", "x")), ()),
        (None, None, (), IMAGES),
        (None, None, (), ()),
    ],
)
def test_both_scheduler_halves_pass_the_requests_key_scope_to_their_worker(
    salt: str | None,
    lora: str | None,
    tags: tuple[tuple[str, str], ...],
    mm: tuple[tuple[int, int, str], ...],
    tmp_path: Path,
) -> None:
    """The workers key a request's chunks with its ``cache_salt``, its LoRA adapter (name, path
    and a digest of its files), its LMCache tags (``lmcache.tag.*`` in its kv_transfer_params,
    as LMCache's users send them) and its images (vLLM's hash of each at its placeholders,
    sorted by position): every save carries them, and so does the load; a request without them
    carries none (the control)."""
    blocks = SimpleNamespace(get_block_ids=lambda: ([3, 1, 4, 1],))
    params = {"disagg_spec": SPEC} | {f"lmcache.tag.{name}": value for name, value in tags}
    folder = write_adapter(tmp_path / "tuned", b"weights") if lora else None
    producer = ProducerScheduler()
    req = request(
        "r", list(range(150)), params, cache_salt=salt, lora=lora, mm=mm, lora_path=folder
    )
    assert settled(producer, req) == (0, False)
    producer.update_state_after_alloc(req, None, 0)
    first = producer.build_connector_meta(step(new=[("r", [4, 5], 0)], scheduled={"r": 64}))
    later = producer.build_connector_meta(step(cached=[("r", [6], 64)], scheduled={"r": 86}))
    scopes = [(s.cache_salt, s.lora, s.tags, s.mm) for s in first.saves + later.saves]
    digest = None if folder is None else folder_digest(folder, 1 << 20, time.monotonic() + 5)
    adapter = None if lora is None else f"{lora}\0{folder}\0{digest}"  # name, path, files
    assert scopes == [(salt, adapter, tags, tuple(sorted(mm)))] * 2
    consumer = ConsumerScheduler()
    req = request(
        "c", list(range(201)), params, cache_salt=salt, lora=lora, mm=mm, lora_path=folder
    )
    assert settled(consumer, req) == (200, True)
    consumer.update_state_after_alloc(req, blocks, 200)
    [load] = consumer.build_connector_meta(step()).loads
    assert (load.cache_salt, load.lora, load.tags, load.mm) == (
        salt,
        adapter,
        tags,
        tuple(sorted(mm)),
    )
    producer.close()
    consumer.close()


def test_one_adapter_name_and_path_holding_other_files_keys_other_chunks(tmp_path: Path) -> None:
    """Two hosts (or one file replaced between starts) hold other weights under one adapter
    name and path: prefill's pushed chunks and decode's expected ones get other keys, so decode
    loads none of them (it computes the prompt), never another adapter's KV. The control: the
    same files, the same keys."""
    folder = tmp_path / "tuned"
    prompt = list(range(201))
    blocks = SimpleNamespace(get_block_ids=lambda: ([3, 1, 4, 1],))

    def pushed(weights: bytes) -> list:
        write_adapter(folder, weights)
        producer = ProducerScheduler()  # a process of its own: another host, or a restart
        req = request("r", prompt[:-1], {"disagg_spec": SPEC}, lora="tuned", lora_path=folder)
        settled(producer, req)
        producer.update_state_after_alloc(req, None, 0)
        meta = producer.build_connector_meta(step(new=[("r", [4], 0)], scheduled={"r": 200}))
        producer.close()
        return make_keyer(chunk_size=CHUNK).chunk_keys(prompt[:-1], lora=meta.saves[0].lora)

    def expected(weights: bytes) -> list:
        write_adapter(folder, weights)
        consumer = ConsumerScheduler()
        req = request("c", prompt, {"disagg_spec": SPEC}, lora="tuned", lora_path=folder)
        assert settled(consumer, req) == (200, True)
        consumer.update_state_after_alloc(req, blocks, 200)
        [load] = consumer.build_connector_meta(step()).loads
        consumer.close()
        return make_keyer(chunk_size=CHUNK).chunk_keys(load.prompt, lora=load.lora)

    on_prefill = pushed(b"weights of one adapter")
    assert not {k.key for k in expected(b"weights of another")} & {k.key for k in on_prefill}
    assert expected(b"weights of one adapter") == on_prefill  # the control


def test_an_adapter_scope_differs_by_name_path_and_files(tmp_path: Path) -> None:
    """As vLLM's own prefix cache keys it, by name and path; and by what the files hold."""
    one, same, other = (
        write_adapter(tmp_path / n, w) for n, w in [("1", b"a"), ("2", b"a"), ("3", b"b")]
    )
    identities = AdapterIdentities()

    def scope(name: str, folder: Path) -> str:
        req = SimpleNamespace(lora_request=SimpleNamespace(lora_name=name, lora_path=str(folder)))
        answers: list = []
        wait_for(
            lambda: answers.append(identities.of(req)) or answers[-1] is not AdapterState.PENDING
        )
        return answers[-1]

    assert scope("tuned", one) == scope("tuned", one)
    assert scope("tuned", one) != scope("other", one)
    assert scope("tuned", one) != scope("tuned", same)  # the same files on another path
    assert scope("tuned", one).split("\0")[2] == scope("tuned", same).split("\0")[2]
    assert scope("tuned", one).split("\0")[2] != scope("tuned", other).split("\0")[2]
    assert identities.of(SimpleNamespace(lora_request=None)) is None  # the base model
    identities.close()


@pytest.mark.parametrize(
    ("why", "bounds"),
    [("missing", {}), ("too large", {"max_bytes": 10}), ("too slow", {"timeout_s": 0.0})],
)
def test_an_adapter_whose_files_cannot_be_read_is_served_without_disaggregation(
    tmp_path: Path, why: str, bounds: dict
) -> None:
    """Prefill pushes nothing of it and decode computes its prompt (the pushed chunks, if any,
    released), each counted and logged; never a load under keys that do not name its files."""
    folder = tmp_path / "nothing" if why == "missing" else write_adapter(tmp_path / "a", b"x" * 64)
    counted: list[str] = []
    producer = ProducerScheduler(counted.append, adapters=AdapterIdentities(**bounds))
    req = request("r", list(range(150)), {"disagg_spec": SPEC}, lora="tuned", lora_path=folder)
    assert settled(producer, req) == (0, False)
    producer.update_state_after_alloc(req, None, 0)
    assert (
        producer.build_connector_meta(step(new=[("r", [4], 0)], scheduled={"r": 150})).saves == []
    )
    consumer = ConsumerScheduler(counted.append, adapters=AdapterIdentities(**bounds))
    req = request("c", list(range(151)), {"disagg_spec": SPEC}, lora="tuned", lora_path=folder)
    assert settled(consumer, req) == (0, False)
    consumer.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: ([3],)), 0)
    meta = consumer.build_connector_meta(step())
    assert (meta.loads, meta.unneeded) == ([], {"d-1"})
    assert counted == ["adapters_unreadable"] * 2
    producer.close()
    consumer.close()


def test_an_image_requests_chunks_are_not_published_under_the_proxys_keys() -> None:
    """The proxy keys a prompt's blocks by its tokens alone, and an image's placeholder tokens
    are the same for every image: decode's landed chunks of a request with an image, loaded or
    computed and kept, are not published as KV events, or the proxy would send a request of
    another image to them. The same text request's are (the control)."""
    learned: list[list[int]] = []
    landed = SimpleNamespace(learn=lambda prompt, salt: learned.append(prompt))
    scheduler = ConsumerScheduler(computed=ComputedPrompts(CHUNK), landed=landed)
    blocks = SimpleNamespace(get_block_ids=lambda: ([0, 1, 2, 3, 4, 5, 6],))
    prompt = list(range(201))
    for name, mm in (("image", IMAGES), ("text", ())):
        pushed = request(f"p-{name}", prompt, {"disagg_spec": SPEC | {"req_id": name}}, mm=mm)
        scheduler.get_num_new_matched_tokens(pushed, 0)
        scheduler.update_state_after_alloc(pushed, blocks, 200)
        alone = request(f"a-{name}", prompt, None, mm=mm)
        scheduler.update_state_after_alloc(alone, blocks, 0)
        meta = scheduler.build_connector_meta(
            step(new=[(f"a-{name}", list(range(7)), 0)], scheduled={f"a-{name}": 201})
        )
        [keep] = meta.keeps
        assert keep.mm == tuple(sorted(mm))
    assert learned == [prompt[:200], prompt[:192]]  # the text request's load, then its keep


@pytest.mark.parametrize(
    ("options", "priority", "keeps"),
    [
        ({"lmcache.skip_save": True}, 0, False),
        ({}, 5, False),  # past priority_limit
        ({"lmcache.skip_save": False}, 3, True),  # the controls: at the limit, or under it
        ({}, 0, True),
    ],
)
def test_a_request_that_keeps_nothing_has_decode_cache_none_of_its_kv(
    options: dict, priority: int, keeps: bool
) -> None:
    """``lmcache.skip_save``, or a priority above ``priority_limit``: the request's KV is still
    pushed and loaded, but its chunks leave the consumer's cache as they are released
    (``uncached``), loaded or not needed; served alone, its computed chunks are not kept."""
    blocks = SimpleNamespace(get_block_ids=lambda: ([3, 1, 4, 1],))
    scheduler = ConsumerScheduler(computed=ComputedPrompts(CHUNK), priority_limit=3)
    loaded = request("c", list(range(201)), {"disagg_spec": SPEC} | options)
    unneeded = request("u", list(range(201)), {"disagg_spec": SPEC | {"req_id": "d-2"}} | options)
    alone = request("a", list(range(1000, 1200)), options or None)
    for req in (loaded, unneeded, alone):
        req.priority = priority
    assert scheduler.get_num_new_matched_tokens(loaded, 0) == (200, True)
    scheduler.update_state_after_alloc(loaded, blocks, 200)
    scheduler.update_state_after_alloc(unneeded, blocks, 0)
    scheduler.update_state_after_alloc(alone, blocks, 0)
    meta = scheduler.build_connector_meta(step(new=[("a", [0, 1, 2, 3], 0)], scheduled={"a": 200}))
    assert [load.disagg_req_id for load in meta.loads] == ["d-1"]  # loaded all the same
    assert meta.unneeded == {"d-2"}
    assert meta.uncached == (set() if keeps else {"d-1", "d-2"})
    assert [keep.req_id for keep in meta.keeps] == (["a"] if keeps else [])
    assert scheduler.build_connector_meta(step()).uncached == set()


def paged_cache(num_blocks: int, seed: int | None) -> dict[str, torch.Tensor]:
    """Four layers of a CPU cache (num_blocks, kv_heads, block, 2 * head) in one buffer."""
    buffer = torch.zeros(4, num_blocks, 2, BLOCK, 2 * 16)
    if seed is not None:
        buffer.normal_(generator=torch.Generator().manual_seed(seed))
    return {f"layer.{i}": buffer[i] for i in range(4)}


@dataclass
class Workers:
    """A producer worker and a consumer worker joined by real NIXL, with their counters."""

    producer: ProducerWorker
    consumer: ConsumerWorker
    source: dict[str, torch.Tensor]
    target: dict[str, torch.Tensor]
    spec: DisaggSpec
    producer_stats: StatsRecorder
    consumer_stats: StatsRecorder
    keyer: ChunkKeyer
    common: dict
    board: Path

    def consumer_total(self, name: str) -> float:
        """A counter or gauge of the consumer rank, as the next step exports it (its process
        answers a step's question by the following step: wait for a value, do not read one)."""
        self.consumer.finished_loads()
        return self.consumer_stats.totals().get(name, 0)

    def consumer_used_pages(self) -> float:
        return self.consumer_total("consumer_used_pages")

    def consumer_service_count(self, name: str) -> int:
        """One of the consumer process's own counters (they come with its answers; not all
        are exported to /metrics)."""
        self.consumer.finished_loads()
        return self.consumer._service.stats.get(name, 0)

    def producer_with(self, **overrides: object) -> ProducerWorker:
        """Another producer worker over the same source cache, with other settings."""
        config = load_config(
            None, environ={}, kv_role="kv_producer", **{**self.common, **overrides}
        )
        return ProducerWorker(config, self.keyer, self.source, self.producer_stats)


@pytest.fixture
def workers(tmp_path: Path):
    init_port, alloc_port = free_port(), free_port()
    keyer = make_keyer(model_name="m", chunk_size=CHUNK)
    common = {
        "chunk_size": CHUNK,
        "buffer_size_bytes": 64 << 20,
        "init_port": init_port,
        "alloc_port": alloc_port,
        "load_timeout_s": 2.0,
    }
    source, target = paged_cache(40, seed=1), paged_cache(40, seed=None)
    consumer_stats, producer_stats = StatsRecorder("c"), StatsRecorder("p")
    consumer = ConsumerWorker(
        load_config(None, environ={}, kv_role="kv_consumer", **common),
        keyer,
        target,
        consumer_stats,
        board=tmp_path / "landed",
    )
    producer = ProducerWorker(
        load_config(None, environ={}, kv_role="kv_producer", **common),
        keyer,
        source,
        producer_stats,
    )
    spec = DisaggSpec("d-1", "127.0.0.1", init_port, alloc_port)
    pair = Workers(
        producer,
        consumer,
        source,
        target,
        spec,
        producer_stats,
        consumer_stats,
        keyer,
        common,
        tmp_path / "landed",
    )
    yield pair
    pair.producer.close()
    consumer.close()


def finish(consumer: ConsumerWorker, timeout_s: float = 10.0) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        received, failed = consumer.finished_loads()
        if received or time.monotonic() > deadline:
            return received, failed
        time.sleep(0.01)


def save(req_id: str, spec: DisaggSpec, prompt: list[int], blocks: list[int], computed: int):
    return PDConnectorMetadata(saves=[SaveRequest(req_id, spec, prompt, blocks, computed)])


def load(req_id: str, disagg_req_id: str, prompt: list[int], blocks: list[int]):
    return PDConnectorMetadata(loads=[LoadRequest(req_id, disagg_req_id, prompt, blocks, 0)])


@pytest.mark.processes
def test_kv_moves_from_producer_blocks_to_consumer_blocks_over_nixl(workers: Workers) -> None:
    prompt = list(range(1000, 1150))  # 2 full chunks and a partial one, over chunked prefill
    src_blocks = [7, 3, 12, 20, 5]
    dst_blocks = [1, 30, 2, 9, 11]
    workers.producer.wait_for_save(save("p", workers.spec, prompt, src_blocks[:2], 64))
    # the next step ships only what changed: the blocks added since, not the prompt
    workers.producer.wait_for_save(save("p", workers.spec, None, src_blocks[2:], 150))
    workers.consumer.start_load_kv(load("c", "d-1", prompt, dst_blocks))
    assert finish(workers.consumer) == ({"c"}, set())
    for name in workers.source:
        assert torch.equal(workers.source[name][src_blocks], workers.target[name][dst_blocks])
    untouched = [b for b in range(40) if b not in dst_blocks]
    assert not any(workers.target[name][untouched].any() for name in workers.target)
    assert workers.consumer_stats.totals()["tokens_loaded"] == 150
    wait_for(lambda: workers.consumer_used_pages() == 0, what="pages back")
    # the consumer rank's own count, exported
    wait_for(lambda: workers.consumer_total("consumer_chunks_landed") == 3, what="count")
    # the scheduler is told when the pushes are over (vLLM stops stepping for them then)
    wait_for(lambda: workers.producer.progress().outstanding == 0, what="pushes reported done")
    workers.producer.wait_for_save(PDConnectorMetadata(finished={"p"}))
    assert workers.producer._saving == {}  # nothing kept of a finished request


@pytest.mark.processes
def test_a_load_past_decodes_own_hit_writes_only_the_blocks_it_lacks(workers: Workers) -> None:
    """Decode's own cache holds the prompt's first block (shared with other requests): the
    load starts there, inside the first chunk, and scatters only that chunk's later blocks."""
    prompt = list(range(2000, 2150))
    src_blocks, dst_blocks = [7, 3, 12, 20, 5], [1, 30, 2, 9, 11]
    workers.producer.wait_for_save(save("p", workers.spec, prompt, src_blocks, 150))
    workers.consumer.start_load_kv(
        PDConnectorMetadata(loads=[LoadRequest("c", "d-1", prompt, dst_blocks, BLOCK)])
    )
    assert finish(workers.consumer) == ({"c"}, set())
    for name in workers.source:
        assert torch.equal(
            workers.source[name][src_blocks[1:]], workers.target[name][dst_blocks[1:]]
        )
        assert not workers.target[name][dst_blocks[0]].any()  # decode's own block: untouched
    assert workers.consumer_stats.totals()["tokens_loaded"] == 150 - BLOCK
    wait_for(lambda: workers.consumer_used_pages() == 0, what="pages back")


@pytest.mark.parametrize("corrupted", [True, False])
@pytest.mark.processes
def test_a_chunk_that_fails_its_checksum_while_scattered_fails_the_load(
    workers: Workers, corrupted: bool
) -> None:
    """The checksum is checked in the pass that scatters a chunk, so a bad chunk's bytes are in
    decode's blocks by the time it is known: the load must then be reported failed (vLLM
    recomputes the prompt over those blocks), never received. Unchanged bytes: the control."""
    prompt = list(range(3000, 3150))
    src_blocks, dst_blocks = [7, 3, 12, 20, 5], [1, 30, 2, 9, 11]
    workers.producer.wait_for_save(save("p", workers.spec, prompt, src_blocks, 150))
    wait_for(lambda: workers.consumer_total("consumer_chunks_landed") == 3, what="landed")
    if corrupted:  # one bit of every page, after the write: whichever pages the chunks took
        service = workers.consumer._service
        service.buffer[: -PROBE_AREA_BYTES : service.page_bytes] ^= 1
    workers.consumer.start_load_kv(load("c", "d-1", prompt, dst_blocks))
    received, failed = finish(workers.consumer)
    assert (received, failed) == ({"c"}, {"c"} if corrupted else set())
    totals = workers.consumer_stats.totals()
    assert totals.get("integrity_failures", 0) == (1 if corrupted else 0)
    assert totals.get("tokens_loaded", 0) == (0 if corrupted else 150)
    wait_for(lambda: workers.consumer_used_pages() == 0, what="pages back")


@pytest.mark.processes
def test_a_chunk_decode_has_itself_is_not_written_when_its_claim_comes_first(
    workers: Workers,
) -> None:
    """Decode's claim (its own cache holds the first chunk) reaches the consumer before the
    push: that chunk is answered "not needed" and never written; the rest lands and loads."""
    prompt = list(range(4000, 4150))
    src_blocks, dst_blocks = [7, 3, 12, 20, 5], [1, 30, 2, 9, 11]
    workers.consumer.start_load_kv(
        PDConnectorMetadata(loads=[LoadRequest("c", "d-1", prompt, dst_blocks, CHUNK)])
    )
    workers.producer.wait_for_save(save("p", workers.spec, prompt, src_blocks, 150))
    assert finish(workers.consumer) == ({"c"}, set())
    for name in workers.source:
        assert torch.equal(
            workers.source[name][src_blocks[2:]], workers.target[name][dst_blocks[2:]]
        )
        assert not workers.target[name][dst_blocks[:2]].any()  # decode's own: untouched
    wait_for(lambda: workers.producer.progress().outstanding == 0, what="pushes reported done")
    totals = workers.producer_stats.totals()
    assert (totals["chunks_pushed"], totals["chunks_skipped"]) == (2, 1)


@pytest.mark.processes
def test_chunks_decode_needs_no_more_are_released_at_once(workers: Workers) -> None:
    prompt = list(range(3000, 3150))
    workers.producer.wait_for_save(save("p", workers.spec, prompt, [7, 3, 12, 20, 5], 150))
    wait_for(lambda: workers.consumer_used_pages() == 3, what="chunks landed")
    workers.consumer.start_load_kv(PDConnectorMetadata(unneeded={"d-1"}))
    wait_for(lambda: workers.consumer_total("consumer_held_requests") == 0, what="let go")
    assert workers.consumer_stats.totals()["loads_unneeded"] == 1
    # its pages are free (or cached) once their writes are confirmed, not at the claim timeout
    wait_for(lambda: workers.consumer_used_pages() == 0, timeout_s=2.0, what="pages back")


@pytest.mark.processes
def test_chunks_pushed_under_one_cache_salt_serve_no_request_of_another(
    workers: Workers,
) -> None:
    """Tenants' KV stays apart on the consumer: a load under another salt never finds the chunks
    pushed under the first (it fails at its deadline), and a push of the same prompt under
    another salt is written afresh, not answered "already held"; only the same salt shares the
    landed chunks (the control)."""
    prompt = list(range(5000, 5150))  # two full chunks and a partial one
    src_blocks, dst_blocks = [7, 3, 12, 20, 5], [1, 30, 2, 9, 11]

    def push(name: str, salt: str | None) -> tuple[float, float]:
        """Push the prompt under ``salt`` as request ``d-<name>``: chunks (written, skipped)."""
        spec = msgspec.structs.replace(workers.spec, req_id=f"d-{name}")
        saving = SaveRequest(f"p-{name}", spec, prompt, src_blocks, 150, cache_salt=salt)
        workers.producer.wait_for_save(PDConnectorMetadata(saves=[saving]))
        wait_for(lambda: workers.producer.progress().outstanding == 0, what="pushes done")
        totals = workers.producer_stats.totals()
        return totals.get("chunks_pushed", 0), totals.get("chunks_skipped", 0)

    def load_as(name: str, disagg_req_id: str, salt: str | None) -> tuple[set[str], set[str]]:
        loading = LoadRequest(name, disagg_req_id, prompt, dst_blocks, 0, cache_salt=salt)
        workers.consumer.start_load_kv(PDConnectorMetadata(loads=[loading]))
        return finish(workers.consumer)

    assert push("a", "tenant-a") == (3, 0)
    assert load_as("c-b-on-a", "d-a", "tenant-b") == ({"c-b-on-a"}, {"c-b-on-a"})
    assert workers.consumer_stats.totals()["load_timeouts"] == 1
    assert not any(workers.target[name].any() for name in workers.target)  # nothing of a's
    assert push("b", "tenant-b") == (6, 0)  # a's chunks, landed and cached, are not b's
    assert load_as("c-b", "d-b", "tenant-b") == ({"c-b"}, set())
    for name in workers.source:
        assert torch.equal(workers.source[name][src_blocks], workers.target[name][dst_blocks])
    assert push("b-again", "tenant-b") == (6, 3)  # control: the same salt shares them all
    assert push("unsalted", None) == (9, 3)
    wait_for(lambda: workers.consumer_total("consumer_cache_hits") == 3, what="hits counted")


@pytest.mark.processes
def test_lmcache_tags_part_chunks_and_a_request_keeping_nothing_leaves_none_cached(
    workers: Workers,
) -> None:
    """Chunks pushed under one set of LMCache tags are written afresh for another, and shared
    ("already held") under the same tags (the control); a request loaded with ``uncached``
    (``lmcache.skip_save``) leaves none of its chunks in the consumer's cache, so the same
    prompt is written again, where after a request that keeps them it is not (the control)."""
    src_blocks, dst_blocks = [7, 3, 12, 20, 5], [1, 30, 2, 9, 11]
    a, b = (("tenant", "a"),), (("tenant", "b"),)

    def push(name: str, prompt: list[int], tags: tuple) -> tuple[float, float]:
        """Push ``prompt`` under ``tags`` as request ``d-<name>``: chunks (written, skipped)."""
        spec = msgspec.structs.replace(workers.spec, req_id=f"d-{name}")
        saving = SaveRequest(f"p-{name}", spec, prompt, src_blocks, 150, tags=tags)
        workers.producer.wait_for_save(PDConnectorMetadata(saves=[saving]))
        wait_for(lambda: workers.producer.progress().outstanding == 0, what="pushes done")
        totals = workers.producer_stats.totals()
        return totals.get("chunks_pushed", 0), totals.get("chunks_skipped", 0)

    def load_and_release(name: str, prompt: list[int], tags: tuple, keep: bool) -> None:
        loading = LoadRequest(name, f"d-{name}", prompt, dst_blocks, 0, tags=tags)
        uncached = set() if keep else {f"d-{name}"}
        workers.consumer.start_load_kv(PDConnectorMetadata(loads=[loading], uncached=uncached))
        assert finish(workers.consumer) == ({name}, set())

    tagged = list(range(6000, 6150))  # two full chunks and a partial one
    assert push("a", tagged, a) == (3, 0)
    assert push("b", tagged, b) == (6, 0)  # a's chunks are not b's
    assert push("a-again", tagged, a) == (6, 3)  # the control: the same tag shares them
    skipped, kept = list(range(7000, 7150)), list(range(8000, 8150))
    push("skip", skipped, ())
    load_and_release("skip", skipped, (), keep=False)
    push("keep", kept, ())
    load_and_release("keep", kept, (), keep=True)
    assert push("skip-again", skipped, ()) == (15, 3)  # written again: none was cached
    assert push("keep-again", kept, ()) == (15, 6)  # the control: all three were
    wait_for(lambda: workers.consumer_total("consumer_cache_not_kept") == 3, what="counted")


@pytest.mark.processes
def test_kv_that_never_lands_fails_the_load_at_its_deadline(workers: Workers) -> None:
    started = time.monotonic()
    workers.consumer.start_load_kv(load("c", "never", list(range(70)), [1, 2, 3]))
    assert finish(workers.consumer) == ({"c"}, {"c"})
    assert 2.0 <= time.monotonic() - started < 4.0
    assert not any(layer.any() for layer in workers.target.values())
    assert workers.consumer_stats.totals()["load_timeouts"] == 1


@pytest.mark.processes
def test_a_request_that_ends_while_its_kv_is_awaited_is_released_at_once(
    workers: Workers,
) -> None:
    """The client went away: vLLM holds the request's blocks until the load is reported, so the
    worker reports it at the next step (not at the deadline) and gives its pages back."""
    workers.consumer.start_load_kv(load("c", "gone", list(range(70)), [1, 2, 3]))
    assert workers.consumer.finished_loads() == (set(), set())  # control: still awaited
    workers.consumer.start_load_kv(PDConnectorMetadata(finished={"c"}))
    assert workers.consumer.finished_loads() == ({"c"}, set())
    assert workers.consumer.finished_loads() == (set(), set())
    totals = workers.consumer_stats.totals()
    assert (totals["loads_aborted"], totals["load_timeouts"]) == (1, 0)
    wait_for(lambda: workers.consumer_used_pages() == 0, what="pages back")
    assert not any(layer.any() for layer in workers.target.values())


class GatedCopy:
    """A scatter as a GPU's copy stream runs it: done only once the test opens the gate."""

    def __init__(self, gate: threading.Event, digest: int | None) -> None:
        self._gate = gate
        self.digest = digest
        self.model_ordered = False

    def done(self) -> bool:
        return self._gate.is_set()

    def wait(self, deadline: float) -> None:
        if not self._gate.wait(max(0.0, deadline - time.monotonic())):
            raise TransferError("gated copy not done")

    def order_model(self) -> None:
        self.model_ordered = True


class GatedKV:
    """The consumer's real cache, whose scatters are reported done only once the test says so:
    the consumer worker as it runs beside a GPU copy stream that finishes later."""

    def __init__(self, cache) -> None:
        self._cache = cache
        self.gate = threading.Event()
        self.copies: list[GatedCopy] = []
        self.model_waits: list[bool] = []

    def __getattr__(self, name: str):
        return getattr(self._cache, name)

    def scatter_chunks(self, chunks, block_ids, start, hashed=False, model_waits=True):
        self.model_waits.append(model_waits)
        _, digests = self._cache.scatter_chunks(chunks, block_ids, start, hashed)
        self.copies.append(GatedCopy(self.gate, None))
        return self.copies[-1], digests


def step_until_scattered(consumer: ConsumerWorker, gated: GatedKV) -> set[str]:
    """Step the consumer until its scatters are issued; the requests it reported meanwhile."""
    reported: set[str] = set()

    def scattered() -> bool:
        reported.update(consumer.finished_loads()[0])
        return bool(gated.copies)

    wait_for(scattered, what="the scatters issued")
    return reported


def gate_scatters(consumer: ConsumerWorker) -> GatedKV:
    gated = GatedKV(consumer._sources[0][1])
    consumer._sources = [(keyer, gated) for keyer, _ in consumer._sources]
    return gated


@pytest.mark.processes
def test_an_asynchronous_load_is_reported_only_once_its_copy_is_done(workers: Workers) -> None:
    """On a GPU the model's stream does not wait for an asynchronous load's scatter (running
    decodes would stall for it): the load is reported received once the copy is seen done,
    and its pages go back then, not before."""
    gated = gate_scatters(workers.consumer)
    prompt = list(range(3000, 3100))
    workers.producer.wait_for_save(save("p", workers.spec, prompt, [4, 5, 6, 7], 100))
    workers.consumer.start_load_kv(load("c", "d-1", prompt, [8, 9, 10, 11]))
    assert step_until_scattered(workers.consumer, gated) == set()
    for _ in range(5):  # landed and scattered, copy not done: still awaited
        assert workers.consumer.finished_loads() == (set(), set())
        time.sleep(0.02)
    assert gated.model_waits == [False]  # the load's two chunks, in one call
    assert workers.consumer_used_pages() == 2
    assert workers.consumer_stats.totals()["loads_completed"] == 0
    gated.gate.set()
    assert workers.consumer.finished_loads() == ({"c"}, set())
    wait_for(lambda: workers.consumer_used_pages() == 0, what="pages back")
    for name in workers.source:
        assert torch.equal(workers.source[name][[4, 5, 6, 7]], workers.target[name][8:12])
    assert not any(copy.model_ordered for copy in gated.copies)


@pytest.mark.processes
def test_a_request_that_ends_while_its_copy_runs_orders_the_model_after_it(
    workers: Workers,
) -> None:
    """Aborted mid-copy: vLLM frees the blocks the copy still writes, so the model's next work
    waits for the copy, and the pages the copy still reads go back only once it is done."""
    gated = gate_scatters(workers.consumer)
    prompt = list(range(4000, 4064))
    workers.producer.wait_for_save(save("p", workers.spec, prompt, [4, 5], 64))
    workers.consumer.start_load_kv(load("c", "d-1", prompt, [8, 9]))
    assert step_until_scattered(workers.consumer, gated) == set()
    workers.consumer.start_load_kv(PDConnectorMetadata(finished={"c"}))
    assert workers.consumer.finished_loads() == ({"c"}, set())
    assert gated.copies[-1].model_ordered
    time.sleep(0.2)
    assert workers.consumer_used_pages() == 1  # the copy still reads its page
    gated.gate.set()
    wait_for(lambda: workers.consumer_used_pages() == 0, what="pages back")


@pytest.mark.processes
def test_staging_full_on_the_producer_fails_the_load_at_once(workers: Workers) -> None:
    """The producer cannot copy the KV out: it tells the consumer, whose load fails within a
    second (not at its 2 s deadline), and its later steps push nothing of that request."""
    prompt = list(range(300))
    chunk_bytes = 4 * (CHUNK // BLOCK) * 2 * BLOCK * 2 * 16 * 4  # layers x blocks x block bytes
    tight = workers.producer_with(buffer_size_bytes=2 * chunk_bytes, page_bytes=chunk_bytes)
    try:
        workers.consumer.start_load_kv(load("c", "d-1", prompt, list(range(5))))
        started = time.monotonic()
        # 4 chunks do not fit in 2 staging pages
        tight.wait_for_save(save("p", workers.spec, prompt, list(range(10, 15)), 300))
        assert finish(workers.consumer) == ({"c"}, {"c"})
        assert time.monotonic() - started < 1.0
    finally:
        tight.close()
    assert workers.consumer_stats.totals()["loads_abandoned"] == 1
    totals = workers.producer_stats.totals()
    assert (totals["staging_full"], totals["pushes_abandoned"], totals["pushes"]) == (1, 1, 0)


@pytest.mark.processes
def test_a_prefill_aborted_midway_fails_the_load_at_once(workers: Workers) -> None:
    prompt = list(range(200))
    workers.producer.wait_for_save(save("p", workers.spec, prompt, [7, 3], 64))
    workers.consumer.start_load_kv(load("c", "d-1", prompt, [1, 2, 4, 5, 6, 8, 9]))
    assert workers.consumer.finished_loads() == (set(), set())  # control: still awaited
    started = time.monotonic()
    workers.producer.wait_for_save(PDConnectorMetadata(finished={"p"}, aborted={"p"}))
    assert finish(workers.consumer) == ({"c"}, {"c"})
    assert time.monotonic() - started < 1.0
    wait_for(lambda: workers.consumer.finished_loads() == (set(), set()))
    wait_for(lambda: workers.consumer_used_pages() == 0, what="pages back")


@pytest.mark.processes
def test_a_consumer_that_never_answers_delays_no_push_to_another(workers: Workers) -> None:
    """A peer stuck in its handshake (here: an init port that takes requests and never
    answers) holds up only its own pushes: each consumer has its own sender thread."""
    with zmq.Context() as context, context.socket(zmq.ROUTER) as silent:
        silent.setsockopt(zmq.LINGER, 0)
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        stuck = DisaggSpec("d-stuck", "127.0.0.1", port, free_port())
        prompt = list(range(64))
        workers.producer.wait_for_save(save("p-stuck", stuck, prompt, [7, 3], 64))
        workers.producer.wait_for_save(save("p", workers.spec, prompt, [12, 20], 64))
        workers.consumer.start_load_kv(load("c", "d-1", prompt, [1, 30]))
        started = time.monotonic()
        assert finish(workers.consumer) == ({"c"}, set())
        assert time.monotonic() - started < 1.0  # the stuck handshake waits 5 s
        assert workers.producer.progress().outstanding == 1  # the stuck one, still running


@pytest.mark.processes
def test_a_backlog_for_an_unreachable_consumer_fails_fast_after_its_first_handshake(
    workers: Workers,
) -> None:
    """The consumer is gone (nothing answers its ports): the first push waits its handshake
    deadline, the ones queued behind it fail at once (each with a short, bounded notice), so
    a backlog does not hold the consumer's next pushes for a deadline each."""
    handshake_s = 2.0
    sender = workers.producer_with(handshake_timeout_s=handshake_s)
    gone = DisaggSpec("d-gone", "127.0.0.1", free_port(), free_port())
    prompt = list(range(64))
    started = time.monotonic()
    try:
        for index in range(4):
            request = msgspec.structs.replace(gone, req_id=f"d-gone-{index}")
            sender.wait_for_save(save(f"p-{index}", request, prompt, [7, 3], 64))
        wait_for(lambda: sender.progress().outstanding == 0, 20, "the backlog to drain")
    finally:
        sender.close()
    took = time.monotonic() - started
    # one handshake deadline and one notice, the rest at once (their notices wait for the
    # peer); without the down state, a handshake deadline and a notice each
    assert took < handshake_s + CANCEL_TIMEOUT_S + 1.5 < 4 * (handshake_s + CANCEL_TIMEOUT_S)
    assert workers.producer_stats.totals()["push_failures"] == 4


@pytest.mark.processes
def test_a_notice_the_consumer_missed_is_sent_again(
    workers: Workers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer could not hear the first notice (stopped, restarting): it is sent again a
    moment later, and its decode recomputes then, not at its load deadline."""
    real_abandon = Producer.abandon
    tries: list[float] = []

    def push_fails(self: Producer, spec: DisaggSpec, chunks, checksums) -> None:
        raise TransferError("NIXL write failed")

    def first_notice_lost(self: Producer, spec: DisaggSpec, *args, **kwargs) -> bool:
        tries.append(time.monotonic())
        return len(tries) > 1 and real_abandon(self, spec, *args, **kwargs)

    monkeypatch.setattr(Producer, "push", push_fails)
    monkeypatch.setattr(Producer, "abandon", first_notice_lost)
    prompt = list(range(64))
    workers.consumer.start_load_kv(load("c", "d-1", prompt, [1, 2]))
    workers.producer.wait_for_save(save("p", workers.spec, prompt, [7, 3], 64))
    assert finish(workers.consumer) == ({"c"}, {"c"})  # within its 2 s deadline: told
    assert len(tries) == 2 and 0.9 <= tries[1] - tries[0] < 1.5
    assert workers.consumer_stats.totals()["loads_abandoned"] == 1


@pytest.mark.processes
def test_known_consumers_are_connected_before_the_first_request(workers: Workers) -> None:
    peer = f"127.0.0.1:{workers.common['init_port']}:{workers.common['alloc_port']}"
    warm = workers.producer_with(warm_peers=[peer])
    try:
        wait_for(lambda: workers.consumer_service_count("init_requests") >= 2, what="handshake")
    finally:
        warm.close()
    assert workers.producer_stats.totals()["pushes"] == 0


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (TransferError("NIXL write failed"), "transfer_failed"),
        (PeerTimeout("transfer not done in time"), "transfer_failed"),
        (AllocationError("consumer refused: too_large"), "consumer_refused"),
        (BufferFull("consumer buffer full", 0.05), "consumer_refused"),
    ],
    ids=["nixl_error", "timeout", "refused", "buffer_full"],
)
@pytest.mark.processes
def test_each_kind_of_push_failure_has_the_decode_recompute_at_once(
    workers: Workers,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    error: Exception,
    reason: str,
) -> None:
    def push_fails(self: Producer, spec: DisaggSpec, chunks, checksums=None, *, fill) -> None:
        raise error

    monkeypatch.setattr(Producer, "push", push_fails)
    prompt = list(range(64))
    workers.consumer.start_load_kv(load("c", "d-1", prompt, [1, 2]))
    started = time.monotonic()
    workers.producer.wait_for_save(save("p", workers.spec, prompt, [7, 3], 64))
    assert finish(workers.consumer) == ({"c"}, {"c"})
    assert time.monotonic() - started < 1.0  # not the 2 s load deadline
    assert f"KV abandoned: {reason}" in caplog.text  # the consumer's reason, logged by decode
    assert workers.producer_stats.totals()["push_failures"] == 1


@pytest.mark.processes
def test_a_copy_out_that_fails_after_its_job_was_handed_over_writes_nothing(
    workers: Workers, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The sender asks for pages while the model-runner thread gathers the chunks: a gather
    that fails then fails the push (nothing written, decode told at once), gives the staging
    pages back, and the next request pushes as before (the control)."""
    cache = workers.producer._cache
    staging = workers.producer._staging
    free = staging.free_pages
    real = type(cache).gather

    def gather_fails(self, block_ids, start, end, out, *, hashed=False):
        raise RuntimeError("a copy-out bug")

    monkeypatch.setattr(type(cache), "gather", gather_fails)
    prompt = list(range(64))
    broken = msgspec.structs.replace(workers.spec, req_id="d-copy-fails")
    workers.consumer.start_load_kv(load("c-copy-fails", "d-copy-fails", prompt, [1, 2]))
    started = time.monotonic()
    workers.producer.wait_for_save(save("p-copy-fails", broken, prompt, [7, 3], 64))
    assert finish(workers.consumer) == ({"c-copy-fails"}, {"c-copy-fails"})  # recompute now
    assert time.monotonic() - started < 1.0  # not the 2 s load deadline
    assert "req d-copy-fails: copying its KV out failed" in caplog.text
    wait_for(lambda: workers.producer.progress().outstanding == 0, what="the failed job to end")
    assert staging.free_pages == free
    totals = workers.producer_stats.totals()
    # Failed after the sender asked for pages, or dropped before (the request abandoned).
    failed = totals.get("push_failures", 0) + totals.get("jobs_dropped", 0)
    assert (failed, totals.get("pushes", 0)) == (1, 0)
    monkeypatch.setattr(type(cache), "gather", real)
    workers.producer.wait_for_save(save("p", workers.spec, prompt, [12, 20], 64))
    workers.consumer.start_load_kv(load("c", "d-1", prompt, [3, 4]))
    assert finish(workers.consumer) == ({"c"}, set())
    assert workers.producer_stats.totals()["pushes"] == 1


@pytest.mark.processes
def test_a_sender_survives_an_unexpected_error_and_serves_on(
    workers: Workers, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Producer.push

    def push_once_broken(self: Producer, spec: DisaggSpec, chunks, checksums=None, *, fill):
        if spec.req_id == "d-broken":
            raise RuntimeError("a bug")
        return real(self, spec, chunks, checksums, fill=fill)

    monkeypatch.setattr(Producer, "push", push_once_broken)
    prompt = list(range(64))
    broken = msgspec.structs.replace(workers.spec, req_id="d-broken")
    workers.consumer.start_load_kv(load("c-broken", "d-broken", prompt, [1, 2]))
    workers.producer.wait_for_save(save("p-broken", broken, prompt, [7, 3], 64))
    assert finish(workers.consumer) == ({"c-broken"}, {"c-broken"})  # told: recompute now
    workers.producer.wait_for_save(save("p", workers.spec, prompt, [12, 20], 64))
    workers.consumer.start_load_kv(load("c", "d-1", prompt, [3, 4]))
    assert finish(workers.consumer) == ({"c"}, set())
    totals = workers.producer_stats.totals()
    assert (totals["thread_errors"], totals["pushes"]) == (1, 1)


@pytest.mark.parametrize("preempted", [True, False], ids=["preempted", "failed_load"])
def test_a_request_back_after_its_load_computes_its_prompt(preempted: bool) -> None:
    """Preempted after loading (or after a failed load), a request comes back with nothing
    computed; its chunks were released, and without a landed-chunk tier nothing of them can be
    found, so it is computed now, not awaited again; counted once, however often vLLM asks
    while it waits for blocks."""
    counted: list[str] = []
    scheduler = ConsumerScheduler(counted.append)
    req = request("c", list(range(201)), {"disagg_spec": SPEC})
    assert scheduler.get_num_new_matched_tokens(req, 0) == (200, True)  # control: first time
    blocks = SimpleNamespace(get_block_ids=lambda: ([3, 1, 4, 1],))
    scheduler.update_state_after_alloc(req, blocks, 200)
    assert len(scheduler.build_connector_meta(step()).loads) == 1
    req.num_preemptions = int(preempted)
    for _ in range(3):  # waiting for blocks, it is asked every step
        assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    scheduler.update_state_after_alloc(req, blocks, 0)
    assert scheduler.build_connector_meta(step()).loads == []
    assert counted == (["preemption_recomputes"] if preempted else [])
    scheduler.request_finished(req)  # a new request of the same id is served afresh
    assert scheduler.get_num_new_matched_tokens(req, 0) == (200, True)


def test_a_request_preempted_after_its_load_loads_again_what_its_consumer_still_holds(
    tmp_path: Path,
) -> None:
    """Its pushed chunks went to the consumer's cache when it loaded: after a preemption it
    loads the whole chunks still there (synchronously, as a request served alone does) and
    computes the rest, once per preemption; a reload that failed is computed, not tried
    again. The control: chunks no longer there are computed."""
    keyer = make_keyer(chunk_size=CHUNK)
    writer = KeysWriter(tmp_path / "keys", max_keys=64)
    landed = LandedChunks([keyer], [tmp_path / "keys"])
    counted: list[str] = []
    scheduler = ConsumerScheduler(counted.append, chunk_size=CHUNK, landed_chunks=landed)
    prompt = list(range(201))
    req = request("c", prompt, {"disagg_spec": SPEC})
    blocks = SimpleNamespace(get_block_ids=lambda: ([3, 1, 4, 1],))
    assert scheduler.get_num_new_matched_tokens(req, 0) == (200, True)
    scheduler.update_state_after_alloc(req, blocks, 200)
    scheduler.build_connector_meta(step())
    chunks = keyer.chunk_keys(prompt[:-1])
    writer.post([chunk.key for chunk in chunks[:2]])  # two whole chunks stayed (128 tokens)
    req.num_preemptions = 1
    assert scheduler.get_num_new_matched_tokens(req, 0) == (2 * CHUNK, False)
    scheduler.update_state_after_alloc(req, blocks, 2 * CHUNK)
    [reload] = scheduler.build_connector_meta(step()).loads
    assert (reload.local, reload.sync, reload.start) == (True, True, 0)
    assert reload.prompt == prompt[: 2 * CHUNK] and reload.req_id == "c"
    assert counted == ["loads_local", "preemption_reloads"]
    # That reload failed (vLLM asks again, no new preemption): computed, not tried again.
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    req.num_preemptions = 2  # preempted once more: one more reload, past its own cache's hit
    assert scheduler.get_num_new_matched_tokens(req, CHUNK) == (CHUNK, False)
    writer.post([])  # control: evicted from the consumer's cache meanwhile
    req.num_preemptions = 3
    counted.clear()
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    scheduler.update_state_after_alloc(req, blocks, 0)
    assert scheduler.build_connector_meta(step()).loads == []
    assert counted == ["preemption_recomputes"]
    landed.close()
    writer.close()


@pytest.mark.processes
def test_a_consumer_process_that_dies_fails_the_pending_loads_at_once(workers: Workers) -> None:
    """Its KV can no longer land: the loads waiting for it are recomputed at the next step,
    not at their deadline, and later loads fail the same way."""
    workers.consumer.start_load_kv(load("c", "d-1", list(range(70)), [1, 2, 3]))
    assert workers.consumer.finished_loads() == (set(), set())  # control: still awaited
    os.kill(workers.consumer._service.pid, signal.SIGKILL)
    started = time.monotonic()
    assert finish(workers.consumer) == ({"c"}, {"c"})
    workers.consumer.start_load_kv(load("c2", "d-2", list(range(70)), [4, 5, 6]))
    assert finish(workers.consumer) == ({"c2"}, {"c2"})
    # Each load's deadline is 2 s (4 s for both); 1.3 s was seen beside a vLLM test's load.
    assert time.monotonic() - started < 1.9
    totals = workers.consumer_stats.totals()
    assert (totals["loads_abandoned"], totals["consumer_process_down"]) == (2, 1)


def test_the_scheduler_loads_synchronously_only_kv_landed_on_every_rank(tmp_path: Path) -> None:
    """A request is loaded before its first step only once both ranks posted all of its
    prompt's chunks landed (200 tokens of KV: 4 chunks of 64); before that, or with no boards
    (``sync_loads`` off: the control), its load is asynchronous."""
    paths = [tmp_path / "rank0", tmp_path / "rank1"]
    rank0 = landed_board.BoardWriter(paths[0])
    rank0.post({"d-1": 4})
    scheduler = ConsumerScheduler(chunk_size=CHUNK, boards=paths)
    req = request("c", list(range(201)), {"disagg_spec": SPEC})
    assert scheduler.get_num_new_matched_tokens(req, 0) == (200, True)  # rank 1 has no board
    rank1 = landed_board.BoardWriter(paths[1])  # its consumer process started
    rank1.post({"d-1": 3, "other": 4})
    assert scheduler.get_num_new_matched_tokens(req, 0) == (200, True)  # rank 1 lacks one
    rank1.post({"d-1": 4})
    assert scheduler.get_num_new_matched_tokens(req, 64) == (136, False)
    rank1.post({})  # claimed meanwhile: what was answered stands
    blocks = SimpleNamespace(get_block_ids=lambda: ([3, 1, 4, 1],))
    scheduler.update_state_after_alloc(req, blocks, 136)
    [load] = scheduler.build_connector_meta(step()).loads
    assert (load.start, load.sync) == (64, True)
    unboarded = ConsumerScheduler(chunk_size=CHUNK)
    assert unboarded.get_num_new_matched_tokens(req, 64) == (136, True)
    rank0.close()
    rank1.close()


def test_scheduling_attempts_read_each_board_post_once_and_hash_each_prompt_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM asks every waiting request's external hit on every scheduling attempt (each step it
    waits). Each attempt copied, CRC-checked and decoded every rank's landed board (up to ~1 MiB)
    and hashed the whole prompt of a request served alone. Now a board's post is read once per
    generation (its header says whether it changed) and a prompt's chunk keys are hashed once
    per request. Ten attempts each of a disaggregated request (its chunks not all landed) and
    of one served alone (two chunks landed on both ranks): three board posts read (rank 0's
    landed board, which already says "not all landed", and both keys boards) and two hashings
    (one a rank), where there were 12 decodes, 30 CRCs and 20 hashings. The controls: a new
    post is read (once), and a request ended and back (another of that id) is hashed again."""
    from lmcache_pd.keys import ChunkKeyer
    from lmcache_pd.transfer import landed_keys

    calls = {"decodes": 0, "crcs": 0, "hashes": 0}

    def counted(name: str, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return call

    keyer = make_keyer(chunk_size=CHUNK)
    paths = [tmp_path / f"rank{rank}" for rank in range(2)]
    boards = [landed_board.BoardWriter(path) for path in paths]
    keys_boards = [KeysWriter(tmp_path / f"keys{rank}", max_keys=64) for rank in range(2)]
    landed = LandedChunks([keyer, keyer], [tmp_path / f"keys{rank}" for rank in range(2)])
    scheduler = ConsumerScheduler(chunk_size=CHUNK, boards=paths, landed_chunks=landed)
    disaggregated = request("c", list(range(201)), {"disagg_spec": SPEC})  # 4 chunks of KV
    prompt = list(range(1000, 1201))
    alone = request("a", prompt, None)
    for board in boards:
        board.post({"d-1": 3})  # not all landed: its load is asynchronous
    for board in keys_boards:
        board.post([chunk.key for chunk in keyer.chunk_keys(prompt[:-1])[:2]])
    monkeypatch.setattr(landed_board, "_decode", counted("decodes", landed_board._decode))
    monkeypatch.setattr(landed_keys, "_decode", counted("decodes", landed_keys._decode))
    crc32 = counted("crcs", landed_board.zlib.crc32)
    monkeypatch.setattr(landed_board, "zlib", SimpleNamespace(crc32=crc32))
    monkeypatch.setattr(ChunkKeyer, "chunk_keys", counted("hashes", ChunkKeyer.chunk_keys))
    for _ in range(10):
        assert scheduler.get_num_new_matched_tokens(disaggregated, 0) == (200, True)
        assert scheduler.get_num_new_matched_tokens(alone, 0) == (2 * CHUNK, False)
    assert calls == {"decodes": 3, "crcs": 3, "hashes": 2}
    boards[0].post({"d-1": 4})
    assert calls["crcs"] == 4  # the writer's own
    assert scheduler.get_num_new_matched_tokens(disaggregated, 0) == (200, True)  # rank 1: 3
    assert calls == {"decodes": 5, "crcs": 6, "hashes": 2}  # rank 0 anew, rank 1 at last
    scheduler.request_finished(alone)
    assert scheduler.get_num_new_matched_tokens(alone, CHUNK) == (CHUNK, False)
    assert calls == {"decodes": 5, "crcs": 6, "hashes": 4}
    landed.close()
    for board in (*boards, *keys_boards):
        board.close()


def wait_landed(workers: Workers, chunks: int) -> None:
    """Until the consumer's process posted that ``chunks`` landed for d-1, unclaimed."""
    wait_for(
        lambda: landed_board.read(workers.board) == {"d-1": chunks},
        what="landed chunks posted",
    )


@pytest.mark.parametrize("corrupted", [False, True])
@pytest.mark.processes
def test_a_synchronous_load_is_done_before_the_forward_pass(
    workers: Workers, corrupted: bool
) -> None:
    """Its KV landed, the request is loaded within ``start_load_kv`` and never reported at a
    later step; a chunk that fails its checksum there reports the load's blocks invalid
    instead (vLLM recomputes them and drops what the step computed from them)."""
    prompt = list(range(5000, 5150))
    src_blocks, dst_blocks = [7, 3, 12, 20, 5], [1, 30, 2, 9, 11]
    workers.producer.wait_for_save(save("p", workers.spec, prompt, src_blocks, 150))
    wait_landed(workers, 3)
    if corrupted:
        service = workers.consumer._service
        service.buffer[: -PROBE_AREA_BYTES : service.page_bytes] ^= 1
    sync = LoadRequest("c", "d-1", prompt, dst_blocks, BLOCK, sync=True)
    workers.consumer.start_load_kv(PDConnectorMetadata(loads=[sync]))
    assert workers.consumer.load_errors() == (set(dst_blocks[1:]) if corrupted else set())
    if not corrupted:
        for name in workers.source:
            assert torch.equal(
                workers.source[name][src_blocks[1:]], workers.target[name][dst_blocks[1:]]
            )
    assert workers.consumer.finished_loads() == (set(), set())
    totals = workers.consumer_stats.totals()
    assert totals["loads_sync"] == 1
    assert totals.get("sync_load_failures", 0) == int(corrupted)
    assert totals.get("tokens_loaded", 0) == (0 if corrupted else 150 - BLOCK)
    wait_for(lambda: workers.consumer_used_pages() == 0, what="pages back")


@pytest.mark.processes
def test_chunks_decode_computed_are_kept_and_loaded_by_a_later_request(workers: Workers) -> None:
    """The worker keeps a prompt's three chunks from the blocks decode computed them in; a
    later request served alone loads them (synchronously, as landed chunks) into blocks of its
    own, byte for byte. Keeping them again writes nothing. Control: with the kept pages'
    bytes altered the load fails its checksums (the keep recorded them) and its blocks are
    reported for vLLM to recompute."""
    prompt = list(range(7000, 7000 + 3 * CHUNK))
    computed, loaded = [11, 4, 17, 8, 25, 2], [30, 31, 32, 33, 34, 35]
    for name in workers.target:  # what decode computed into its blocks
        workers.target[name][computed] = torch.randn(workers.target[name][computed].shape)
    keep = KeepRequest("a", prompt, computed, 0)
    workers.consumer.wait_for_save(PDConnectorMetadata(keeps=[keep]))
    wait_for(lambda: workers.consumer_total("consumer_chunks_kept") == 3, what="chunks kept")
    workers.consumer.wait_for_save(PDConnectorMetadata(keeps=[keep]))  # here already
    assert workers.consumer_service_count("chunks_kept") == 3
    wait_for(lambda: workers.consumer_used_pages() == 0, what="the second keep's hold let go")
    assert workers.consumer_stats.totals().get("keeps_failed", 0) == 0

    def local_load(req_id: str, disagg_req_id: str) -> set[int]:
        load = LoadRequest(req_id, disagg_req_id, prompt, loaded, 0, sync=True, local=True)
        workers.consumer.start_load_kv(PDConnectorMetadata(loads=[load]))
        return workers.consumer.load_errors()

    assert local_load("b", "local-1") == set()
    for name in workers.target:
        assert torch.equal(workers.target[name][computed], workers.target[name][loaded])
    service = workers.consumer._service
    service.buffer[: -PROBE_AREA_BYTES : service.page_bytes] ^= 1
    assert local_load("c", "local-2") == set(loaded)
    assert workers.consumer_stats.totals()["sync_load_failures"] == 1


@pytest.mark.processes
def test_a_synchronous_load_whose_kv_is_gone_or_unanswered_fails_within_its_bound(
    workers: Workers,
) -> None:
    """KV that is not there (never pushed) and a consumer process that does not answer (stopped)
    each fail the load at once with its blocks reported invalid; once the process answers again,
    its late answer confuses nothing: the next load completes."""
    prompt = list(range(6000, 6150))
    workers.consumer.start_load_kv(
        PDConnectorMetadata(loads=[LoadRequest("c", "d-1", prompt, [1, 2, 3, 4, 5], 0, True)])
    )
    assert workers.consumer.load_errors() == {1, 2, 3, 4, 5}
    os.kill(workers.consumer._service.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        workers.consumer.start_load_kv(
            PDConnectorMetadata(loads=[LoadRequest("c2", "d-2", prompt, [6, 7, 8, 9, 10], 0, True)])
        )
        assert time.monotonic() - started < SYNC_LOAD_WAIT_S + 0.25
        assert workers.consumer.load_errors() == {6, 7, 8, 9, 10}
    finally:
        os.kill(workers.consumer._service.pid, signal.SIGCONT)
    assert workers.consumer_stats.totals()["sync_load_failures"] == 2
    spec = msgspec.structs.replace(workers.spec, req_id="d-3")
    workers.producer.wait_for_save(save("p3", spec, prompt, [7, 3, 12, 20, 5], 150))
    workers.consumer.start_load_kv(load("c3", "d-3", prompt, [11, 12, 13, 14, 15]))
    assert finish(workers.consumer) == ({"c3"}, set())


def test_decode_holding_fewer_tokens_than_prefill_skipped_computes_the_prompt(
    tmp_path: Path,
) -> None:
    """The proxy saw decode hold 150 tokens: prefill skips the 2 whole chunks of 64 inside
    them. A decode that still holds 128 loads the rest, synchronously once the 2 chunks pushed
    (not 4) have landed; one that holds 64 now would wait for a chunk that never comes: it
    computes the prompt at once, counted, and the pushed chunks are let go."""
    held = DisaggSpec.from_dict({**SPEC, "decode_holds": 150})
    assert held.skipped_tokens(CHUNK) == 128 and held.for_rank(0).decode_holds == 150
    board = landed_board.BoardWriter(tmp_path / "rank0")
    board.post({"d-1": 2})
    counted: list[str] = []
    scheduler = ConsumerScheduler(counted.append, chunk_size=CHUNK, boards=[tmp_path / "rank0"])
    req = request("c", list(range(201)), {"disagg_spec": msgspec.to_builtins(held)})
    assert scheduler.get_num_new_matched_tokens(req, 128) == (72, False)  # all pushed landed
    lost = request("lost", list(range(201)), {"disagg_spec": msgspec.to_builtins(held)})
    assert scheduler.get_num_new_matched_tokens(lost, 64) == (0, False)
    assert counted == ["held_prefix_lost"]
    scheduler.update_state_after_alloc(lost, None, 0)
    assert scheduler.build_connector_meta(step()).unneeded == {"d-1"}
    board.close()


@pytest.mark.parametrize("held", [3 * BLOCK, 3 * BLOCK + 4], ids=["on_a_block", "inside_one"])
@pytest.mark.processes
def test_of_the_chunk_decode_holds_the_head_of_prefill_pushes_the_tail(
    workers: Workers, held: int
) -> None:
    """Decode holds 96 tokens (3 blocks of 32): of the chunk 64-128 it holds the first half,
    so prefill pushes its second half alone (under a key of its own), then the last chunk; decode
    loads them into its blocks past what it holds, byte for byte, and no block it holds is
    written. The control: a hold that ends inside a block (100) cannot be cut there, and the
    whole chunk goes, as before: a block more pushed, the same blocks loaded."""
    prompt = list(range(9000, 9150))
    src_blocks, dst_blocks = [7, 3, 12, 20, 5], [1, 30, 2, 9, 11]
    spec = msgspec.structs.replace(workers.spec, decode_holds=held)
    workers.producer.wait_for_save(save("p", spec, prompt, src_blocks, 150))
    start = 3 * BLOCK  # decode's own hit, on a block
    load = LoadRequest("c", "d-1", prompt, dst_blocks, start, held=held)
    workers.consumer.start_load_kv(PDConnectorMetadata(loads=[load]))
    assert finish(workers.consumer) == ({"c"}, set())
    for name in workers.source:
        assert torch.equal(
            workers.source[name][src_blocks[3:]], workers.target[name][dst_blocks[3:]]
        )
        assert not workers.target[name][dst_blocks[:3]].any()  # held by decode: not written
    block_bytes = workers.source["layer.0"][0].nbytes * len(workers.source)
    pushed = 2 if held == 3 * BLOCK else 3  # blocks: the tail and the last; or the whole chunk
    assert workers.producer_stats.totals()["bytes_pushed"] == pushed * block_bytes


def test_a_decode_that_lost_the_head_of_a_chunk_whose_tail_was_pushed_computes_the_prompt(
    tmp_path: Path,
) -> None:
    """The proxy saw decode hold 96 tokens (3 blocks of 32, inside the second chunk of 64):
    prefill pushes that chunk's tail. A decode still holding 96 loads past them; one holding
    64 now lacks the chunk's head, which never comes: it computes the prompt, counted. Without
    a block size (a hold counted in whole chunks), 64 would do."""
    spec = DisaggSpec.from_dict({**SPEC, "decode_holds": 3 * BLOCK})
    params = {"disagg_spec": msgspec.to_builtins(spec)}
    counted: list[str] = []
    scheduler = ConsumerScheduler(counted.append, chunk_size=CHUNK, block_size=BLOCK)
    assert scheduler.get_num_new_matched_tokens(request("c", list(range(201)), params), 96) == (
        104,
        True,
    )
    assert counted == []
    lost = request("lost", list(range(201)), params)
    assert scheduler.get_num_new_matched_tokens(lost, 64) == (0, False)
    assert counted == ["held_prefix_lost"]
    whole = ConsumerScheduler(chunk_size=CHUNK)
    assert whole.get_num_new_matched_tokens(request("w", list(range(201)), params), 64) == (
        136,
        True,
    )


@pytest.mark.processes
def test_prefill_pushes_no_chunk_inside_what_decode_holds(workers: Workers) -> None:
    """A spec saying decode holds 150 tokens: of 3 chunks (64, 64, 22) only the last is
    pushed, and decode, whose own cache holds the first 128, loads it into its blocks."""
    prompt = list(range(3000, 3150))
    src_blocks, dst_blocks = [7, 3, 12, 20, 5], [1, 30, 2, 9, 11]
    spec = msgspec.structs.replace(workers.spec, decode_holds=150)
    workers.producer.wait_for_save(save("p", spec, prompt, src_blocks, 150))
    workers.consumer.start_load_kv(
        PDConnectorMetadata(loads=[LoadRequest("c", "d-1", prompt, dst_blocks, 2 * CHUNK)])
    )
    assert finish(workers.consumer) == ({"c"}, set())
    for name in workers.source:
        assert torch.equal(
            workers.source[name][src_blocks[4:]], workers.target[name][dst_blocks[4:]]
        )
        assert not workers.target[name][dst_blocks[:4]].any()  # held by decode: not written
    wait_for(lambda: workers.consumer_total("consumer_chunks_landed") == 1, what="one landed")
    assert workers.producer_stats.totals()["bytes_pushed"] == workers.source["layer.0"][
        0
    ].nbytes * len(workers.source)


def test_a_rank_that_gets_more_parts_of_each_chunk_waits_for_every_part(tmp_path: Path) -> None:
    """Six KV heads from prefill TP 2 to decode TP 3 arrive as 1, 2 and 1 parts a chunk: the
    middle rank is ready only with both parts of each chunk (counted by rank 0's one part, it
    looked ready at half, its synchronous load failed and decode recomputed)."""
    from lmcache_pd.config import PDConfig
    from lmcache_pd.connector.facade import parts_per_chunk
    from lmcache_pd.tp_parts import TPLayout

    config = PDConfig(kv_role="kv_consumer", prefill_tp_size=2)
    parts = parts_per_chunk(TPLayout(6, 3), config)
    assert parts == (1, 2, 1)
    assert parts_per_chunk(TPLayout(6, 3), PDConfig(kv_role="kv_consumer")) == (1, 1, 1)
    paths = [tmp_path / f"rank{rank}" for rank in range(3)]
    boards = [landed_board.BoardWriter(path) for path in paths]
    scheduler = ConsumerScheduler(chunk_size=CHUNK, boards=paths, parts_per_chunk=parts)
    req = request("c", list(range(201)), {"disagg_spec": SPEC})  # 4 chunks of KV
    for board, landed in zip(boards, (4, 4, 4), strict=True):
        board.post({"d-1": landed})
    assert scheduler.get_num_new_matched_tokens(req, 0) == (200, True)  # rank 1: half its parts
    boards[1].post({"d-1": 8})
    assert scheduler.get_num_new_matched_tokens(req, 0) == (200, False)
    for board in boards:
        board.close()
