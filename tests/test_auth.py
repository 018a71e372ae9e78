"""The deployment secret (``auth.py``): each role's share of it, CURVE on our ZMQ sockets and
sealed NIXL notifications.

A peer without the secret gets no reply on any port, so no metadata, descriptors or pages; a
notification it could still deliver (it would need the consumer's NIXL metadata first) lands
nothing without the MAC. The proxy's share holds no MAC key and no key a consumer's init port
admits, and its key on the alloc port may only let a request go. The fake fabric stands in for
NIXL where the notification itself is under test; the consumer and the pushes that must or must
not land are real NIXL in another process. Which client keys each door admits:
``test_gatekeeper.py``.
"""

from __future__ import annotations

import base64
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
    SHARE_PREFIX,
    DeploymentKeys,
    Door,
    Role,
    generate_secret,
    load_keys,
    role_shares,
    warn_if_open,
)
from lmcache_pd.config import load_config
from lmcache_pd.errors import ConfigError, PeerTimeout, ProtocolError
from lmcache_pd.gatekeeper import Gatekeeper
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


def keys_of(role: Role, secret: str = SECRET) -> DeploymentKeys:
    return DeploymentKeys.from_secret(secret, role)


def test_each_role_gets_its_share_of_the_secret_and_no_key_is_shown(tmp_path: Path) -> None:
    keys = keys_of(Role.PRODUCER)
    assert keys_of(Role.PRODUCER, f"  {SECRET}\n") == keys  # as read from a file
    other = keys_of(Role.PRODUCER, generate_secret())
    assert other.mac_key != keys.mac_key and other.client_secret != keys.client_secret
    assert other.server_publics != keys.server_publics and other.deployment != keys.deployment
    for role in Role:
        shown = repr(keys_of(role))
        held = keys_of(role)
        for key in (
            held.mac_key,
            held.client_secret,
            *held.server_secrets.values(),
            *held.server_publics.values(),
        ):
            assert key is None or (repr(key) not in shown and key.decode("latin-1") not in shown)
    with pytest.raises(ConfigError, match="fewer than 32"):
        DeploymentKeys.from_secret("short", Role.PROXY)
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    assert load_keys(str(secret_file), Role.PRODUCER, environ={}) == keys
    assert load_keys(None, Role.PRODUCER, environ={SECRET_ENV: SECRET}) == keys
    assert load_keys(None, Role.PRODUCER, environ={}) is None
    with pytest.raises(ConfigError, match="cannot read secret_file"):
        load_keys(str(tmp_path / "missing"), Role.PRODUCER, environ={})


def test_a_share_read_back_is_its_role_s_keys_and_no_other_role_s(tmp_path: Path) -> None:
    """What ``serve``, Ray and Kubernetes hand each process instead of the secret."""
    shares = role_shares(SECRET)
    for role, text in shares.items():
        assert text.startswith(SHARE_PREFIX) and SECRET not in text and "\n" not in text
        share_file = tmp_path / f"{role.value}.key"
        share_file.write_text(text + "\n")
        assert load_keys(str(share_file), role, environ={}) == keys_of(role)
        assert load_keys(None, role, environ={SECRET_ENV: text}) == keys_of(role)
    proxy_file = tmp_path / "proxy.key"
    for role in (Role.PRODUCER, Role.CONSUMER):  # the proxy's share given to an instance
        with pytest.raises(ConfigError, match="holds a proxy's deployment keys, not a"):
            load_keys(str(proxy_file), role, environ={})
    with pytest.raises(ConfigError, match="unreadable"):
        load_keys(None, Role.PROXY, environ={SECRET_ENV: SHARE_PREFIX + "not-base64!"})


def test_the_cli_prints_a_secret_or_one_role_s_share_of_it() -> None:
    """For a deployment made by hand: one secret, and each process given its role's share."""
    from typer.testing import CliRunner

    from lmcache_pd.cli import app

    runner = CliRunner()
    fresh = runner.invoke(app, ["secret"], env={SECRET_ENV: ""})
    assert fresh.exit_code == 0 and len(fresh.stdout.strip()) >= 32
    shared = runner.invoke(app, ["secret", "--share", "proxy"], env={SECRET_ENV: SECRET})
    assert shared.exit_code == 0 and shared.stdout.strip() == role_shares(SECRET)[Role.PROXY]
    assert runner.invoke(app, ["secret", "--share", "proxy"], env={SECRET_ENV: ""}).exit_code


