"""Real NIXL across two network stacks: the producer in one network namespace, the consumer in
another, joined by a veth pair, as two hosts (or two pods on one node) are.

With the default configs the handshake must pick TCP between the two stacks and pushes must land
bit-exact; a configuration that forces UCX's own transport choice (which loses every write
between namespaces) must be caught by the handshake's self-test and fall back to TCP; the
negative controls show that same forced choice losing writes when the self-test is off, and no
handshake at all when the fallback is off too. A killed consumer and a cut link must each end a
push at our own deadline. Needs root and ``ip``; skipped otherwise.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lmcache_pd.harness import netns
from lmcache_pd.harness.consumer_process import ConsumerProcess
from lmcache_pd.harness.producer_process import ProducerProcess

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(netns.unavailable() is not None, reason=f"{netns.unavailable()}"),
]
# The defaults' ports: each namespace has its own, so the defaults are free there.
INIT_PORT, ALLOC_PORT = 55555, 55556
BUFFER_BYTES = 64 << 20
LENGTHS = [300, 1, 255, 256, 257, 5 * 256 + 17, 16384]


def overrides(**settings: object) -> dict[str, str]:
    """``LMCACHE_PD_*`` environment overrides of a config file's settings."""
    return {
        f"LMCACHE_PD_{name.upper()}": str(value).lower() if isinstance(value, bool) else str(value)
        for name, value in settings.items()
    }


def start_consumer(
    side: netns.Side, log: Path, *, ports: tuple[int, int] = (INIT_PORT, ALLOC_PORT), **settings
) -> ConsumerProcess:
    """configs/consumer.yaml as it is, but for its address (the veth's) and any ``settings``."""
    env = overrides(
        receiver_host=side.address,
        init_port=ports[0],
        alloc_port=ports[1],
        buffer_size_bytes=BUFFER_BYTES,
        **settings,
    )
    return ConsumerProcess(CONFIGS / "consumer.yaml", env=env, log_path=log, wrap=side.wrap)


def start_producer(side: netns.Side, log: Path, **settings) -> ProducerProcess:
    """configs/producer.yaml as it is, but for ``settings``."""
    env = overrides(buffer_size_bytes=BUFFER_BYTES, **settings)
    return ProducerProcess(CONFIGS / "producer.yaml", env=env, log_path=log, wrap=side.wrap)


@pytest.fixture(scope="module")
def pair() -> Iterator[netns.VethPair]:
    with netns.veth_pair("lmpd-test") as made:
        yield made


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("netns")


@pytest.fixture(scope="module")
def consumer(pair: netns.VethPair, logs: Path) -> Iterator[ConsumerProcess]:
    with start_consumer(pair.right, logs / "consumer.log") as child:
        yield child


@pytest.fixture(scope="module")
def producer(pair: netns.VethPair, logs: Path) -> Iterator[ProducerProcess]:
    with start_producer(pair.left, logs / "producer.log") as child:
        yield child


def where(side: netns.Side, ports: tuple[int, int] = (INIT_PORT, ALLOC_PORT)) -> dict[str, Any]:
    return {"host": side.address, "init_port": ports[0], "alloc_port": ports[1]}


def push(producer: ProducerProcess, side: netns.Side, req_id: str, tokens: int, **kw) -> dict:
    """Fresh random chunks (seeded by ``req_id``): never ones the consumer already holds."""
    seed = zlib.crc32(req_id.encode()) % (1 << 20)
    return producer.call("push", req_id=req_id, tokens=tokens, seed=seed, **where(side, **kw))


def assert_landed_bit_exact(consumer: ConsumerProcess, pushed: dict, req_id: str) -> None:
    assert pushed["ok"] and pushed["chunks_sent"] == len(pushed["keys"]), pushed
    deadline = time.monotonic() + 5
    while (landed := consumer.call("checksums", keys=pushed["keys"])) != pushed["checksums"]:
        assert time.monotonic() < deadline, f"{req_id}: landed {landed}"
        time.sleep(0.01)
    consumer.call("release", req_id=req_id)


def test_default_configs_push_bit_exact_across_network_namespaces(
    pair: netns.VethPair, consumer: ConsumerProcess, producer: ProducerProcess
) -> None:
    connected = producer.call("connect", **where(pair.right))
    assert connected["ok"] and connected["transport"] == "tcp", connected
    for tokens in LENGTHS:
        req_id = f"default-{tokens}"
        assert_landed_bit_exact(consumer, push(producer, pair.right, req_id, tokens), req_id)
    assert producer.call("counts") == {"peers_remote_transport": 1}
    assert consumer.stats()["self_tests_landed"] >= 1


