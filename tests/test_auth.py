"""The deployment secret (``auth.py``): CURVE on our ZMQ sockets and sealed NIXL notifications.

A peer without the secret gets no reply on any port, so no metadata, descriptors or pages; a
notification it could still deliver (it would need the consumer's NIXL metadata first) lands
nothing without the MAC. The fake fabric stands in for NIXL where the notification itself is
under test; the consumer and the pushes that must or must not land are real NIXL in another
process.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch
import zmq

from lmcache_pd import protocol
from lmcache_pd.auth import (
    MAC_BYTES,
    SECRET_ENV,
    DeploymentKeys,
    generate_secret,
    load_keys,
    warn_if_open,
)
from lmcache_pd.config import load_config
from lmcache_pd.errors import ConfigError, PeerTimeout, ProtocolError
from lmcache_pd.harness.consumer_process import ConsumerProcess
from lmcache_pd.kernels.integrity import checksum
from lmcache_pd.keys import ChunkKeyer
from lmcache_pd.transfer.consumer import Consumer
from lmcache_pd.transfer.fake_channel import FakeChannel, FakeFabric
from lmcache_pd.transfer.producer import Producer
from lmcache_pd.transfer.sockets import ask, bind_router, dealer
from tests.helpers import (
    CHUNK_SIZE,
    consumer_fields,
    free_port,
    make_chunks,
    make_keyer,
    producer_config,
    spec_for,
    wait_for,
    write_config,
)

SECRET = generate_secret()


def test_keys_come_from_the_secret_alone_and_are_never_shown(tmp_path: Path) -> None:
    keys = DeploymentKeys.from_secret(SECRET)
    assert DeploymentKeys.from_secret(f"  {SECRET}\n") == keys  # as read from a file
    other = DeploymentKeys.from_secret(generate_secret())
    assert other.server_public != keys.server_public and other.mac_key != keys.mac_key
    for key in (keys.server_public, keys.server_secret, keys.mac_key):
        assert repr(key) not in repr(keys) and str(key) not in repr(keys)
    with pytest.raises(ConfigError, match="fewer than 32"):
        DeploymentKeys.from_secret("short")
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    assert load_keys(str(secret_file), environ={}) == keys
    assert load_keys(None, environ={SECRET_ENV: SECRET}) == keys
    assert load_keys(None, environ={}) is None
    with pytest.raises(ConfigError, match="cannot read secret_file"):
        load_keys(str(tmp_path / "missing"), environ={})


def test_a_notification_is_read_only_under_this_deployments_mac() -> None:
    keys = DeploymentKeys.from_secret(SECRET)
    body = b"a WriteDone"
    sealed = keys.seal(body)
    assert len(sealed) == len(body) + MAC_BYTES and keys.unseal(sealed) == body
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    for bad in (body, tampered, DeploymentKeys.from_secret(generate_secret()).seal(body), b""):
        with pytest.raises(ProtocolError, match="MAC"):
            keys.unseal(bad)


def test_a_consumer_open_beyond_loopback_without_a_secret_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_pd.auth"):
        assert warn_if_open(None, "consumer", "0.0.0.0")
        assert "SECURITY" in caplog.text and SECRET_ENV in caplog.text
        caplog.clear()
        assert not warn_if_open(None, "consumer", "127.0.0.1")
        assert not warn_if_open(DeploymentKeys.from_secret(SECRET), "consumer", "0.0.0.0")
        assert caplog.text == ""


def test_curve_ports_answer_only_peers_with_the_secret() -> None:
    """A DEALER with the secret gets its reply; one with none or another secret gets nothing,
    and its message never reaches the port's owner."""
    keys = DeploymentKeys.from_secret(SECRET)
    context = zmq.Context()
    port = free_port()
    router = bind_router(context, "127.0.0.1", port, keys)
    peers = {
        "insider": dealer(context, "127.0.0.1", port, keys),
        "no secret": dealer(context, "127.0.0.1", port, None),
        "other secret": dealer(
            context, "127.0.0.1", port, DeploymentKeys.from_secret(generate_secret())
        ),
    }
    request = protocol.BufferRequest(version=protocol.PROTOCOL_VERSION)
    try:
        for socket in peers.values():
            socket.send(protocol.encode(request))
        received = []
        while router.poll(1000):
            identity, frame = router.recv_multipart()
            received.append(frame)
            reply = protocol.ProbeResult(
                version=protocol.PROTOCOL_VERSION,
                nonce=bytes(protocol.PROBE_NONCE_BYTES),
                state=protocol.ProbeState.UNKNOWN,
            )
            router.send_multipart([identity, protocol.encode(reply)])
        assert received == [protocol.encode(request)]  # the insider's alone
        assert peers["insider"].poll(1000)
        assert not peers["no secret"].poll(0) and not peers["other secret"].poll(0)
        with pytest.raises(PeerTimeout, match="secret"):
            deadline = time.monotonic() + 0.3
            ask(peers["no secret"], request, protocol.INIT_REPLIES, deadline, "r")
    finally:
        for socket in (router, *peers.values()):
            socket.close(linger=0)
        context.term()