def test_a_share_holding_more_than_its_role_s_keys_is_refused() -> None:
    """A proxy's share with the MAC key slipped in (a tampered file) is not taken."""
    import msgspec

    from lmcache_pd.auth import _Share

    text = role_shares(SECRET)[Role.PROXY]
    share = msgspec.msgpack.decode(base64.urlsafe_b64decode(text.removeprefix(SHARE_PREFIX)))
    share["mac_key"] = keys_of(Role.PRODUCER).mac_key
    forged = SHARE_PREFIX + base64.urlsafe_b64encode(msgspec.msgpack.encode(share)).decode()
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(share), type=_Share)  # well formed
    with pytest.raises(ConfigError, match="not a proxy's"):
        load_keys(None, Role.PROXY, environ={SECRET_ENV: forged})


def test_the_proxy_holds_no_notification_key_nor_any_key_to_a_consumers_init_port() -> None:
    """Issue 55 point 7: the proxy parses untrusted HTTP, yet held every key. Now, given the
    whole secret or its share, it keeps neither the MAC key (it cannot say a chunk landed) nor
    a key the init port admits (it cannot shake hands for NIXL metadata); the producer, the
    control, holds both."""
    proxy = load_keys(None, Role.PROXY, environ={SECRET_ENV: SECRET})
    assert proxy == keys_of(Role.PROXY) and proxy is not None
    producer, consumer = keys_of(Role.PRODUCER), keys_of(Role.CONSUMER)
    assert proxy.mac_key is None and producer.mac_key == consumer.mac_key is not None
    assert set(proxy.server_secrets) == {Door.NOTICES}  # its own board's, no consumer's
    assert Door.INIT not in proxy.server_publics and Door.INIT in producer.server_publics
    share = base64.urlsafe_b64decode(role_shares(SECRET)[Role.PROXY].removeprefix(SHARE_PREFIX))
    withheld = [
        consumer.mac_key,
        producer.client_secret,
        *consumer.server_secrets.values(),
        *producer.server_secrets.values(),
    ]
    assert all(key not in share for key in withheld if key is not None)
    body = protocol.encode(protocol.WriteDone(protocol.PROTOCOL_VERSION, "r", 1, [0]))
    with pytest.raises(ConfigError, match="no notification key"):
        proxy.seal(body)
    assert consumer.unseal(producer.seal(body)) == body  # the control
    context = zmq.Context()
    try:
        with pytest.raises(ConfigError, match="does not connect to the init door"):
            dealer(context, "127.0.0.1", free_port(), proxy, Door.INIT)
        with pytest.raises(ConfigError, match="cannot serve the alloc door"):
            proxy.serve(context.socket(zmq.ROUTER), Door.ALLOC)
    finally:
        context.destroy(linger=0)


def test_a_notification_is_read_only_under_this_deployments_mac() -> None:
    producer, consumer = keys_of(Role.PRODUCER), keys_of(Role.CONSUMER)
    body = b"a WriteDone"
    sealed = producer.seal(body)
    assert len(sealed) == len(body) + MAC_BYTES and consumer.unseal(sealed) == body
    tampered = sealed[:-1] + bytes([sealed[-1] ^ 1])
    for bad in (body, tampered, keys_of(Role.PRODUCER, generate_secret()).seal(body), b""):
        with pytest.raises(ProtocolError, match="MAC"):
            consumer.unseal(bad)


def test_a_consumer_open_beyond_loopback_without_a_secret_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="lmcache_pd.auth"):
        assert warn_if_open(None, "consumer", "0.0.0.0")
        assert "SECURITY" in caplog.text and SECRET_ENV in caplog.text
        caplog.clear()
        assert not warn_if_open(None, "consumer", "127.0.0.1")
        assert not warn_if_open(keys_of(Role.CONSUMER), "consumer", "0.0.0.0")
        assert caplog.text == ""


