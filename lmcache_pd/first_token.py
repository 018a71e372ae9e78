"""Prefill's first token, sent straight from its engine to the proxy: decode's head start.

Prefill's HTTP answer leaves its API server some milliseconds after the engine core has the token:
the API server shares prefill's cores with the next prompt's forward pass (8-10 ms between vLLM's
own first-token time and our proxy, measured here on one core per instance). Decode cannot be asked
before the proxy knows that token (its prompt ends with it), so that delay fell whole on the gap
between the first and the second token. Now the producer's scheduler half sends a small notice
(``FirstTokenNotice``: the request, its prompt's token ids, the token) to the proxy the moment the
request ends in its engine, and the proxy asks decode on whichever comes first, the notice or the
answer. The proxy names where the notice goes in the request's ``KVTransferParams.first_tok_to``
(``protocol.py``).

A notice is only a head start, never what the client sees: the proxy streams the first token
from prefill's HTTP answer (its text, logprobs and finish reason come from there) and keeps
decode's stream only if the answer names the same prompt and token; otherwise it cancels it and
asks decode again. A lost notice (a proxy the engine cannot reach, a full queue) costs the head
start and nothing else, so sending never blocks the engine.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from lmcache_pd.auth import DeploymentKeys, Door
from lmcache_pd.gatekeeper import Gatekeeper, gatekeeper

logger = logging.getLogger(__name__)

# Notices queued for a proxy not (yet) connected before more are dropped: each is one request's
# head start, stale within a second.
SEND_QUEUE = 64
# Proxies an engine keeps a socket to (usually one or two; the oldest is closed past this).
MAX_PROXIES = 16
# A notice carries the prompt; a proxy refuses any larger message than this (a 1M-token prompt).
MAX_NOTICE_BYTES = 8 << 20
# Hosts that mean "every interface": the proxy then names, per prefill instance, its own address
# on the route there.
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class FirstTokenNotice(msgspec.Struct, frozen=True, array_like=True):
    """A producer request's end in prefill's engine: ``req_id`` is the DisaggSpec's."""

    req_id: str
    prompt_token_ids: list[int]
    token: int


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(FirstTokenNotice)


class NoticeSender:
    """The producer engine's side: one PUSH socket per proxy, kept for the next requests.

    Owned by vLLM's scheduler thread (the connector's scheduler half), which alone calls it.
    ``connect`` when the request arrives, so that the connection is up by the time its first
    token exists; ``send`` never blocks."""

    def __init__(self, keys: DeploymentKeys | None = None) -> None:
        """``keys``: reach only a proxy of this deployment (``auth.py``)."""
        self._keys = keys
        self._context: zmq.Context | None = None
        self._sockets: collections.OrderedDict[str, zmq.Socket] = collections.OrderedDict()

    def connect(self, address: str) -> bool:
        """Keep a socket to ``address``; False (logged) if ZMQ refuses the address. Never
        raises: it runs inside vLLM's scheduler, where an exception would end the engine, and
        the address comes from a request."""
        if address in self._sockets:
            self._sockets.move_to_end(address)
            return True
        if self._context is None:
            self._context = zmq.Context()
        sock = self._context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        if self._keys is not None:
            self._keys.connect(sock, Door.NOTICES)
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            sock.close()
            logger.warning("no first-token notices to %r: %s", address, exc)
            return False
        self._sockets[address] = sock
        if len(self._sockets) > MAX_PROXIES:
            _, oldest = self._sockets.popitem(last=False)
            oldest.close()
        return True

    def send(self, address: str, notice: FirstTokenNotice) -> None:
        """Queue the notice; if it cannot go now, drop it (the proxy waits for the answer)."""
        if not self.connect(address):
            return
        try:
            self._sockets[address].send(_encoder.encode(notice), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.debug("req %s: notice to %s not sent: %s", notice.req_id, address, exc)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None


class NoticeBoard:
    """The proxy's side: a PULL socket on its event loop, and the requests waiting for notices.

    ``expect`` before prefill is asked, ``forget`` when the request no longer cares; a notice
    for a request nobody expects (late, or not ours) is dropped."""

    def __init__(
        self, host: str, keys: DeploymentKeys | None = None, port: int | None = None
    ) -> None:
        """Listen on ``host`` (a wildcard listens everywhere and tells each prefill instance the
        address it reaches the proxy by) on ``port``, or one the system picks (None); with
        ``keys``, for prefill engines of this deployment alone (``auth.py``): the proxy's keys,
        whose gatekeeper admits producers' alone."""
        self._host = host
        self._context = zmq.asyncio.Context()
        self._gate: Gatekeeper | None = gatekeeper(self._context, keys)
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_NOTICE_BYTES)
        if self._gate is not None:
            self._gate.serve(self._socket, Door.NOTICES)
        bind_host = "*" if host in WILDCARD_HOSTS else host
        if ":" in bind_host:
            self._socket.setsockopt(zmq.IPV6, 1)
            bind_host = f"[{bind_host}]"
        try:
            if port is None:
                self.port = self._socket.bind_to_random_port(f"tcp://{bind_host}")
            else:
                self._socket.bind(f"tcp://{bind_host}:{port}")
                self.port = port
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._waiting: dict[str, asyncio.Future[FirstTokenNotice]] = {}
        self._addresses: dict[str, str] = {}  # by prefill URL
        self._reader: asyncio.Task | None = None

    def start(self) -> None:
        self._reader = asyncio.get_running_loop().create_task(self._read())

    @property
    def refused(self) -> int:
        """Handshakes refused: keys of no role that sends notices (``gatekeeper.py``)."""
        return 0 if self._gate is None else self._gate.refused

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._socket.close(linger=0)
        if self._gate is not None:  # after the socket it guards, before the context ends
            self._gate.close()
        self._context.destroy(linger=0)

    def address_for(self, prefill_url: str) -> str:
        """Where the prefill instance at ``prefill_url`` sends its notices."""
        address = self._addresses.get(prefill_url)
        if address is None:
            host = self._host
            if host in WILDCARD_HOSTS:
                host = _local_address_towards(prefill_url)
            if ":" in host:
                host = f"[{host}]"
            address = self._addresses[prefill_url] = f"tcp://{host}:{self.port}"
        return address

    def expect(self, req_id: str) -> asyncio.Future[FirstTokenNotice]:
        future = asyncio.get_running_loop().create_future()
        self._waiting[req_id] = future
        return future

    def forget(self, req_id: str) -> None:
        future = self._waiting.pop(req_id, None)
        if future is not None and not future.done():
            future.cancel()

    async def _read(self) -> None:
        try:
            while True:
                raw = await self._socket.recv()
                try:
                    notice = _decoder.decode(raw)
                except msgspec.DecodeError as exc:
                    logger.warning("an unreadable first-token notice (%d bytes): %s", len(raw), exc)
                    continue
                future = self._waiting.pop(notice.req_id, None)
                if future is not None and not future.done():
                    future.set_result(notice)
        except zmq.ZMQError:  # decode is asked on prefill's answers from now on
            logger.exception("first-token notices stopped")


def _local_address_towards(url: str) -> str:
    """This host's address on the route to ``url``'s host (no packet is sent)."""
    host = urlsplit(url).hostname or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
