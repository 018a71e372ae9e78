"""Tensor parallelism, rank i to rank i: per-rank ports in the DisaggSpec and the configs, each
producer rank pushing its own shard to the consumer rank of its index (real NIXL), a shard sent
to the wrong rank refused at handshake, and the proxy's drop notice reaching every rank."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput

from lmcache_pd.compat import KVProfile
from lmcache_pd.config import load_config
from lmcache_pd.connector.consumer_worker import ConsumerWorker
from lmcache_pd.connector.counters import StatsRecorder
from lmcache_pd.connector.metadata import LoadRequest, PDConnectorMetadata, SaveRequest
from lmcache_pd.connector.worker import ProducerWorker
from lmcache_pd.deploy.launcher import peer_text
from lmcache_pd.deploy.pools import InstanceSpec, load_pools
from lmcache_pd.errors import ConfigError, ProtocolError
from lmcache_pd.protocol import AbandonReason, DisaggSpec
from lmcache_pd.proxy.config import DecodeInstance
from lmcache_pd.proxy.kv_drop import KVDropper
from tests.helpers import free_port, make_keyer
from tests.test_proxy import AllocChannel

BLOCK = 32
CHUNK = 64
RANKS = 2


def spec_dict(init: object, alloc: object) -> dict[str, object]:
    return {
        "req_id": "r",
        "receiver_host": "127.0.0.1",
        "receiver_init_port": init,
        "receiver_alloc_port": alloc,
    }


# ---- the DisaggSpec ----


def test_a_spec_with_single_ports_is_one_rank_and_unchanged_on_the_wire() -> None:
    spec = DisaggSpec.from_dict(spec_dict(5, 6))
    assert (spec.ranks, spec.for_rank(0)) == (1, spec)
    assert msgspec.to_builtins(spec) == spec_dict(5, 6)  # what a TP-1 peer has always sent


def test_a_spec_with_port_lists_gives_each_rank_its_own_ports() -> None:
    spec = DisaggSpec.from_dict(spec_dict([5, 7], [6, 8]))
    assert spec.ranks == 2
    assert spec.for_rank(1) == DisaggSpec("r", "127.0.0.1", 7, 8)
    assert [s.receiver_alloc_port for s in spec.every_rank()] == [6, 8]


@pytest.mark.parametrize(
    ("init", "alloc", "named"),
    [
        ([5, 7], [6], "2 ranks"),
        ([], [], "receiver_init_port"),
        ([5, 70000], [6, 8], "receiver_init_port"),
        ([5, "7"], [6, 8], "receiver_init_port"),
        (list(range(1, 70)), list(range(100, 169)), "receiver_init_port"),
    ],
    ids=["lengths_differ", "empty", "port_out_of_range", "not_an_int", "too_many_ranks"],
)
def test_a_bad_port_list_is_refused_naming_it(init: object, alloc: object, named: str) -> None:
    with pytest.raises(ProtocolError, match=named):
        DisaggSpec.from_dict(spec_dict(init, alloc))


def test_a_rank_the_spec_has_no_ports_for_is_refused_clearly() -> None:
    """A TP-2 producer's rank 1 given a TP-1 consumer's spec: no port, and it says why."""
    with pytest.raises(ProtocolError, match=r"names 1 consumer rank.*no port for rank 1"):
        DisaggSpec.from_dict(spec_dict(5, 6)).for_rank(1)


# ---- per-rank configs ----


def test_each_consumer_rank_binds_its_own_ports_and_a_missing_rank_is_refused() -> None:
    config = load_config(
        None, environ={}, kv_role="kv_consumer", init_port=[5, 7], alloc_port=[6, 8]
    )
    assert (config.for_rank(1).init_port, config.for_rank(1).alloc_port) == (7, 8)
    assert config.for_rank(0).init_port == 5  # a one-rank instance given a list: the first
    with pytest.raises(ConfigError, match="consumer rank 2 has no receive ports"):
        config.for_rank(2)
    with pytest.raises(ConfigError, match="init_port lists 2 rank"):
        load_config(None, environ={}, kv_role="kv_consumer", init_port=[5, 7], alloc_port=6)


def test_each_producer_rank_warms_only_the_consumer_rank_it_pushes_to() -> None:
    peers = ["h:5,7:6,8", "one-rank:9:10"]
    config = load_config(None, environ={}, kv_role="kv_producer", warm_peers=peers)
    assert config.for_rank(0).warm_peers == ["h:5:6", "one-rank:9:10"]
    assert config.for_rank(1).warm_peers == ["h:7:8"]  # a TP-1 consumer has no rank 1


# ---- the workers: rank i to rank i over real NIXL ----


def paged_cache(seed: int | None) -> dict[str, torch.Tensor]:
    """Four layers (num_blocks, kv_heads, block, 2 * head) of one rank's shard."""
    buffer = torch.zeros(4, 16, 1, BLOCK, 2 * 16)
    if seed is not None:
        buffer.normal_(generator=torch.Generator().manual_seed(seed))
    return {f"layer.{i}": buffer[i] for i in range(4)}


