"""How ``serve`` tells whether the Ray cluster it joins asks for Ray's token
(``lmcache_pd/deploy/ray_cluster.py``), against a stand-in GCS: a real gRPC server in this
process answering Ray's own ``GetClusterId`` as a GCS does, with token auth (a call without the
token refused as UNAUTHENTICATED) or without. The real cluster with token auth:
tests/test_ray_cluster.py."""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

grpc = pytest.importorskip("grpc")
ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")

from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc  # noqa: E402

from lmcache_pd.deploy.ray_cluster import (  # noqa: E402
    asks_for_token,
    connect,
    warn_if_open,
)
from lmcache_pd.errors import ConfigError  # noqa: E402

TOKEN = "0123456789abcdef0123456789abcdef"
WITH_TOKEN = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}


class StandInGcs(gcs_service_pb2_grpc.NodeInfoGcsServiceServicer):
    """Answers ``GetClusterId``; with a ``token``, only to callers that send it (``Authorization:
    Bearer TOKEN``, as Ray's clients do)."""

    def __init__(self, token: str | None) -> None:
        self.token = token
        self.calls = 0

    def GetClusterId(
        self, request: gcs_service_pb2.GetClusterIdRequest, context: grpc.ServicerContext
    ) -> gcs_service_pb2.GetClusterIdReply:
        self.calls += 1
        sent = dict(context.invocation_metadata()).get("authorization")
        if self.token is not None and sent != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken")
        return gcs_service_pb2.GetClusterIdReply()


@contextlib.contextmanager
def stand_in_gcs(token: str | None) -> Iterator[tuple[str, StandInGcs]]:
    servicer = StandInGcs(token)
    server = grpc.server(ThreadPoolExecutor(2))
    gcs_service_pb2_grpc.add_NodeInfoGcsServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        server.stop(0).wait(5)


def closed_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


def test_a_gcs_that_asks_for_the_token_is_told_from_one_that_does_not() -> None:
    with stand_in_gcs(TOKEN) as (guarded, servicer):
        assert asks_for_token(guarded) is True
        assert servicer.calls == 1
    with stand_in_gcs(None) as (open_gcs, _):
        assert asks_for_token(open_gcs) is False
    assert asks_for_token(closed_port(), timeout_s=1.0) is None


def test_joining_a_cluster_without_token_auth_warns(caplog: pytest.LogCaptureFixture) -> None:
    """Even a driver that has a token warns: the open cluster took it without looking."""
    with stand_in_gcs(None) as (address, _), caplog.at_level(logging.WARNING):
        assert warn_if_open(address, address, WITH_TOKEN)
    [record] = caplog.records
    assert f"the Ray cluster at {address} runs without Ray's token auth" in record.message
    assert "RAY_AUTH_MODE=token" in record.message


def test_joining_a_cluster_with_token_auth_is_quiet(caplog: pytest.LogCaptureFixture) -> None:
    """The control: the same call against a GCS that asks for the token."""
    with stand_in_gcs(TOKEN) as (address, _), caplog.at_level(logging.WARNING):
        assert not warn_if_open(address, address, WITH_TOKEN)
    assert caplog.records == []


def test_a_cluster_that_cannot_be_asked_warns_only_a_driver_without_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        assert not warn_if_open(None, "ray://head:10001", WITH_TOKEN)
        assert caplog.records == []
        assert warn_if_open(None, "ray://head:10001", {})
    [record] = caplog.records
    assert "cannot tell whether the Ray cluster at ray://head:10001" in record.message


def test_a_driver_without_the_token_is_refused_at_once_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray would retry a refused token for a minute before saying only "failed to connect"."""
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    with stand_in_gcs(TOKEN) as (address, _):
        began = time.monotonic()
        with pytest.raises(ConfigError, match=r"asks for Ray's token and this process has none"):
            connect(address, "lmpd-test")
    assert time.monotonic() - began < 10
    assert not ray.is_initialized()
