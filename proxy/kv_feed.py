"""Following one instance's KV events into its ``InstanceCaches``, losing none unseen.

vLLM numbers its event batches (``seq``, from 0 per publisher) and keeps the last ones for
replay on a second socket. The feed applies batches in order. Every connection of the
subscription (the first, and each reconnection: an instance restarted on the same address is a
new publisher, whatever its numbers say) is followed by a replay of all the publisher has, the
index of that instance cleared first, and what the subscription holds unread then dropped (the
replay has what the publisher connected now sent; the rest is a gone publisher's, whose numbers
would read as a gap in the new one's). A replay awaited when the connection changes is given up
at once: the publisher asked may be the one gone. A batch that skips numbers (the publisher
dropped some at its high-water mark) is preceded by a replay of the missing ones; a number not
above the last one seen means a new publisher too. What no replay can give back (it was older
than vLLM's buffer, or the replay did not answer in time) clears the index of that instance:
forgetting blocks only costs a routing hint, while remembering blocks the instance evicted would
send requests where nothing is held. So an instance that restarts re-enters the index within one
replay.

Both sockets are CURVE clients of the instance's publisher (``auth.py``): only instances of
this deployment are heard, and a handshake the instance refuses (another secret) is said as
such, not as silence. Every frame is checked before use; a malformed batch, or event, is counted
and skipped, never raised: the rest of its batch is applied. Each replay asks on a socket of its
own, so a late answer to one is never read as the next one's. A long replay yields to the event
loop between batches. Runs on the proxy's event loop, one task per instance; a task that ends
for any other reason clears its instance's index (``alive`` says so), and the KV index starts
it again (``kv_index.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from lmcache_pd.auth import DeploymentKeys, Door
from lmcache_pd.kv_events import BATCHES, MAX_BATCH_BYTES
from lmcache_pd.proxy.config import KVEventsAddress
from lmcache_pd.proxy.prefix_index import InstanceCaches
from lmcache_pd.proxy.task_stop import stop_task

logger = logging.getLogger(__name__)

SEQ_BYTES = 8
# vLLM's replay socket ends its answer with this sequence number (-1, signed).
END_OF_REPLAY = (-1).to_bytes(SEQ_BYTES, "big", signed=True)
# Longest wait for each message of a replay; a publisher on a busy host answers in milliseconds.
REPLAY_TIMEOUT_S = 2.0
# Batches read per turn of the feed, so that a connection's replay is never long delayed.
MAX_BATCHES_PER_TURN = 64
# Batches a replay applies between two yields to the event loop (requests route meanwhile).
BATCHES_PER_YIELD = 64
# Messages the subscription holds unread at most (its receive high-water mark, ZMQ's default).
SUBSCRIBER_HWM = 1000
# The subscription's handshake outcomes the feed watches.
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class EventFeed:
    """One instance's events, applied to ``blocks``; ``count(what)`` counts what happened:
    batches, malformed, resyncs."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        name: str,
        address: KVEventsAddress,
        keys: DeploymentKeys | None,
        blocks: InstanceCaches,
        count: Callable[[str], None],
    ) -> None:
        self._context = context
        self._name = name
        self._address = address
        self._keys = keys
        self.blocks = blocks
        self._count = count
        self._next_seq: int | None = None  # the batch expected next; None: none seen yet
        self._last_live: int | None = None  # the last batch the subscription delivered
        self._connected = False  # the subscription connected once already
        self._refused = False  # its last handshake failed (said once per spell)
        # The subscription's handshake outcomes: one ready means its connection changed.
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def alive(self) -> bool:
        """Started and still following (not ended by an error)."""
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kv-events {self._name}"
        )

    async def stop(self) -> None:
        if self._task is not None:
            await stop_task(self._task, f"the kv events feed of {self._name}")
            self._task = None

    async def _run(self) -> None:
        subscriber = self._socket(zmq.SUB)
        subscriber.setsockopt(zmq.RCVHWM, SUBSCRIBER_HWM)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"")
        # Every (re)connection may be to a new publisher (the instance restarted, on the same
        # address): each is followed by a replay of all the publisher has.
        handshakes = subscriber.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
        self._monitor = handshakes
        subscriber.connect(self._address.endpoint(self._address.port))
        poller = zmq.asyncio.Poller()
        poller.register(subscriber, zmq.POLLIN)
        poller.register(handshakes, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                try:
                    if handshakes in ready and await self._handshakes(handshakes):
                        await self._follow_anew(subscriber)
                    for _ in range(MAX_BATCHES_PER_TURN if subscriber in ready else 0):
                        try:
                            frames = await subscriber.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        batch = self._read(frames)
                        if batch is not None:
                            await self._on_batch(*batch)
                except _Reconnected:
                    # A replay was awaited when the connection changed (the instance restarted?):
                    # its answer is moot, and the next turn follows the new connection.
                    logger.info("%s: reconnected during a replay: replay given up", self._name)
                    self._count("replays_abandoned")
                    self.blocks.clear()
        except asyncio.CancelledError:
            raise
        except Exception:  # ZMQ's, or a bug of ours: its index is cleared, the index restarts it
            logger.exception("kv events of %s stopped; its index is cleared", self._name)
            self._count("feed_errors")
            self.blocks.clear()
        finally:
            self._monitor = None
            subscriber.disable_monitor()
            handshakes.close(linger=0)
            subscriber.close(linger=0)

    async def _handshakes(self, handshakes: zmq.asyncio.Socket) -> bool:
        """Read the subscription's handshake outcomes; True if it (re)connected."""
        connected = False
        while await handshakes.poll(0):
            event = parse_monitor_message(await handshakes.recv_multipart())["event"]
            if event & HANDSHAKE_FAILED:
                self._count("handshakes_refused")
                if not self._refused:
                    logger.warning(
                        "%s refuses the proxy's handshake for its KV events: is the proxy's "
                        "deployment secret the instance's?",
                        self._name,
                    )
                self._refused = True
                continue
            self._refused = False
            if self._connected:
                logger.info("%s: its events reconnected: resync", self._name)
                self._count("reconnects")
            self._connected = connected = True
        return connected

    async def _follow_anew(self, subscriber: zmq.asyncio.Socket) -> None:
        """The subscription (re)connected, maybe to a new publisher: what it holds unread now is
        dropped, and all the publisher has is replayed. Whatever the publisher connected now
        sent before the replay is asked, the replay has; what is left of a publisher gone (its
        batches read after this, in its numbering, would look like a gap in the new one's and
        stay in the index) is stale."""
        self._next_seq = self._last_live = None
        for _ in range(2 * SUBSCRIBER_HWM):  # bounded: the publisher may go on meanwhile
            try:
                await subscriber.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
        await self._resync(0, None)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_BATCH_BYTES)
        if self._keys is not None:
            self._keys.connect(socket, Door.EVENTS)
        return socket

    async def _on_batch(self, seq: int, payload: bytes) -> None:
        expected = self._next_seq
        if self._last_live is not None and seq <= self._last_live:
            # Live batches come in order: a number not above the last is a new publisher.
            logger.info("%s: its events restarted (instance restarted?): resync", self._name)
            self._count("restarts")
            await self._resync(0, seq)
        elif expected is not None and seq < expected:
            return  # had already, from a replay
        elif expected is None or seq > expected:
            await self._resync(expected or 0, seq)
        self._apply(payload)
        self._next_seq = seq + 1
        self._last_live = seq

    async def _resync(self, start: int, live: int | None) -> None:
        """Apply the replay of batches ``start`` up to ``live`` (exclusive; None: all there
        are); clear the index first when any of them cannot be had. Asked on a socket of its
        own: an answer to an earlier replay, late, never mixes in."""
        if start == 0:
            self.blocks.clear()
        self._count("resyncs")
        batches: list[tuple[int, bytes]] = []
        replay = self._socket(zmq.DEALER)
        replay.connect(self._address.endpoint(self._address.replay_port))
        try:
            await replay.send_multipart([b"", start.to_bytes(SEQ_BYTES, "big")])
            while True:
                frames = await self._replayed(replay)
                if len(frames) >= 3 and frames[2] == END_OF_REPLAY:
                    break
                batch = self._read(frames[1:])
                if batch is not None and start <= batch[0] and (live is None or batch[0] < live):
                    batches.append(batch)
        except (TimeoutError, zmq.ZMQError) as exc:
            logger.warning("%s: no replay of its events (%r): index of it cleared", self._name, exc)
            self._count("replay_failures")
            self.blocks.clear()
            return
        finally:
            replay.close(linger=0)
        if live is None:  # all there are: up to the last one replayed
            live = batches[-1][0] + 1 if batches else start
            self._next_seq = live if batches else None
        tail = _contiguous_tail(batches, live)
        if len(tail) != live - start:
            # What came before the tail is lost: blocks it stored or removed are unknown.
            logger.info("%s: events %d-%d not all replayable: index reset", self._name, start, live)
            self._count("replay_gaps")
            self.blocks.clear()
        for index, (_, payload) in enumerate(tail, 1):
            self._apply(payload)
            if index % BATCHES_PER_YIELD == 0:
                await asyncio.sleep(0)  # requests route meanwhile

    async def _replayed(self, replay: zmq.asyncio.Socket) -> list[bytes]:
        """The next message of a replay, within ``REPLAY_TIMEOUT_S`` (``TimeoutError``);
        ``_Reconnected`` if the subscription's connection changes first."""
        poller = zmq.asyncio.Poller()
        poller.register(replay, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        async with asyncio.timeout(REPLAY_TIMEOUT_S):  # not wait_for: task_stop.py
            ready = dict(await poller.poll())
        if self._monitor is not None and self._monitor in ready:
            raise _Reconnected
        return await replay.recv_multipart(zmq.NOBLOCK)

    def _read(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        """``[topic, seq, payload]`` as (seq, payload); None, counted, if malformed."""
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            self._count("malformed")
            logger.warning("%s: a KV event message of %d frames ignored", self._name, len(frames))
            return None
        return int.from_bytes(frames[1], "big"), frames[2]

    def _apply(self, payload: bytes) -> None:
        """Apply a batch, event by event: one the index cannot take (a token id past 64 bits,
        say) is counted and skipped, and the rest of the batch applied."""
        try:
            batch = BATCHES.decode(payload)
        except (msgspec.DecodeError, ValueError) as exc:
            self._count("malformed")
            logger.warning("%s: a malformed KV event batch ignored: %s", self._name, exc)
            return
        for event in batch.events:
            try:
                self.blocks.apply(event)
            except Exception as exc:  # the instance's bytes: never a reason to stop following
                self._count("malformed")
                logger.warning("%s: a KV event the index cannot take ignored: %r", self._name, exc)
        self._count("batches")


class _Reconnected(Exception):
    """The subscription's connection changed while a replay was awaited."""


def _contiguous_tail(batches: list[tuple[int, bytes]], live: int) -> list[tuple[int, bytes]]:
    """The longest run of ``batches`` (in the order replayed) numbered up to ``live - 1``
    without a gap: what can be applied right before batch ``live``."""
    tail: list[tuple[int, bytes]] = []
    for seq, payload in reversed(batches):
        if seq != live - 1 - len(tail):
            break
        tail.append((seq, payload))
    return tail[::-1]