def test_a_write_notice_without_the_mac_lands_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the fake fabric (NIXL's stand-in): pages allocated by an insider, then a
    WriteDone for them without the MAC is ignored and counted; the sealed one lands them."""
    keys = DeploymentKeys.from_secret(SECRET)
    fabric = FakeFabric()
    fields = consumer_fields(num_pages=8)
    monkeypatch.setenv(SECRET_ENV, SECRET)  # the secret from the environment, not a file
    config = load_config(None, **fields)
    keyer = make_keyer()
    context = zmq.Context()
    consumer_channel = FakeChannel(fabric, "consumer")
    with Consumer(config, keyer, channel=consumer_channel) as consumer:
        socket = dealer(context, "127.0.0.1", fields["alloc_port"], keys)
        try:
            key = keyer.chunk_keys(list(range(CHUNK_SIZE)))[0].key
            nbytes = 4096
            request = protocol.AllocRequest(
                version=protocol.PROTOCOL_VERSION,
                req_id="r",
                chunks=[protocol.ChunkSpec(key, nbytes)],
            )
            deadline = time.monotonic() + 5
            allocated = ask(socket, request, protocol.ALLOC_REPLIES, deadline, "r")
            assert isinstance(allocated, protocol.AllocResponse)
            done = protocol.WriteDone(
                version=protocol.PROTOCOL_VERSION,
                req_id="r",
                alloc_id=allocated.alloc_id,
                checksums=[checksum(torch.zeros(nbytes, dtype=torch.uint8))],
            )
            inbox = fabric.inboxes.setdefault(consumer_channel.agent_name, [])
            with fabric.lock:
                inbox.append(("rogue", protocol.encode(done)))
            wait_for(
                lambda: consumer.stats_snapshot()["unknown_notifications"] == 1,
                what="the unsealed notice counted",
            )
            assert consumer.stats_snapshot()["chunks_landed"] == 0
            with fabric.lock:
                fabric.inboxes.setdefault(consumer_channel.agent_name, []).append(
                    ("insider", keys.seal(protocol.encode(done)))
                )
            wait_for(
                lambda: consumer.stats_snapshot()["chunks_landed"] == 1,
                what="the sealed notice landing its chunk",
            )
        finally:
            socket.close(linger=0)
            context.term()


@pytest.mark.processes
def test_only_a_producer_with_the_secret_puts_kv_into_a_consumer(tmp_path: Path) -> None:
    """Real NIXL, the consumer in its own process with its secret in a file: a producer with
    no secret or another one fails its handshake naming the secret, and nothing of its push
    lands; one with the secret lands every chunk, bit for bit."""
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    fields = consumer_fields(num_pages=16, secret_file=str(secret_file))
    tokens = list(range(3 * CHUNK_SIZE))
    keyer: ChunkKeyer = make_keyer()
    chunks = make_chunks(keyer.chunk_keys(tokens), seed=3)
    other_file = tmp_path / "other"
    other_file.write_text(generate_secret())
    with ConsumerProcess(
        write_config(tmp_path, "consumer", **fields), log_path=tmp_path / "consumer.log"
    ) as consumer:
        for name, secret in (("none", None), ("other", str(other_file))):
            config = producer_config(secret_file=secret, handshake_timeout_s=1.0)
            with Producer(config) as producer, pytest.raises(PeerTimeout, match="secret"):
                producer.push(spec_for(fields, f"outsider-{name}"), chunks)
        stats = consumer.call("stats")
        assert (stats["init_requests"], stats["alloc_requests"]) == (0, 0)
        assert consumer.call("lookup", tokens=tokens) == 0
        with Producer(producer_config(secret_file=str(secret_file))) as producer:
            assert producer.push(spec_for(fields, "insider"), chunks).chunks_sent == len(chunks)
        wait_for(lambda: consumer.call("lookup", tokens=tokens) == len(tokens), what="landed")
        got = consumer.call("checksums", keys=[key.hex() for key, _ in chunks])
        assert got == [checksum(data) for _, data in chunks]


@pytest.mark.parametrize(
    ("host", "secret", "flagged"),
    [
        ("0.0.0.0", None, 1),
        ("127.0.0.1", None, 0),
        ("0.0.0.0", SECRET, 0),
    ],
    ids=["open", "loopback", "with-secret"],  # not the secret: the same on every xdist worker
)
def test_the_unauthenticated_gauge_says_when_anyone_may_write_kv(
    monkeypatch: pytest.MonkeyPatch, host: str, secret: str | None, flagged: int
) -> None:
    """What reaches /metrics as ``lmcache_pd_consumer_unauthenticated``."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    if secret is not None:
        monkeypatch.setenv(SECRET_ENV, secret)
    config = load_config(None, environ={}, **consumer_fields(num_pages=4, receiver_host=host))
    channel = FakeChannel(FakeFabric(), "consumer")
    with Consumer(config, make_keyer(), channel=channel) as consumer:
        assert consumer.stats_snapshot()["unauthenticated"] == flagged
