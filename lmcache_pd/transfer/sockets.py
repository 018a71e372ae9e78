"""The transfer core's ZMQ sockets, both ends: the producer's DEALER that asks a consumer and
reads its replies by a deadline, and the consumer's ROUTER ports with their error replies.

Every socket drops a frame over ``MAX_FRAME_BYTES`` before anything is allocated for it, and
never lingers on close; every wait for a reply has a deadline.
"""

from __future__ import annotations

import time

import zmq

from lmcache_pd import protocol
from lmcache_pd.auth import DeploymentKeys, Door
from lmcache_pd.errors import (
    AllocationError,
    BufferFull,
    ConfigError,
    PDError,
    PeerError,
    PeerTimeout,
    RequestDropped,
    VersionMismatch,
)
from lmcache_pd.gatekeeper import Gatekeeper
from lmcache_pd.protocol import ErrorCode, ErrorReply


def dealer(
    context: zmq.Context, host: str, port: int, keys: DeploymentKeys | None, door: Door
) -> zmq.Socket:
    """A DEALER socket to ``host:port`` that never lingers or takes an oversized frame, and
    with ``keys`` reaches only a consumer's ``door`` of this deployment (``auth.py``)."""
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
    if keys is not None:
        keys.connect(socket, door)
    socket.connect(f"tcp://{host}:{port}")
    return socket


def ask(
    socket: zmq.Socket,
    message: protocol.Message,
    codec: protocol.Codec,
    deadline: float,
    req_id: str,
) -> object:
    """Send one request and wait for its reply until ``deadline``."""
    send(socket, message, req_id)
    return receive(socket, type(message).__name__, codec, deadline, req_id)


def send(socket: zmq.Socket, message: protocol.Message, req_id: str) -> None:
    """Send one request without waiting; its reply is the next one ``receive`` reads."""
    try:
        socket.send(protocol.encode(message), zmq.NOBLOCK)
    except zmq.ZMQError as exc:
        raise PeerTimeout(
            f"req {req_id}: cannot send {type(message).__name__} ({exc}): no connection to the "
            "consumer (it is down, or does not share this deployment's secret)"
        ) from exc


def receive(
    socket: zmq.Socket, asked: str, codec: protocol.Codec, deadline: float, req_id: str
) -> object:
    """The reply to the request named ``asked``, sent earlier, by ``deadline``."""
    remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
    if not socket.poll(remaining_ms, zmq.POLLIN):
        raise PeerTimeout(
            f"req {req_id}: no reply to {asked} in time (the consumer is down or busy, or "
            "does not share this deployment's secret)"
        )
    return codec.decode(socket.recv())


def error_from_reply(req_id: str, reply: ErrorReply) -> PDError:
    """The exception a consumer's ErrorReply stands for."""
    detail = f"req {req_id}: consumer refused: {reply.detail}"
    if reply.code is ErrorCode.BUFFER_FULL:
        return BufferFull(detail, reply.retry_after_s)
    if reply.code is ErrorCode.TOO_LARGE:
        return AllocationError(detail)
    if reply.code is ErrorCode.VERSION:
        return VersionMismatch(detail)
    if reply.code is ErrorCode.DROPPED:
        return RequestDropped(detail, "dropped")
    return PeerError(reply.code.value, detail)


def bind_router(
    context: zmq.Context, host: str, port: int, gate: Gatekeeper | None, door: Door
) -> zmq.Socket:
    """A ROUTER socket bound to ``host:port``, with ``gate`` (on ``context``) answering only the
    peers of this deployment that ``door`` admits (``gatekeeper.py``); ``ConfigError`` if the
    address cannot be bound."""
    socket = context.socket(zmq.ROUTER)
    socket.setsockopt(zmq.LINGER, 0)
    if gate is not None:
        gate.serve(socket, door)
    # zmq drops a peer that sends a larger frame before we would allocate for it.
    socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
    # Past this many whole messages queued from one peer, zmq stops reading from it.
    socket.setsockopt(zmq.RCVHWM, protocol.MAX_QUEUED_MESSAGES)
    try:
        socket.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as exc:
        socket.close()
        raise ConfigError(f"cannot bind {host}:{port}: {exc}") from exc
    return socket


def refusal(
    code: ErrorCode, detail: str, req_id: str = "", retry_after_s: float = 0.0
) -> ErrorReply:
    """The ErrorReply a consumer sends instead of an answer, cut to the protocol's limits."""
    return ErrorReply(
        version=protocol.PROTOCOL_VERSION,
        code=code,
        detail=detail[: protocol.MAX_ERROR_DETAIL_CHARS],
        req_id=req_id[: protocol.MAX_REQ_ID_CHARS],
        retry_after_s=retry_after_s,
    )
