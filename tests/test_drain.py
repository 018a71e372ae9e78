"""Drain and restarts without vLLM: the guard's drain on SIGTERM (``instance_drain.py``), the
supervisor's restarts of dead instances (``supervisor.py``) and the control socket that
``lmcache-pd restart`` talks to (``control.py``). The same with real vLLM:
``tests/test_drain_vllm.py``."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from lmcache_pd.deploy import instance_drain
from lmcache_pd.deploy.control import ControlError, ControlServer, request_restart, socket_path
from lmcache_pd.deploy.instance_guard import InstanceKeyGuard
from lmcache_pd.deploy.supervisor import RestartPolicy, RollError, Supervisor
from lmcache_pd.errors import PDError
from tests.helpers import wait_for

Sent = list[dict[str, Any]]


async def call(guard: InstanceKeyGuard, path: str, method: str = "POST") -> Sent:
    """What ``guard`` sends for one request (the app behind it answers 200)."""
    sent: Sent = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}"}

    scope = {"type": "http", "method": method, "path": path, "headers": []}
    await guard(scope, receive, send)
    return sent


async def answer_ok(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})


@pytest.fixture
def relays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The signals the drain hands to vLLM, recorded instead of raised."""
    raised: list[int] = []
    monkeypatch.setattr(instance_drain.signal, "raise_signal", raised.append)
    return raised


def test_a_draining_instance_says_so_on_health_and_refuses_new_requests(
    relays: list[int],
) -> None:
    async def scenario() -> tuple[Sent, Sent, Sent, Sent]:
        guard = InstanceKeyGuard(answer_ok)
        before = await call(guard, "/health", "GET")
        guard.drain.begin()
        health = await call(guard, "/health", "GET")
        new = await call(guard, "/v1/completions")
        metrics = await call(guard, "/metrics", "GET")
        await asyncio.sleep(0.05)  # the drain task: nothing in flight, so vLLM is told at once
        return before, health, new, metrics

    before, health, new, metrics = asyncio.run(scenario())
    assert before[0]["status"] == 200  # control: not draining
    assert health[0]["status"] == 503
    assert json.loads(health[1]["body"]) == {"status": "draining", "in_flight": 0}
    assert new[0]["status"] == 503 and b"draining" in new[1]["body"]
    assert metrics[0]["status"] == 200  # its counters stay readable
    assert relays == [signal.SIGINT]


@pytest.mark.parametrize("finishes", [True, False], ids=["finishes", "outlives-the-drain"])
def test_vllm_is_told_to_stop_once_the_running_request_ends_or_the_drain_times_out(
    relays: list[int], finishes: bool
) -> None:
    """A request admitted before SIGTERM holds vLLM's shutdown until it has its answer, or
    until ``timeout_s``."""

    async def scenario() -> tuple[list[int], list[int], Sent]:
        done = asyncio.Event()

        async def slow(scope: Any, receive: Any, send: Any) -> None:
            await done.wait()
            await answer_ok(scope, receive, send)

        guard = InstanceKeyGuard(slow)
        guard.drain.timeout_s = 0.5 if not finishes else 30.0
        running = asyncio.create_task(call(guard, "/v1/completions"))
        await asyncio.sleep(0.01)
        guard.drain.begin()
        await asyncio.sleep(0.1)
        while_running = list(relays)
        if finishes:
            done.set()
        else:
            await asyncio.sleep(0.6)
        await asyncio.sleep(0.05)
        after = list(relays)
        done.set()
        return while_running, after, await running

    while_running, after, answered = asyncio.run(scenario())
    assert while_running == []
    assert after == [signal.SIGINT]
    assert answered[0]["status"] == 200  # the admitted request was served, not refused


class FakeServer:
    def __init__(self, log_path: Path) -> None:
        self.running = True
        self.returncode: int | None = None
        self.log_path = log_path

    def tail(self, lines: int = 40) -> str:
        return "the last line of its log"


class FakeLauncher:
    """Instances whose restart fails ``failing`` times, then brings them back."""

    def __init__(self, tmp_path: Path, failing: int = 0) -> None:
        self.servers = {
            "prefill-0": FakeServer(tmp_path / "p.log"),
            "decode-0": FakeServer(tmp_path / "d.log"),
        }
        self.restarted: list[tuple[str, bool]] = []
        self._failing = failing

    def restart(self, name: str, *, drain: bool = False) -> float:
        self.restarted.append((name, drain))
        if self._failing > 0:
            self._failing -= 1
            raise PDError(f"{name} did not restart")
        self.servers[name].running = True
        return 0.1


FAST = RestartPolicy(first_backoff_s=0.05, max_backoff_s=0.2, max_restarts=3, watch_interval_s=0.01)


