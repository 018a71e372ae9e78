"""vLLM's KV event publisher, with sockets that answer only this deployment.

vLLM publishes its prefix cache's events (``--kv-events-config``) on a ZMQ PUB socket and
replays recent ones on a ROUTER socket, both open to anyone who can connect, and its config
names only its own publishers (``"zmq"``, ``"null"``). The proxy routes by these events, so a
stranger who could read them would learn what every tenant's prompts hold. This publisher is
vLLM's own, but its two sockets are CURVE servers under the deployment secret (``auth.py``), on
a ZMQ context of their own whose gatekeeper admits the proxy's key alone (``gatekeeper.py``),
and bind to exactly the address given (vLLM's would connect, not bind, to an address that names
a host). The connector's scheduler half installs it in its engine process, under vLLM's name
``"zmq"``, before vLLM's scheduler makes its publisher (vLLM makes the connector first).
"""

from __future__ import annotations

import functools
import logging

import zmq
from vllm.distributed.kv_events import EventPublisherFactory, ZmqEventPublisher

from lmcache_pd.auth import SECRET_ENV, DeploymentKeys, Door, is_loopback
from lmcache_pd.gatekeeper import Gatekeeper

logger = logging.getLogger(__name__)

# vLLM's name for its ZMQ publisher, the one its config accepts.
VLLM_PUBLISHER = "zmq"


class AuthenticatedEventPublisher(ZmqEventPublisher):
    """vLLM's ZMQ publisher whose PUB and replay sockets admit only deployment peers."""

    def __init__(self, *args: object, keys: DeploymentKeys | None, **kwargs: object) -> None:
        self._keys = keys  # read by _socket_setup, which vLLM's __init__ calls
        self._gate: Gatekeeper | None = None
        super().__init__(*args, **kwargs)

    def _socket_setup(self) -> None:
        if self._keys is not None:
            # A context of our own (vLLM's is the process's shared one): its ZAP handler then
            # judges these two sockets alone, and ends with them.
            self._ctx = zmq.Context()
            self._gate = Gatekeeper(self._ctx, self._keys)
        self._pub = self._serving_socket(zmq.PUB, self._endpoint)
        self._pub.set_hwm(self._hwm)
        if self._replay_endpoint is not None:
            self._replay = self._serving_socket(zmq.ROUTER, self._replay_endpoint)

    def _serving_socket(self, kind: int, endpoint: str) -> zmq.Socket:
        socket = self._ctx.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        if self._gate is not None:
            self._gate.serve(socket, Door.EVENTS)
        socket.bind(endpoint)
        return socket

    def shutdown(self) -> None:
        super().shutdown()  # closes both sockets
        if self._gate is not None:
            self._gate.close()
            self._gate = None
            if not self._thread.is_alive():  # else its sockets are left to the process's exit
                self._ctx.term()


def install(keys: DeploymentKeys | None, endpoints: tuple[str | None, ...] = ()) -> bool:
    """Make vLLM's ``"zmq"`` publisher this one, in this process (vLLM's registry is per
    process; each engine installs its own); True, with a loud warning, where it will publish
    without a secret on one of ``endpoints`` (its PUB and replay addresses) that another host
    can reach: every prompt's token ids then go to anyone who connects."""
    # register_publisher refuses a name it has; "zmq" is the only one its config accepts.
    registry = EventPublisherFactory._registry
    registry[VLLM_PUBLISHER] = functools.partial(AuthenticatedEventPublisher, keys=keys)
    open_to = [e for e in endpoints if e and not is_loopback(_host(e))] if keys is None else []
    if open_to:
        logger.warning(
            "SECURITY: KV events are published on %s with no deployment secret: anyone who "
            "connects reads the token ids of every prompt this instance caches. Set %s or "
            "secret_file (`lmcache-pd serve` makes one for its own pools).",
            ", ".join(open_to),
            SECRET_ENV,
        )
    else:
        logger.info(
            "kv events published by CURVE sockets" if keys else "kv events published on loopback"
        )
    return bool(open_to)


def _host(endpoint: str) -> str:
    """The host of a ZMQ "tcp://host:port" endpoint (other transports: their whole address)."""
    address = endpoint.removeprefix("tcp://").rsplit(":", 1)[0]
    return address.strip("[]")