def profile(rank: int) -> KVProfile:
    return KVProfile(chunk_size=CHUNK, page_bytes=1, tp_size=RANKS, tp_rank=rank)


@dataclass
class Rank:
    producer: ProducerWorker
    consumer: ConsumerWorker
    source: dict[str, torch.Tensor]
    target: dict[str, torch.Tensor]
    consumer_stats: StatsRecorder
    producer_stats: StatsRecorder


@pytest.fixture
def ranks() -> Iterator[tuple[list[Rank], DisaggSpec]]:
    """A TP-2 producer and a TP-2 consumer: one worker pair per rank, ports listed per rank
    in one config, each rank's source shard different."""
    init, alloc = [free_port() for _ in range(RANKS)], [free_port() for _ in range(RANKS)]
    common = {"chunk_size": CHUNK, "buffer_size_bytes": 16 << 20, "load_timeout_s": 3.0}
    consumer_config = load_config(
        None, environ={}, kv_role="kv_consumer", init_port=init, alloc_port=alloc, **common
    )
    producer_config = load_config(None, environ={}, kv_role="kv_producer", **common)
    made: list[Rank] = []
    try:
        for rank in range(RANKS):
            source, target = paged_cache(seed=10 + rank), paged_cache(seed=None)
            consumer_stats, producer_stats = StatsRecorder(f"c{rank}"), StatsRecorder(f"p{rank}")
            consumer = ConsumerWorker(
                consumer_config.for_rank(rank),
                make_keyer(model_name="m", world_size=RANKS, worker_id=rank, chunk_size=CHUNK),
                target,
                consumer_stats,
                profile(rank),
                rank,
            )
            producer = ProducerWorker(
                producer_config.for_rank(rank),
                make_keyer(model_name="m", world_size=RANKS, worker_id=rank, chunk_size=CHUNK),
                source,
                producer_stats,
                profile(rank),
                rank,
            )
            made.append(Rank(producer, consumer, source, target, consumer_stats, producer_stats))
        yield made, DisaggSpec("d-1", "127.0.0.1", init, alloc)
    finally:
        for rank in made:
            rank.producer.close()
            rank.consumer.close()


def push_and_load(
    ranks: list[Rank], spec: DisaggSpec, prompt: list[int], blocks: list[int]
) -> list[tuple[set[str], set[str]]]:
    """Every producer rank saves the prompt, every consumer rank loads it; each rank's
    (received, failed), once every rank has reported."""
    for rank in ranks:
        save = SaveRequest("p", spec, prompt, blocks, len(prompt))
        rank.producer.wait_for_save(PDConnectorMetadata(saves=[save]))
        load = LoadRequest("c", spec.req_id, prompt, blocks, 0)
        rank.consumer.start_load_kv(PDConnectorMetadata(loads=[load]))
    results: list[tuple[set[str], set[str]] | None] = [None] * len(ranks)
    deadline = time.monotonic() + 10
    while None in results and time.monotonic() < deadline:
        for index, rank in enumerate(ranks):
            if results[index] is None:
                received, failed = rank.consumer.finished_loads()
                if received:
                    results[index] = (received, failed)
        time.sleep(0.01)
    assert None not in results, f"not every rank reported: {results}"
    return results  # type: ignore[return-value]


@pytest.mark.processes
def test_each_producer_rank_pushes_its_shard_to_the_consumer_rank_of_its_index(ranks) -> None:
    workers, spec = ranks
    prompt, blocks = list(range(500, 700)), [3, 9, 1, 12, 5, 14, 0]  # 3 chunks + part
    assert push_and_load(workers, spec, prompt, blocks) == [({"c"}, set())] * RANKS
    for rank in workers:
        for name in rank.source:
            assert torch.equal(rank.source[name][blocks], rank.target[name][blocks])
        assert rank.consumer_stats.totals()["tokens_loaded"] == len(prompt)
        assert rank.producer_stats.totals().get("handshakes_refused", 0) == 0
    # control: the two shards differ, so a shard landing on the other rank would show
    assert not torch.equal(workers[0].target["layer.0"], workers[1].target["layer.0"])


@pytest.mark.processes
def test_a_shard_pushed_to_the_wrong_rank_is_refused_at_handshake(ranks) -> None:
    """Producer rank 1 told to push to consumer rank 0 (a spec with its ports swapped): the
    profiles' tp_rank differ, the handshake is refused naming both, and both consumer ranks
    fail the load, so vLLM recomputes the prompt (a failure on any rank fails the request)."""
    workers, good = ranks
    init, alloc = list(good.receiver_init_port), list(good.receiver_alloc_port)
    swapped = DisaggSpec("d-1", "127.0.0.1", init[::-1], alloc[::-1])
    prompt, blocks = list(range(500, 700)), [3, 9, 1, 12, 5, 14, 0]
    results = push_and_load(workers, swapped, prompt, blocks)
    assert results == [({"c"}, {"c"})] * RANKS
    for rank in workers:
        assert rank.producer_stats.totals()["handshakes_refused"] == 1
        assert rank.consumer_stats.totals()["consumer_handshakes_refused"] == 1
        assert rank.consumer_stats.totals()["loads_abandoned"] == 1  # told, not timed out
        assert not rank.target["layer.0"].any()  # nothing landed anywhere