def test_an_instance_that_died_unasked_is_started_again(tmp_path: Path) -> None:
    launcher = FakeLauncher(tmp_path)
    supervisor = Supervisor(launcher, FAST)  # type: ignore[arg-type]
    supervisor.start()
    try:
        wait_for(lambda: supervisor.restarts == {}, what="an idle first look")
        launcher.servers["decode-0"].running = False
        launcher.servers["decode-0"].returncode = -9
        wait_for(lambda: launcher.restarted == [("decode-0", False)], what="its restart")
        assert launcher.servers["decode-0"].running and supervisor.restarts == {"decode-0": 1}
        assert counted(supervisor, "decode-0", "died") == 1.0
    finally:
        supervisor.close()


def counted(supervisor: Supervisor, instance: str, cause: str) -> float | None:
    """The supervisor's restarts as the proxy's ``/metrics`` shows them."""
    registry = CollectorRegistry()
    registry.register(supervisor.collector())
    labels = {"instance": instance, "cause": cause}
    return registry.get_sample_value("lmcache_pd_instance_restarts_total", labels)


def test_an_instance_that_keeps_dying_is_left_down_with_its_log(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Each failed restart counts; the backoff doubles; after ``max_restarts`` the instance is
    left down, and the log line names it and ends with its log."""
    launcher = FakeLauncher(tmp_path, failing=10)
    supervisor = Supervisor(launcher, FAST)  # type: ignore[arg-type]
    launcher.servers["prefill-0"].running = False
    with caplog.at_level(logging.INFO, logger="lmcache_pd.deploy.supervisor"):
        supervisor.start()
        try:
            wait_for(lambda: "left down" in caplog.text, timeout_s=10, what="giving up")
        finally:
            supervisor.close()
    assert launcher.restarted == [("prefill-0", False)] * FAST.max_restarts
    assert counted(supervisor, "prefill-0", "died") == FAST.max_restarts
    registry = CollectorRegistry()
    registry.register(supervisor.collector())
    assert registry.get_sample_value("lmcache_pd_instances_left_down") == 1.0
    given_up = next(r for r in caplog.records if "left down" in r.getMessage())
    assert "prefill-0" in given_up.getMessage()
    assert "the last line of its log" in given_up.getMessage()
    assert [FAST.backoff_s(n) for n in range(4)] == [0.05, 0.1, 0.2, 0.2]


def test_a_roll_drains_and_restarts_one_instance_at_a_time(tmp_path: Path) -> None:
    launcher = FakeLauncher(tmp_path)
    supervisor = Supervisor(launcher, FAST)  # type: ignore[arg-type]
    supervisor.start()
    lines: list[str] = []
    try:
        supervisor.roll(supervisor.names(None), lines.append, timeout_s=10)
        assert supervisor.names("decode") == ["decode-0"]
        with pytest.raises(RollError, match="no pool or instance named 'decode-7'"):
            supervisor.names("decode-7")
    finally:
        supervisor.close()
    assert launcher.restarted == [("prefill-0", True), ("decode-0", True)]
    assert counted(supervisor, "decode-0", "rolled") == 1.0
    assert counted(supervisor, "decode-0", "died") is None
    assert lines[0] == "prefill-0: draining" and lines[-1].startswith("decode-0: serving again")


def test_restart_talks_to_serve_over_its_control_socket(tmp_path: Path) -> None:
    asked: list[str | None] = []

    def handler(target: str | None, report: Any) -> None:
        asked.append(target)
        report(f"{target}: draining")
        if target == "decode-9":
            raise RollError("no pool or instance named 'decode-9'")

    server = ControlServer(tmp_path, handler)
    try:
        assert socket_path(tmp_path).stat().st_mode & 0o777 == 0o600
        assert socket_path(tmp_path).parent.stat().st_mode & 0o777 == 0o700
        assert list(request_restart(tmp_path, "decode", timeout_s=10)) == ["decode: draining"]
        with pytest.raises(ControlError, match="decode-9"):
            list(request_restart(tmp_path, "decode-9", timeout_s=10))
    finally:
        server.close()
    assert asked == ["decode", "decode-9"]
    with pytest.raises(ControlError, match="no lmcache-pd serve is running"):
        list(request_restart(tmp_path, None, timeout_s=10))


def test_a_request_that_never_ends_its_line_is_dropped_not_waited_on(tmp_path: Path) -> None:
    server = ControlServer(tmp_path, lambda target, report: None)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(10)
            client.connect(str(socket_path(tmp_path)))
            client.sendall(b"x" * 5000)  # past MAX_REQUEST_BYTES, no newline
            assert b"bad request" in client.recv(4096)
        assert list(request_restart(tmp_path, None, timeout_s=10)) == []  # still answering
    finally:
        server.close()
    assert all(thread.name != "serve-control" for thread in threading.enumerate())
