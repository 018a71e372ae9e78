"""Each door of ours admits only the client keys of its roles (``gatekeeper.py``, issue 55 point
7), and each role still reaches the doors it uses.

Before, a CURVE server had no ZAP handler: knowing a door's server key was the only credential,
so any process holding the one secret, the proxy included, got into every door. Here a client
holds the door's server key and one role's keypair (or a stranger's): only those ``ADMITS``
names get in, each admitted message carries its sender's role, and each refusal is counted.
End to end: the proxy's first-token board hears producers, the proxy's drop notices reach a
consumer, and an instance's KV events reach the proxy.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch

from lmcache_pd.auth import (
    ADMITS,
    SECRET_ENV,
    SERVED_BY,
    DeploymentKeys,
    Door,
    Role,
    generate_secret,
)
from lmcache_pd.config import load_config
from lmcache_pd.connector.kv_event_publisher import AuthenticatedEventPublisher
from lmcache_pd.first_token import FirstTokenNotice, NoticeBoard, NoticeSender
from lmcache_pd.gatekeeper import Gatekeeper, sender_role
from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.proxy.kv_drop import KVDropper
from lmcache_pd.transfer.consumer import Consumer
from lmcache_pd.transfer.fake_channel import FakeChannel, FakeFabric
from tests.helpers import consumer_fields, free_port, make_keyer, wait_for

SECRET = generate_secret()
STRANGER = "stranger"  # a keypair of no role: one the attacker made


def keys_of(role: Role) -> DeploymentKeys:
    return DeploymentKeys.from_secret(SECRET, role)


def client_keypair(who: Role | str) -> tuple[bytes, bytes]:
    """``who``'s CURVE client keypair (public, secret); a stranger's is fresh."""
    if who == STRANGER:
        return zmq.curve_keypair()
    secret = keys_of(Role(who)).client_secret
    assert secret is not None
    return zmq.curve_public(secret), secret


def knock(context: zmq.Context, port: int, server: bytes, who: Role | str) -> zmq.Socket:
    """A DEALER holding the door's server key and ``who``'s keypair, its message sent."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.curve_serverkey = server
    socket.curve_publickey, socket.curve_secretkey = client_keypair(who)
    socket.connect(f"tcp://127.0.0.1:{port}")
    socket.send(str(who).encode())
    return socket


@pytest.mark.parametrize("door", list(Door), ids=[d.value for d in Door])
def test_a_door_admits_only_its_roles_keys_however_its_server_key_was_learned(
    door: Door,
) -> None:
    """Every client role's keypair, and a stranger's, all with the door's server key: the
    roles the door admits get in, marked with their role; the others are refused at the
    handshake and counted, their messages never read."""
    context = zmq.Context()
    server_keys = keys_of(min(SERVED_BY[door], key=lambda r: r.value))
    gate = Gatekeeper(context, server_keys)
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    gate.serve(router, door)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    server = zmq.curve_public(server_keys.server_secrets[door])
    knockers = [r for r in Role if keys_of(r).client_secret is not None] + [STRANGER]
    sockets = [knock(context, port, server, who) for who in knockers]
    try:
        heard: dict[str, Role | None] = {}
        deadline = time.monotonic() + 3
        while len(heard) < len(ADMITS[door]) and time.monotonic() < deadline:
            if router.poll(100):
                _, body = router.recv_multipart(copy=False)
                heard[body.bytes.decode()] = sender_role(body)
        refused = len(knockers) - len(ADMITS[door])
        wait_for(lambda: gate.refused >= refused, what="refusals counted")  # retries too
        assert not router.poll(300)  # nothing more comes: the refused never got in
        assert heard == {str(role): role for role in ADMITS[door]}
    finally:
        for socket in (router, *sockets):
            socket.close(linger=0)
        gate.close()
        context.term()


def test_first_token_notices_reach_the_proxy_from_producers_alone() -> None:
    """The proxy's board (its own share) hears a producer's notice; a stranger's keypair with
    the board's server key is refused and counted."""

    async def run() -> tuple[FirstTokenNotice, int]:
        board = NoticeBoard("127.0.0.1", keys_of(Role.PROXY))
        board.start()
        sender = NoticeSender(keys_of(Role.PRODUCER))
        context = zmq.Context()
        server = keys_of(Role.PRODUCER).server_publics[Door.NOTICES]
        stranger = knock(context, board.port, server, STRANGER)
        try:
            expected = board.expect("r1")
            address = board.address_for("http://127.0.0.1:1")
            sender.connect(address)
            notice = FirstTokenNotice("r1", [1, 2, 3], 7)
            deadline = time.monotonic() + 5
            while not expected.done() and time.monotonic() < deadline:
                sender.send(address, notice)  # queued until the handshake is done
                await asyncio.sleep(0.05)
            heard = await asyncio.wait_for(expected, 1)
            await asyncio.sleep(0.3)
            return heard, board.refused
        finally:
            stranger.close(linger=0)
            context.term()
            sender.close()
            await board.close()

    heard, refused = asyncio.run(run())
    assert heard == FirstTokenNotice("r1", [1, 2, 3], 7)
    assert refused >= 1  # a refused client tries again: each try counts


def test_the_proxys_drop_notice_reaches_a_consumer_under_its_own_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``KVDropper`` with the proxy's keys: the consumer (given the whole secret) acknowledges,
    and lets the request go."""
    fields = consumer_fields(num_pages=4)
    monkeypatch.setenv(SECRET_ENV, SECRET)
    config = load_config(None, **fields)
    spec = DisaggSpec("r1", "127.0.0.1", fields["init_port"], fields["alloc_port"])

    async def drop() -> bool:
        dropper = KVDropper(keys_of(Role.PROXY))
        try:
            return await dropper._send(spec, "client gone")
        finally:
            await dropper.close()

    with Consumer(config, make_keyer(), channel=FakeChannel(FakeFabric(), "consumer")) as consumer:
        assert asyncio.run(drop())
        assert consumer.dropped_reason("r1") is not None
        assert consumer.stats_snapshot()["peers_refused"] == 0


def test_kv_events_reach_the_proxy_and_no_instance_key() -> None:
    """A decode instance's publisher (the consumer's share): the proxy's subscription reads
    its events; a producer's keypair with the publisher's server key is refused, counted."""

    port = free_port()
    publisher = AuthenticatedEventPublisher(
        0, endpoint=f"tcp://127.0.0.1:{port}", keys=keys_of(Role.CONSUMER)
    )
    context = zmq.Context()
    subscribers = {}
    for who in (Role.PROXY, Role.PRODUCER):
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        socket.curve_serverkey = keys_of(Role.PROXY).server_publics[Door.EVENTS]
        socket.curve_publickey, socket.curve_secretkey = client_keypair(who)
        socket.connect(f"tcp://127.0.0.1:{port}")
        subscribers[who] = socket
    stored = BlockStored([1], None, [1, 2, 3, 4], 4, None, None, None)
    try:
        deadline = time.monotonic() + 5
        while not subscribers[Role.PROXY].poll(100) and time.monotonic() < deadline:
            publisher.publish(KVEventBatch(ts=1.0, events=[stored]))  # until subscribed
        assert subscribers[Role.PROXY].poll(0)
        assert not subscribers[Role.PRODUCER].poll(300)
        assert publisher._gate is not None and publisher._gate.refused >= 1
    finally:
        for socket in subscribers.values():
            socket.close(linger=0)
        context.term()
        publisher.shutdown()
