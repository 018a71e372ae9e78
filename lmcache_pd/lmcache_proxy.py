"""LMCache's proxy protocol, prefill's side: a ``ProxyNotif`` per decode rank once that rank's
KV has landed, which LMCache's own proxy (``examples/disagg_prefill/disagg_proxy_server.py``)
waits for before it sends decode the prompt and first token.

Written from the protocol, nothing of theirs copied. Their proxy binds a ZMQ PULL socket
(``--proxy-host``/``--proxy-port``, which the sender's configuration names as
``pd_proxy_host``/``pd_proxy_port``) and decodes each message with msgspec into a union of
structs tagged by their class names under msgspec's default tag field, ``type``. So a notice is
the msgpack map ``{"type": "ProxyNotif", "req_id": REQ_ID}`` for today's PD backend; the xpyd
era's proxies (``nixl_proxy_host``/``nixl_proxy_port``) decode the same map tagged
``"NixlProxyNotif"``. ``req_id`` is the request's ``disagg_spec.req_id``; their proxy counts
notices per request and asks decode once it has one per decode rank (the length of the spec's
``receiver_init_port``), so each producer rank sends one for the decode rank it pushes to.

Unlike our messages (``protocol.py``) it carries no ``version``: its form is fixed by proxies
already deployed. And their proxy speaks plain ZMQ, never CURVE: with a deployment secret every
socket of ours is authenticated and encrypted, this one cannot be. It carries request ids only;
a warning at start says so (``ProxyNotifier``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal

import msgspec
import zmq

from lmcache_pd.errors import ConfigError

logger = logging.getLogger(__name__)

Tag = Literal["ProxyNotif", "NixlProxyNotif"]
# Notices ZMQ queues for a proxy not (yet) connected before more are dropped (each a request
# whose client waits: more than a burst of them means the proxy is gone).
NOTICE_QUEUE = 1024
# At close, queued notices get this long to go out.
CLOSE_LINGER_MS = 1000


class ProxyNotif(msgspec.Struct, frozen=True, tag_field="type", tag="ProxyNotif"):
    """Today's PD backend's notice: ``{"type": "ProxyNotif", "req_id": ...}``."""

    req_id: str


class NixlProxyNotif(msgspec.Struct, frozen=True, tag_field="type", tag="NixlProxyNotif"):
    """The xpyd era's notice: ``{"type": "NixlProxyNotif", "req_id": ...}``."""

    req_id: str


_MESSAGES: dict[str, type[ProxyNotif] | type[NixlProxyNotif]] = {
    "ProxyNotif": ProxyNotif,
    "NixlProxyNotif": NixlProxyNotif,
}
_encode = msgspec.msgpack.Encoder().encode


def encode_notice(req_id: str, tag: Tag = "ProxyNotif") -> bytes:
    """The bytes of one notice for ``req_id``, as a proxy of ``tag``'s generation decodes it."""
    return _encode(_MESSAGES[tag](req_id))


def proxy_address(host: str, port: int) -> str:
    """ZMQ's address of LMCache's proxy (an IPv6 address bracketed)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class ProxyNotifier:
    """A producer rank's PUSH socket to LMCache's proxy.

    ``send`` may be called from any thread (each consumer rank's sender thread calls it once the
    request's pushes to that rank are done) and never blocks: a notice ZMQ cannot queue is
    dropped, logged and counted (``proxy_notices_dropped``). Close it after the senders."""

    def __init__(
        self,
        host: str,
        port: int,
        tag: Tag,
        *,
        count: Callable[[str], None],
        secret: bool,
    ) -> None:
        """``count`` takes a counter's name (``StatsRecorder.add``); ``secret``: whether the
        deployment has one (its other sockets are then CURVE, this one is not). Raises
        ``ConfigError`` if ZMQ refuses the address."""
        self.address = proxy_address(host, port)
        self._tag: Tag = tag
        self._count = count
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._socket: zmq.Socket | None = self._context.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.SNDHWM, NOTICE_QUEUE)
        self._socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)
        if ":" in host:
            self._socket.setsockopt(zmq.IPV6, 1)
        try:
            self._socket.connect(self.address)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError(f"LMCache's proxy at {self.address}: {exc}") from exc
        if secret:
            logger.warning(
                "SECURITY: LMCache's proxy speaks plain ZMQ: the ProxyNotif messages (request "
                "ids only) go to %s unauthenticated and unencrypted, while every other socket "
                "of this deployment is CURVE; anyone who can reach that port can also send it "
                "notices",
                self.address,
            )
        logger.info("a %s per decode rank goes to LMCache's proxy at %s", tag, self.address)

    def send(self, req_id: str) -> bool:
        """Queue the notice for ``req_id``; False (logged, counted) if it cannot go."""
        with self._lock:
            if self._socket is None:
                return False
            try:
                self._socket.send(encode_notice(req_id, self._tag), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                self._count("proxy_notices_dropped")
                logger.warning(
                    "req %s: ProxyNotif to %s not sent (%s): LMCache's proxy does not read "
                    "its notices",
                    req_id,
                    self.address,
                    exc,
                )
                return False
        self._count("proxy_notices")
        logger.debug("req %s: ProxyNotif sent to %s", req_id, self.address)
        return True

    def close(self) -> None:
        """Idempotent; queued notices get ``CLOSE_LINGER_MS`` to go out."""
        with self._lock:
            if self._socket is not None:
                self._socket.close()
                self._socket = None
            if not self._context.closed:
                self._context.term()