def test_curve_ports_answer_only_peers_with_the_secret() -> None:
    """A producer's DEALER gets its reply on an init port; one with no secret or another gets
    nothing, and its message never reaches the port's owner."""
    context = zmq.Context()
    port = free_port()
    gate = Gatekeeper(context, keys_of(Role.CONSUMER))
    router = bind_router(context, "127.0.0.1", port, gate, Door.INIT)
    peers = {
        "insider": dealer(context, "127.0.0.1", port, keys_of(Role.PRODUCER), Door.INIT),
        "no secret": dealer(context, "127.0.0.1", port, None, Door.INIT),
        "other secret": dealer(
            context, "127.0.0.1", port, keys_of(Role.PRODUCER, generate_secret()), Door.INIT
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
        gate.close()
        context.term()


def test_the_proxys_key_on_the_alloc_port_only_lets_a_request_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A consumer (its secret from the environment) answers the proxy's ``KVAbandoned``, what
    the proxy is let in for, and refuses it pages, reservations and cancels, counted; the
    producer, the control, gets its pages. Before, any key-holder could ask for anything."""
    fields = consumer_fields(num_pages=8)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    config = load_config(None, **fields)
    keyer = make_keyer()
    key = keyer.chunk_keys(list(range(CHUNK_SIZE)))[0].key
    version = protocol.PROTOCOL_VERSION
    allocate = protocol.AllocRequest(version, "r", [protocol.ChunkSpec(key, 4096)])
    context = zmq.Context()
    channel = FakeChannel(FakeFabric(), "consumer")
    with Consumer(config, keyer, channel=channel) as consumer:
        port = fields["alloc_port"]
        proxy = dealer(context, "127.0.0.1", port, keys_of(Role.PROXY), Door.ALLOC)
        producer = dealer(context, "127.0.0.1", port, keys_of(Role.PRODUCER), Door.ALLOC)
        try:

            def asked(socket: zmq.Socket, message: protocol.Message) -> object:
                deadline = time.monotonic() + 5
                return ask(socket, message, protocol.ALLOC_REPLIES, deadline, "r")

            for message in (
                allocate,
                protocol.ReserveRequest(version, 2),
                protocol.AllocCancel(version, "r", 1),
            ):
                refused = asked(proxy, message)
                assert isinstance(refused, protocol.ErrorReply), refused
                assert refused.code is protocol.ErrorCode.BAD_REQUEST
                assert "may only let a request go" in refused.detail
            assert consumer.stats_snapshot()["alloc_requests"] == 0
            assert isinstance(asked(producer, allocate), protocol.AllocResponse)
            let_go = protocol.KVAbandoned.of("r", protocol.AbandonReason.CLIENT_GONE, "left")
            acknowledged = asked(proxy, let_go)
            assert isinstance(acknowledged, protocol.AbandonAck) and acknowledged.known
            stats = consumer.stats_snapshot()
            assert (stats["refused_for_role"], stats["alloc_requests"]) == (3, 1)
            assert stats["requests_abandoned"] == 1 and consumer.dropped_reason("r")
        finally:
            proxy.close(linger=0)
            producer.close(linger=0)
            context.term()


def test_a_write_notice_without_the_mac_lands_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the fake fabric (NIXL's stand-in): pages allocated by an insider, then a
    WriteDone for them without the MAC is ignored and counted; the sealed one lands them."""
    keys = keys_of(Role.PRODUCER)
    fabric = FakeFabric()
    fields = consumer_fields(num_pages=8)
    monkeypatch.setenv(SECRET_ENV, SECRET)  # the secret from the environment, not a file
    config = load_config(None, **fields)
    keyer = make_keyer()
    context = zmq.Context()
    consumer_channel = FakeChannel(fabric, "consumer")
    with Consumer(config, keyer, channel=consumer_channel) as consumer:
        socket = dealer(context, "127.0.0.1", fields["alloc_port"], keys, Door.ALLOC)
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
    """Real NIXL, the consumer in its own process with its share of the secret in a file: a
    producer with no secret or another one fails its handshake naming the secret, and nothing of
    its push lands; one given the proxy's share is refused at its start; one with its own share
    (or the whole secret) lands every chunk, bit for bit."""
    shares = role_shares(SECRET)
    for role, text in shares.items():
        (tmp_path / f"{role.value}.key").write_text(text)
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    fields = consumer_fields(num_pages=16, secret_file=str(tmp_path / "consumer.key"))
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
        with pytest.raises(ConfigError, match="holds a proxy's"):
            Producer(producer_config(secret_file=str(tmp_path / "proxy.key")))
        stats = consumer.call("stats")
        assert (stats["init_requests"], stats["alloc_requests"]) == (0, 0)
        assert consumer.call("lookup", tokens=tokens) == 0
        for seed, held in ((3, tmp_path / "producer.key"), (4, secret_file)):
            prompt = [seed, *tokens]  # chunks of their own: each push writes all of them
            pushed = make_chunks(keyer.chunk_keys(prompt)[:3], seed=seed)
            with Producer(producer_config(secret_file=str(held))) as producer:
                sent = producer.push(spec_for(fields, f"insider-{seed}"), pushed).chunks_sent
                assert sent == len(pushed)
            wait_for(
                lambda p=prompt: consumer.call("lookup", tokens=p) == 3 * CHUNK_SIZE,
                what="landed",
            )
            got = consumer.call("checksums", keys=[key.hex() for key, _ in pushed])
            assert got == [checksum(data) for _, data in pushed]


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
