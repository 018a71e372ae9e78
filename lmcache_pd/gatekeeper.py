"""The ZAP handler of our CURVE servers: each door admits only the client keys of its roles.

Without a ZAP handler, libzmq lets in any client that knows a CURVE server's public key, so that
key would be the only credential and every process holding it could knock on every door. A
``Gatekeeper`` runs pyzmq's authenticator (``zmq.auth``, a thread of its own) on one ZMQ
context: a client whose key is not one of the roles ``auth.ADMITS`` lists for the socket's door
is refused during the handshake, before any of its messages exist, and counted. An admitted
client's messages carry its role as their ZAP User-Id (``sender_role``), so that a door two roles
share can tell what each may say (the consumer's alloc port: ``transfer/consumer.py``).

Every serving socket sets ``ZAP_ENFORCE_DOMAIN``: should the handler be gone, a client is
refused rather than let in unchecked.
"""

from __future__ import annotations

import contextlib
import logging

import zmq
import zmq.auth.thread
import zmq.utils.z85

from lmcache_pd.auth import ADMITS, DeploymentKeys, Door, Role

logger = logging.getLogger(__name__)

# ZAP's name for the property an admitted peer's messages carry.
USER_ID = "User-Id"


class _Admission:
    """pyzmq's credentials provider for one door: admits the client keys of its roles."""

    def __init__(self, door: Door, roles: dict[bytes, Role], refused: _Refusals) -> None:
        self._door = door
        self._roles = roles
        self._refused = refused

    def callback(self, _domain: str, client_key: bytes) -> bool:
        role = self._roles.get(client_key)
        if role is not None and role in ADMITS[self._door]:
            return True
        self._refused.count(self._door, role)
        return False


class _Refusals:
    """Refused handshakes, counted and logged: the first, then at powers of two (a flood of
    them must not flood the log). The authenticator's thread is the only writer."""

    def __init__(self) -> None:
        self.total = 0

    def count(self, door: Door, role: Role | None) -> None:
        self.total += 1
        if self.total & (self.total - 1) == 0:
            logger.warning(
                "refused a CURVE client on the %s door: %s (%d refused so far)",
                door.value,
                "a key of no role of this deployment"
                if role is None
                else f"a {role.value}'s key, which this door does not admit",
                self.total,
            )


class _Authenticator(zmq.auth.thread.ThreadAuthenticator):
    """pyzmq's thread authenticator, telling each admitted peer's role as its User-Id."""

    def __init__(self, context: zmq.Context, roles: dict[bytes, Role]) -> None:
        super().__init__(context, log=logging.getLogger(f"{__name__}.zap"))
        self._roles = roles

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._roles[zmq.utils.z85.encode(client_public_key)].value


class Gatekeeper:
    """The ZAP handler of one ZMQ context, for the doors ``keys``' role serves. Make it before
    the sockets it guards (``serve`` each), close it after them and before the context ends;
    ``close`` is idempotent."""

    def __init__(self, context: zmq.Context, keys: DeploymentKeys) -> None:
        self._keys = keys
        self._refusals = _Refusals()
        roles = {public: role for role, public in keys.client_publics.items()}
        # A plain context on the same libzmq context: the authenticator's thread blocks on its
        # sockets, which an asyncio context's would not.
        self._auth: _Authenticator | None = _Authenticator(
            zmq.Context(shadow=context.underlying), roles
        )
        self._auth.start()
        for door in keys.server_secrets:
            self._auth.configure_curve_callback(door.value, _Admission(door, roles, self._refusals))

    @property
    def refused(self) -> int:
        """Handshakes refused since the start: keys of no admitted role."""
        return self._refusals.total

    def serve(self, socket: zmq.Socket, door: Door) -> None:
        """Make ``socket`` (before it binds) a CURVE server of ``door`` that only this
        gatekeeper's admissions get into."""
        self._keys.serve(socket, door)
        # Refuse, not admit, when no handler answers (a draft option in some libzmq builds).
        with contextlib.suppress(AttributeError, zmq.ZMQError):
            socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def close(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def __enter__(self) -> Gatekeeper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sender_role(frame: zmq.Frame) -> Role | None:
    """The role whose key sent ``frame`` (its ZAP User-Id); None where no gatekeeper admitted
    it (a socket without CURVE)."""
    try:
        return Role(frame.get(USER_ID))
    except (zmq.ZMQError, ValueError):
        return None


def gatekeeper(context: zmq.Context, keys: DeploymentKeys | None) -> Gatekeeper | None:
    """A gatekeeper for ``context`` where there are keys; None where there are none (no
    authentication)."""
    return None if keys is None else Gatekeeper(context, keys)
