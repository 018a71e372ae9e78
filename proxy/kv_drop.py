"""Telling a decode instance that a request's pushed KV will not be loaded.

The proxy picks decode before prefill runs, so prefill pushes the prompt's KV there at once.
When decode is then never asked (the client left, prefill failed, the answer ended at its first
token) or the request ends badly, the proxy says so on decode's alloc port (``KVAbandoned``,
reason ``client_gone``): decode frees the pages now instead of at its claim timeout and refuses
late pushes of that request. Best effort and bounded, never on the client's path: one ZMQ DEALER
per decode rank for all its notices (a CURVE handshake per notice cost a burst of ended requests
one connection each), each notice awaited for its acknowledgement up to a deadline, at most
``MAX_DROPS_IN_FLIGHT`` at once (past it a notice is skipped, counted: the request's pages come
back at decode's claim timeout), and at most ``MAX_PEERS`` ranks' sockets kept (the least
recently told closed first: an instance that left its pool).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

import zmq
import zmq.asyncio

from lmcache_pd import protocol
from lmcache_pd.auth import DeploymentKeys, Door
from lmcache_pd.errors import ProtocolError
from lmcache_pd.proxy.task_stop import stop_task

logger = logging.getLogger(__name__)

# As the producer's cancel: the notice goes to a peer that may be gone.
DROP_TIMEOUT_S = protocol.CANCEL_TIMEOUT_S
# Notices awaiting their acknowledgement at once: a burst of ended requests toward a decode that
# does not answer would otherwise queue without bound.
MAX_DROPS_IN_FLIGHT = 256
MAX_PEERS = 1024


class _Rank:
    """One decode rank's alloc port: the DEALER every notice to it goes on, and the notices
    awaiting their acknowledgement (read as they come, matched by request id)."""

    def __init__(self, context: zmq.asyncio.Context, address: str, keys: DeploymentKeys | None):
        self.address = address
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
        self.socket.setsockopt(zmq.SNDHWM, MAX_DROPS_IN_FLIGHT)
        if keys is not None:
            keys.connect(self.socket, Door.ALLOC)
        self.socket.connect(address)
        self.waiting: dict[str, asyncio.Future[bool]] = {}
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def tell(self, notice: protocol.KVAbandoned) -> bool:
        """Send ``notice``; True once acknowledged, False at the deadline or on a refusal to
        queue it (the peer is gone and its queue full)."""
        future = asyncio.get_running_loop().create_future()
        self.waiting[notice.req_id] = future
        try:
            await self.socket.send(protocol.encode(notice), flags=zmq.NOBLOCK)
            async with asyncio.timeout(DROP_TIMEOUT_S):  # not wait_for: task_stop.py
                return await future
        finally:
            self.waiting.pop(notice.req_id, None)

    async def _read(self) -> None:
        while True:
            data = await self.socket.recv()
            try:
                reply = protocol.ALLOC_REPLIES.decode(data)
            except ProtocolError as exc:
                logger.warning("%s answered a drop notice with garbage: %s", self.address, exc)
                continue
            if isinstance(reply, protocol.AbandonAck):
                future = self.waiting.get(reply.req_id)
                if future is not None and not future.done():
                    future.set_result(True)

    async def close(self) -> None:
        await stop_task(self._reader, f"drop notices' reader of {self.address}")
        self.socket.close(linger=0)


class KVDropper:
    """Sends drop notices from the proxy's event loop; owns its ZMQ context, sockets and
    tasks."""

    def __init__(
        self, keys: DeploymentKeys | None = None, skipped: Callable[[], None] = lambda: None
    ) -> None:
        """``keys``: reach only decode instances of this deployment (``auth.py``); ``skipped``
        counts a notice not sent (``MAX_DROPS_IN_FLIGHT`` were in flight)."""
        self._keys = keys
        self._skipped = skipped
        self._context = zmq.asyncio.Context()
        self._tasks: set[asyncio.Task] = set()
        self._ranks: OrderedDict[str, _Rank] = OrderedDict()

    def drop(self, spec: protocol.DisaggSpec, detail: str) -> None:
        """Send the notice in the background (safe to call from a cancelled handler)."""
        if len(self._tasks) >= MAX_DROPS_IN_FLIGHT:
            self._skipped()
            logger.warning(
                "req %s: %d drop notices in flight: not telling decode (its pages come back "
                "at its claim timeout)",
                spec.req_id,
                len(self._tasks),
            )
            return
        task = asyncio.get_running_loop().create_task(self._send(spec, detail))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, spec: protocol.DisaggSpec, detail: str) -> bool:
        """Tell every rank of decode (each holds its own shard); True if all acknowledged."""
        told = await asyncio.gather(*(self._send_rank(rank, detail) for rank in spec.every_rank()))
        return all(told)

    async def _send_rank(self, spec: protocol.DisaggSpec, detail: str) -> bool:
        """One rank's notice (``spec`` of that rank alone); True if it acknowledged; failures
        are logged, never raised."""
        # Decode may have a write of it in flight (prefill pushes on its own): no shortcut.
        message = protocol.KVAbandoned.of(spec.req_id, protocol.AbandonReason.CLIENT_GONE, detail)
        rank = self._rank(f"tcp://{spec.receiver_host}:{spec.receiver_alloc_port}")
        try:
            acknowledged = await rank.tell(message)
        except (TimeoutError, zmq.ZMQError) as exc:
            logger.warning(
                "req %s: could not tell decode %s to drop its KV: %r",
                spec.req_id,
                rank.address,
                exc,
            )
            return False
        logger.info("req %s: decode told to drop its KV (%s)", spec.req_id, detail)
        return acknowledged

    def _rank(self, address: str) -> _Rank:
        """The socket to ``address``, made on first use; the least recently used closed past
        ``MAX_PEERS``."""
        rank = self._ranks.get(address)
        if rank is None:
            rank = self._ranks[address] = _Rank(self._context, address, self._keys)
            while len(self._ranks) > MAX_PEERS:
                _, oldest = self._ranks.popitem(last=False)
                self._closing(oldest)
        self._ranks.move_to_end(address)
        return rank

    def _closing(self, rank: _Rank) -> None:
        task = asyncio.get_running_loop().create_task(rank.close())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Let notices in flight finish (each is bounded), then close the sockets and the
        context."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2 * DROP_TIMEOUT_S)
        for rank in self._ranks.values():
            await rank.close()
        self._ranks.clear()
        self._context.destroy(linger=0)