def test_transport_that_loses_writes_fails_the_self_test_and_falls_back_to_tcp(
    pair: netns.VethPair, consumer: ConsumerProcess, producer: ProducerProcess, logs: Path
) -> None:
    """ucx_tls_remote "all" forces UCX's own choice between the namespaces (CMA and SysV shared
    memory): its self-test write never completes, the handshake goes on over TCP."""
    producer.call("reset", settings={"ucx_tls_remote": "all"})
    connected = producer.call("connect", **where(pair.right))
    assert connected["ok"] and connected["transport"] == "tcp", connected
    assert producer.call("counts") == {
        "transport_self_test_failures": 1,
        "peers_fallback_transport": 1,
    }
    assert_landed_bit_exact(consumer, push(producer, pair.right, "fallback", 600), "fallback")
    assert "transport self-test" in (logs / "producer.log").read_text()


def test_control_forced_transport_without_self_test_loses_the_write(
    pair: netns.VethPair, consumer: ConsumerProcess, producer: ProducerProcess
) -> None:
    """The negative control of the two tests above: the same forced choice with the self-test
    off shakes hands and then loses the write (our transfer deadline ends it)."""
    settings = {"ucx_tls_remote": "all", "transport_self_test": False, "transfer_timeout_s": 1.0}
    producer.call("reset", settings=settings)
    pushed = push(producer, pair.right, "lost", 600)
    assert not pushed["ok"] and pushed["error"] == "WriteTimeout", pushed
    assert 1.0 <= pushed["seconds"] < 3.0
    assert producer.call("counts") == {"peers_remote_transport": 1}
    assert consumer.call("checksums", keys=pushed["keys"]) == [None] * 3


def test_no_transport_passing_the_self_test_fails_naming_peer_and_tries(
    pair: netns.VethPair, producer: ProducerProcess
) -> None:
    producer.call("reset", settings={"ucx_tls_remote": "all", "transport_fallback": False})
    connected = producer.call("connect", **where(pair.right))
    assert not connected["ok"] and connected["error"] == "TransportUnusable", connected
    assert f"consumer {pair.right.address}:{INIT_PORT}" in connected["detail"]
    assert "tried all: write not done" in connected["detail"]
    assert connected["seconds"] < 3.0


def test_killed_consumer_fails_the_push_within_its_deadline(
    pair: netns.VethPair, producer: ProducerProcess, logs: Path
) -> None:
    ports = (INIT_PORT + 20, ALLOC_PORT + 20)
    producer.call("reset", settings={"alloc_timeout_s": 1.0, "handshake_timeout_s": 1.0})
    with start_consumer(pair.right, logs / "victim.log", ports=ports) as victim:
        pushed = push(producer, pair.right, "alive", 600, ports=ports)
        assert_landed_bit_exact(victim, pushed, "alive")
        victim.kill()
        pushed = push(producer, pair.right, "after-kill", 600, ports=ports)
        assert not pushed["ok"] and pushed["error"] == "PeerTimeout", pushed
        assert pushed["seconds"] < 1.5


@contextlib.contextmanager
def slowed(side: netns.Side, rate_mbit: int) -> Iterator[None]:
    """Slow ``side``'s sending end of the link to ``rate_mbit``, so that a write lasts a while."""
    qdisc = ["tc", "-n", side.netns, "qdisc"]
    where_ = ["dev", side.device, "root"]
    shape = ["tbf", "rate", f"{rate_mbit}mbit", "burst", "64kb", "latency", "5s"]
    subprocess.run([*qdisc, "add", *where_, *shape], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run([*qdisc, "del", *where_], check=False, capture_output=True)


def test_cut_link_ends_the_write_at_our_deadline_not_nixls(
    pair: netns.VethPair, consumer: ConsumerProcess, producer: ProducerProcess
) -> None:
    """NIXL never reports a cut link (the write stays PROC); our transfer deadline must end it.
    The control: the same slowed write without the cut completes well within that deadline.
    Last in this module: it cuts the link the others use (and restores it after)."""
    producer.call("reset", settings={"transfer_timeout_s": 3.0, "alloc_timeout_s": 1.0})
    assert producer.call("connect", **where(pair.right))["ok"]
    try:
        with slowed(pair.left, 16):  # 2 MiB in ~1 s
            control = push(producer, pair.right, "slow", 4096)
            assert control["ok"] and control["seconds"] < 2.5, control
            assert_landed_bit_exact(consumer, control, "slow")
            producer.send("push", req_id="cut", tokens=4096, seed=1, **where(pair.right))
            time.sleep(0.4)
            pair.set_link(False)
            pushed = producer.result()
        assert not pushed["ok"] and pushed["error"] == "WriteTimeout", pushed
        assert 3.0 <= pushed["seconds"] < 4.0
    finally:
        pair.set_link(True)
