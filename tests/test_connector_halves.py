"""The connector's halves without vLLM's engine: scheduler logic on stand-in requests, and the
two workers moving a paged cache from one to the other over real NIXL."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lmcache_pd.config import load_config
from lmcache_pd.connector.metadata import LoadRequest, PDConnectorMetadata, SaveRequest
from lmcache_pd.connector.scheduler import ConsumerScheduler, ProducerScheduler
from lmcache_pd.connector.worker import ConsumerWorker, ProducerWorker
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.protocol import DisaggSpec
from tests.helpers import free_port

BLOCK = 32
CHUNK = 64
SPEC = {
    "req_id": "d-1",
    "receiver_host": "127.0.0.1",
    "receiver_init_port": 1,
    "receiver_alloc_port": 2,
}


def request(
    req_id: str, prompt: list[int], params: dict | None, outputs: list[int] = ()
) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=prompt,
        kv_transfer_params=params,
        output_token_ids=list(outputs),
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
    scheduler.update_state_after_alloc(req)
    first = scheduler.build_connector_meta(step(new=[("r", [4, 5], 0)], scheduled={"r": 64}))
    [save] = first.saves
    assert (save.computed_end, save.block_ids, save.spec.req_id) == (64, [4, 5], "d-1")
    second = scheduler.build_connector_meta(
        step(cached=[("r", [6, 7, 9], 64)], scheduled={"r": 86})
    )
    assert second.saves[0].computed_end == 150
    assert second.saves[0].block_ids == [4, 5, 6, 7, 9]
    assert scheduler.request_finished(req) == {"first_tok": 7, "disagg_req_id": "d-1"}


def test_requests_without_or_with_a_bad_spec_are_left_alone() -> None:
    scheduler = ProducerScheduler()
    scheduler.update_state_after_alloc(request("plain", [1, 2], None))
    scheduler.update_state_after_alloc(request("bad", [1, 2], {"disagg_spec": {"req_id": 5}}))
    meta = scheduler.build_connector_meta(
        step(new=[("plain", [1], 0), ("bad", [2], 0)], scheduled={"plain": 2, "bad": 2})
    )
    assert meta.saves == []
    consumer = ConsumerScheduler(CHUNK)
    assert consumer.get_num_new_matched_tokens(request("plain", [1, 2, 3], None), 0) == (0, False)


def test_consumer_scheduler_announces_all_but_the_last_token_on_chunk_boundaries() -> None:
    scheduler = ConsumerScheduler(CHUNK)
    req = request("c", list(range(201)), {"disagg_spec": SPEC})
    assert scheduler.get_num_new_matched_tokens(req, 0) == (200, True)
    assert scheduler.get_num_new_matched_tokens(req, 64) == (136, True)
    assert scheduler.get_num_new_matched_tokens(req, 32) == (0, False)  # not a chunk boundary
    assert scheduler.get_num_new_matched_tokens(request("one", [5], {"disagg_spec": SPEC}), 0) == (
        0,
        False,
    )
    blocks = SimpleNamespace(get_block_ids=lambda: ([3, 1, 4, 1, 5, 9, 2],))
    scheduler.update_state_after_alloc(req, blocks, 200)
    [load] = scheduler.build_connector_meta(step()).loads
    assert (load.disagg_req_id, len(load.prompt), load.start, load.block_ids[0]) == (
        "d-1",
        200,
        0,
        3,
    )
    assert scheduler.build_connector_meta(step()).loads == []


def paged_cache(num_blocks: int, seed: int | None) -> dict[str, torch.Tensor]:
    """Four layers of a CPU cache (num_blocks, kv_heads, block, 2 * head) in one buffer."""
    buffer = torch.zeros(4, num_blocks, 2, BLOCK, 2 * 16)
    if seed is not None:
        buffer.normal_(generator=torch.Generator().manual_seed(seed))
    return {f"layer.{i}": buffer[i] for i in range(4)}


@pytest.fixture
def workers(tmp_path: Path):
    init_port, alloc_port = free_port(), free_port()
    keyer = ChunkKeyer(
        model_name="m", world_size=1, worker_id=0, kv_dtype="float32", chunk_size=CHUNK
    )
    common = {
        "chunk_size": CHUNK,
        "buffer_size_bytes": 64 << 20,
        "init_port": init_port,
        "alloc_port": alloc_port,
        "load_timeout_s": 2.0,
    }
    source, target = paged_cache(40, seed=1), paged_cache(40, seed=None)
    consumer = ConsumerWorker(
        load_config(
            None, environ={}, kv_role="kv_consumer", stats_path=str(tmp_path / "c.json"), **common
        ),
        keyer,
        target,
    )
    producer = ProducerWorker(
        load_config(None, environ={}, kv_role="kv_producer", **common), keyer, source
    )
    spec = DisaggSpec("d-1", "127.0.0.1", init_port, alloc_port)
    yield producer, consumer, source, target, spec
    producer.close()
    consumer.close()


def finish(consumer: ConsumerWorker, timeout_s: float = 10.0) -> tuple[set[str], set[str]]:
    deadline = time.monotonic() + timeout_s
    while True:
        received, failed = consumer.finished_loads()
        if received or time.monotonic() > deadline:
            return received, failed
        time.sleep(0.01)


def test_kv_moves_from_producer_blocks_to_consumer_blocks_over_nixl(workers) -> None:
    producer, consumer, source, target, spec = workers
    prompt = list(range(1000, 1150))  # 2 full chunks and a partial one, over chunked prefill
    src_blocks = [7, 3, 12, 20, 5]
    dst_blocks = [1, 30, 2, 9, 11]
    for computed in (64, 150):
        producer.wait_for_save(
            PDConnectorMetadata(saves=[SaveRequest("p", spec, prompt, src_blocks, computed)])
        )
    consumer.start_load_kv(
        PDConnectorMetadata(loads=[LoadRequest("c", "d-1", prompt, dst_blocks, 0)])
    )
    assert finish(consumer) == ({"c"}, set())
    for name in source:
        assert torch.equal(source[name][src_blocks], target[name][dst_blocks]), name
    untouched = [b for b in range(40) if b not in dst_blocks]
    assert not any(target[name][untouched].any() for name in target)


def test_kv_that_never_lands_fails_the_load_at_its_deadline(workers) -> None:
    _, consumer, _, target, _ = workers
    consumer.start_load_kv(
        PDConnectorMetadata(loads=[LoadRequest("c", "never", list(range(70)), [1, 2, 3], 0)])
    )
    started = time.monotonic()
    assert finish(consumer) == ({"c"}, {"c"})
    assert 2.0 <= time.monotonic() - started < 4.0
    assert not any(layer.any() for layer in target.values())


def test_a_request_that_ends_while_its_kv_is_awaited_is_released_at_once(
    workers, tmp_path: Path
) -> None:
    """The client went away: vLLM holds the request's blocks until the load is reported, so the
    worker reports it at the next step (not at the deadline) and gives its pages back."""
    _, consumer, _, target, _ = workers
    consumer.start_load_kv(
        PDConnectorMetadata(loads=[LoadRequest("c", "gone", list(range(70)), [1, 2, 3], 0)])
    )
    assert consumer.finished_loads() == (set(), set())  # control: still awaited
    consumer.start_load_kv(PDConnectorMetadata(finished={"c"}))
    assert consumer.finished_loads() == ({"c"}, set())
    assert consumer.finished_loads() == (set(), set())
    stats = json.loads((tmp_path / "c.json").read_text())
    assert (stats["loads_aborted"], stats["load_timeouts"], stats["consumer_used_pages"]) == (
        1,
        0,
        0,
    )
    assert not any(layer.any() for layer in target.values())


def test_a_failed_load_is_not_awaited_again() -> None:
    scheduler = ConsumerScheduler(CHUNK)
    req = request("c", list(range(201)), {"disagg_spec": SPEC})
    assert scheduler.get_num_new_matched_tokens(req, 0) == (200, True)
    scheduler.update_connector_output({"c"})
    assert scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    scheduler.request_finished(req)
    assert scheduler.get_num_new_matched_tokens(req, 0) == (200, True)
