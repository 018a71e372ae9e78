"""Two producers, each in its own OS process, pushing into one consumer (as 2 prefill instances
feed 1 decode instance): every chunk of both lands, bit for bit."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest

from lmcache_pd.harness.consumer_process import ConsumerProcess
from lmcache_pd.transfer.producer import Producer
from tests.helpers import (
    CHUNK_SIZE,
    consumer_fields,
    make_chunks,
    make_keyer,
    producer_config,
    spec_for,
    write_config,
)

pytestmark = pytest.mark.processes
PUSHES = 3


def push_from_own_process(fields: dict, name: str, done: multiprocessing.Queue) -> None:
    """In a child: one producer pushes ``PUSHES`` requests, then reports how many chunks went."""
    sent = 0
    with Producer(producer_config(num_pages=16)) as producer:
        for index in range(PUSHES):
            tokens = [hash((name, index, t)) % 50_000 for t in range(3 * CHUNK_SIZE)]
            chunks = make_chunks(make_keyer().chunk_keys(tokens), seed=index)
            sent += producer.push(spec_for(fields, f"{name}-{index}"), chunks).chunks_sent
    done.put((name, sent))


def test_two_producer_processes_push_into_one_consumer(tmp_path: Path) -> None:
    fields = consumer_fields(num_pages=64)
    with ConsumerProcess(
        write_config(tmp_path, "consumer", **fields), log_path=tmp_path / "consumer.log"
    ) as consumer:
        context = multiprocessing.get_context("spawn")
        done = context.Queue()
        children = [
            context.Process(target=push_from_own_process, args=(fields, name, done))
            for name in ("a", "b")
        ]
        for child in children:
            child.start()
        try:
            results = dict(done.get(timeout=60) for _ in children)
        finally:
            for child in children:
                child.join(10)
                if child.is_alive():
                    child.kill()
        assert results == {"a": 3 * PUSHES, "b": 3 * PUSHES}
        deadline = time.monotonic() + 10
        while consumer.call("stats")["chunks_landed"] < 6 * PUSHES:
            assert time.monotonic() < deadline, consumer.call("stats")
            time.sleep(0.01)
