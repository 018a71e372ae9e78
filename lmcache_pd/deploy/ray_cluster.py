"""Joining a Ray cluster as a driver (``serve``, ``scale``), and whether the cluster asks for
Ray's token, told by asking its GCS.

A Ray cluster runs whatever code any process that reaches its ports sends it, unless its nodes
were started with Ray's token auth (``RAY_AUTH_MODE=token`` and the token in ``RAY_AUTH_TOKEN``
or a file, Ray 2.52 and later): then every call to its GCS, raylets and dashboard must carry
the token. A driver joins with the token its environment holds. Ray gives a driver no call that
says which kind of cluster it joined, and joining proves nothing: a driver with a token joins an
open cluster as well (the token is not looked at). So we ask the GCS ourselves, once, carrying
no token: the call every client makes first (``GetClusterId``) refused as unauthenticated means
the cluster asks for its token; answered, it asks nobody, and ``connect`` warns.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import grpc
import ray

from lmcache_pd.errors import ConfigError

logger = logging.getLogger(__name__)

AUTH_MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_MODE = "token"
# One unauthenticated call to a GCS.
PROBE_TIMEOUT_S = 5.0


def connect(address: str, namespace: str) -> None:
    """Join the Ray cluster at ``address`` as a driver in ``namespace``, with Ray's token if the
    environment holds one; warn if the cluster asks for none (``warn_if_open``). ``ConfigError``
    with the reason when there is no cluster to join, or one that asks for a token this process
    lacks."""
    client = address.startswith("ray://")  # Ray Client: a proxy in front of the GCS
    named = address != "auto" and not client
    # Ray itself retries a refused token for a minute before it says "failed to connect".
    if named and not driver_has_token() and asks_for_token(address):
        raise ConfigError(_token_refused(address, "this process has none"))
    try:
        ray.init(
            address=address,
            namespace=namespace,
            log_to_driver=True,
            logging_level=logging.WARNING,
        )
    except ConnectionError as exc:
        if named and asks_for_token(address):
            raise ConfigError(_token_refused(address, "it refused this process's")) from exc
        raise ConfigError(f"no Ray cluster at {address!r}: {exc}") from exc
    warn_if_open(None if client else ray.get_runtime_context().gcs_address, address)


def _token_refused(address: str, why: str) -> str:
    return (
        f"the Ray cluster at {address!r} asks for Ray's token and {why}: set "
        f"{AUTH_MODE_ENV}={TOKEN_MODE} and {TOKEN_ENV} (or RAY_AUTH_TOKEN_PATH) to the cluster's"
    )


def asks_for_token(gcs_address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether the GCS at ``gcs_address`` (HOST:PORT) refuses a call without Ray's token: True
    if it does, False if it answers one, None if it cannot be told (unreachable, TLS, not a
    GCS)."""
    try:
        from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc
    except ImportError:  # Ray moved its generated stubs: say nothing rather than guess
        return None
    with grpc.insecure_channel(gcs_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)
        try:
            stub.GetClusterId(gcs_service_pb2.GetClusterIdRequest(), timeout=timeout_s)
        except grpc.RpcError as exc:
            return True if exc.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return False


def driver_has_token(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process joins with Ray's token (``RAY_AUTH_MODE=token``): for a cluster at a
    named address, Ray turns token auth on from this variable alone."""
    environ = os.environ if environ is None else environ
    return environ.get(AUTH_MODE_ENV, "").lower() == TOKEN_MODE


def warn_if_open(
    gcs_address: str | None, address: str, environ: Mapping[str, str] | None = None
) -> bool:
    """Log loudly when the cluster joined at ``address`` answers callers without Ray's token
    (asked at ``gcs_address``; None: it cannot be asked), or, where that cannot be told, when
    this driver has no token either; True if it warned."""
    asks = None if gcs_address is None else asks_for_token(gcs_address)
    if asks or (asks is None and driver_has_token(environ)):
        return False
    if asks is None:
        logger.warning(
            "SECURITY: cannot tell whether the Ray cluster at %s asks for Ray's token, and this "
            "driver joined without one (%s is not %r): if its nodes were started without token "
            "auth, any process that reaches its ports can run code on them.",
            address,
            AUTH_MODE_ENV,
            TOKEN_MODE,
        )
    else:
        logger.warning(
            "SECURITY: the Ray cluster at %s runs without Ray's token auth: any process that "
            "reaches its ports can run code on its nodes, this deployment's instances and "
            "secrets included. Start every node, and this driver, with %s=%s and the same %s "
            "(docs/architecture.md, Deploying: Ray).",
            address if address == gcs_address else f"{address} (GCS {gcs_address})",
            AUTH_MODE_ENV,
            TOKEN_MODE,
            TOKEN_ENV,
        )
    return True