@pytest.mark.processes
def test_a_producer_rank_the_spec_has_no_consumer_rank_for_pushes_nothing(ranks) -> None:
    """A TP-2 producer with a one-rank spec: rank 1 pushes nothing and says so; rank 0's
    handshake (tp_size 2 against 2 here) goes on as usual."""
    workers, spec = ranks
    one_rank = spec.for_rank(0)
    save = SaveRequest("p", one_rank, list(range(100)), [0, 1, 2, 3], 100)
    workers[1].producer.wait_for_save(PDConnectorMetadata(saves=[save]))
    assert workers[1].producer_stats.totals()["pushes_without_rank"] == 1
    assert workers[1].producer.progress().outstanding == 0


@pytest.mark.processes
def test_a_load_that_fails_on_one_rank_fails_the_request_in_vllms_aggregation(ranks) -> None:
    """Rank 1 never gets its shard (its producer rank is not run) and fails at its load
    deadline while rank 0 loads: vLLM's own aggregation of the two workers' reports, with
    the connector's finished count, reports the request received only once both ranks did,
    and failed, so it is recomputed."""
    workers, spec = ranks
    prompt, blocks = list(range(900, 1000)), [4, 5, 6, 7]
    save = SaveRequest("p", spec, prompt, blocks, len(prompt))
    workers[0].producer.wait_for_save(PDConnectorMetadata(saves=[save]))
    for rank in workers:
        load = LoadRequest("c", spec.req_id, prompt, blocks, 0)
        rank.consumer.start_load_kv(PDConnectorMetadata(loads=[load]))
    aggregator = KVOutputAggregator(expected_finished_count=RANKS)  # get_finished_count
    deadline = time.monotonic() + 10
    outcome = None
    while outcome is None and time.monotonic() < deadline:
        outputs = []
        for rank in workers:
            received, failed = rank.consumer.finished_loads()
            output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
            output.kv_connector_output = KVConnectorOutput(
                finished_recving=received, failed_recving=failed
            )
            outputs.append(output)
        merged = aggregator.aggregate(outputs).kv_connector_output
        if merged.finished_recving:
            outcome = (merged.finished_recving, merged.failed_recving)
        elif workers[0].consumer_stats.totals().get("loads_completed"):
            assert not merged.failed_recving  # rank 0 done alone: not received yet
        time.sleep(0.01)
    assert outcome == ({"c"}, {"c"})
    assert workers[0].consumer_stats.totals()["loads_completed"] == 1
    assert workers[1].consumer_stats.totals()["load_timeouts"] == 1


# ---- the proxy and the launcher ----


def test_a_decode_instance_lists_a_port_pair_per_rank() -> None:
    decode = msgspec.convert(
        {"url": "http://d:1", "receiver_host": "d", "init_port": [5, 7], "alloc_port": [6, 8]},
        DecodeInstance,
    )
    assert peer_text(decode) == "d:5,7:6,8"
    with pytest.raises(msgspec.ValidationError, match="init_port lists 2 rank"):
        msgspec.convert(
            {"url": "http://d:1", "receiver_host": "d", "init_port": [5, 7], "alloc_port": 6},
            DecodeInstance,
        )


def test_the_proxy_tells_every_decode_rank_to_drop_its_shard() -> None:
    channels = [AllocChannel() for _ in range(RANKS)]
    try:
        ports = [c.port for c in channels]
        spec = DisaggSpec("pd-1", "127.0.0.1", [free_port(), free_port()], ports)

        async def drop() -> bool:
            dropper = KVDropper()
            try:
                return await dropper._send(spec, "client gone")
            finally:
                await dropper.close()

        # Each rank's channel answers on a thread of its own while the proxy's loop waits.
        with ThreadPoolExecutor(RANKS) as threads:
            heard = [threads.submit(channel.receive, 3.0) for channel in channels]
            assert asyncio.run(drop())  # every rank acknowledged
        for notices in heard:
            [notice] = notices.result()
            assert (notice.req_id, notice.reason) == ("pd-1", AbandonReason.CLIENT_GONE)
    finally:
        for channel in channels:
            channel.close()


def test_a_pools_file_gives_each_instance_its_tensor_parallel_size(tmp_path: Path) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(
        "model: m\n"
        "prefill: [{config: p.yaml, cpus: '0|1', tensor_parallel_size: 2}]\n"
        "decode: [{config: c.yaml, cpus: '0|1', tensor_parallel_size: 2}]\n"
    )
    pools = load_pools(path)
    assert [i.tensor_parallel_size for i in (*pools.prefill, *pools.decode)] == [2, 2]
    with pytest.raises(msgspec.ValidationError, match="one set per rank"):
        msgspec.convert({"config": "c", "cpus": "0", "tensor_parallel_size": 2}, InstanceSpec)
