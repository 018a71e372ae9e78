"""Telling a decode instance that a request's pushed KV will not be loaded.

The proxy picks decode before prefill runs, so prefill pushes the prompt's KV there at once.
When decode is then never asked (the client left, prefill failed, the answer ended at its first
token) or the request ends badly, the proxy says so on decode's alloc port (``KVAbandoned``,
reason ``client_gone``): decode frees the pages now instead of at its claim timeout and refuses
late pushes of that request. Best effort and bounded: one short-lived ZMQ socket per notice, a
deadline, never on the client's path, and at most ``MAX_DROPS_IN_FLIGHT`` notices at once (past
it a notice is skipped, counted: the request's pages come back at decode's claim timeout).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from lmcache_pd import protocol
from lmcache_pd.auth import DeploymentKeys
from lmcache_pd.errors import ProtocolError

logger = logging.getLogger(__name__)

# As the producer's cancel: the notice goes to a peer that may be gone.
DROP_TIMEOUT_S = protocol.CANCEL_TIMEOUT_S
# Notices sent at once (each a socket, for up to DROP_TIMEOUT_S): a burst of ended requests
# toward a decode that does not answer would otherwise open sockets without bound.
MAX_DROPS_IN_FLIGHT = 256


class KVDropper:
    """Sends drop notices from the proxy's event loop; owns its ZMQ context and tasks."""

    def __init__(
        self, keys: DeploymentKeys | None = None, skipped: Callable[[], None] = lambda: None
    ) -> None:
        """``keys``: reach only decode instances of this deployment (``auth.py``); ``skipped``
        counts a notice not sent (``MAX_DROPS_IN_FLIGHT`` were in flight)."""
        self._keys = keys
        self._skipped = skipped
        self._context = zmq.asyncio.Context()
        self._tasks: set[asyncio.Task] = set()

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
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
        if self._keys is not None:
            self._keys.connect(socket)
        try:
            socket.connect(f"tcp://{spec.receiver_host}:{spec.receiver_alloc_port}")
            await socket.send(protocol.encode(message))
            async with asyncio.timeout(DROP_TIMEOUT_S):  # not wait_for: task_stop.py
                reply = protocol.ALLOC_REPLIES.decode(await socket.recv())
        except (TimeoutError, zmq.ZMQError, ProtocolError) as exc:
            logger.warning(
                "req %s: could not tell decode %s:%d to drop its KV: %r",
                spec.req_id,
                spec.receiver_host,
                spec.receiver_alloc_port,
                exc,
            )
            return False
        finally:
            socket.close(linger=0)
        logger.info("req %s: decode told to drop its KV (%s)", spec.req_id, detail)
        return isinstance(reply, protocol.AbandonAck)

    async def close(self) -> None:
        """Let notices in flight finish (each is bounded), then close the context."""
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=2 * DROP_TIMEOUT_S)
        self._context.destroy(linger=0)
