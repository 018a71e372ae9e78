"""Drain and restarts with real vLLM: SIGTERM to an instance's API server drains it (its stream
ends whole, /health says draining, a new request is refused, then it exits); ``lmcache-pd
restart`` rolls one while it streams. An instance killed under ``serve``'s supervisor is started
again on its ports in the fleet benchmark's short run (``tests/test_fleet_bench.py``). The parts
without vLLM: ``tests/test_drain.py``."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from lmcache_pd.cli.serving import supervised
from lmcache_pd.deploy.launcher import PoolLauncher
from lmcache_pd.deploy.pools import load_pools
from lmcache_pd.deploy.vllm_server import VLLMServer
from tests.helpers import free_port, wait_for

pytestmark = pytest.mark.vllm

CONFIGS = Path(__file__).parent.parent / "configs"
DRAIN_TIMEOUT_S = 30.0
# Long enough to be mid-stream when the signal comes: ~300 tokens/s here.
STREAM_TOKENS = 2000


class Stream:
    """A greedy completion of ``STREAM_TOKENS`` tokens streamed from ``server`` on a thread."""

    def __init__(self, server: VLLMServer, model: str) -> None:
        self.events: list[str] = []
        self.status: int | None = None
        self.error: BaseException | None = None
        self._body = {
            "model": model,
            "prompt": [1, 2, 3, 4],
            "max_tokens": STREAM_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "return_token_ids": True,  # an event may hold several tokens (a lagging reader)
        }
        self._server = server
        self._thread = threading.Thread(target=self._read)
        self._thread.start()
        wait_for(lambda: len(self.events) > 10, timeout_s=60, what="the stream's first tokens")

    def _read(self) -> None:
        url = f"{self._server.url}/v1/completions"
        try:
            with httpx.stream(
                "POST", url, json=self._body, headers=self._server.headers, timeout=60
            ) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line.removeprefix("data: "))
        except httpx.HTTPError as exc:
            self.error = exc

    def whole(self, timeout_s: float) -> bool:
        """Whether it ended with every token and ``[DONE]``."""
        self._thread.join(timeout_s)
        tokens = sum(
            len(json.loads(event)["choices"][0]["token_ids"] or [])
            for event in self.events
            if event != "[DONE]"
        )
        return (
            self.error is None
            and self.status == 200
            and self.events[-1:] == ["[DONE]"]
            and tokens == STREAM_TOKENS
        )


def health(url: str) -> tuple[int, str] | None:
    try:
        response = httpx.get(f"{url}/health", timeout=5)
    except httpx.HTTPError:
        return None
    return response.status_code, response.text


@pytest.mark.timeout(240)
def test_sigterm_drains_an_instance_then_it_exits(model: Path, tmp_path: Path) -> None:
    server = VLLMServer(
        model, free_port(), tmp_path / "vllm.log", api_key="k" * 40, drain_timeout_s=DRAIN_TIMEOUT_S
    )
    with server:
        stream = Stream(server, str(model))
        signalled = time.monotonic()
        server.terminate()  # the API server alone, as Kubernetes sends it
        wait_for(lambda: (health(server.url) or (0,))[0] == 503, timeout_s=5, what="draining")
        answer = health(server.url)
        assert answer is not None and '"status": "draining"' in answer[1]
        refused = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": str(model), "prompt": [1, 2], "max_tokens": 2},
            headers=server.headers,
            timeout=10,
        )
        assert refused.status_code == 503 and "draining" in refused.text
        assert stream.whole(timeout_s=DRAIN_TIMEOUT_S), (stream.status, stream.events[-2:])
        assert server.wait_exit(DRAIN_TIMEOUT_S), "still running after its drain"
        assert server.returncode == 0
        exited_s = time.monotonic() - signalled
    assert exited_s < DRAIN_TIMEOUT_S  # it left when its stream was done, not at the deadline


@pytest.fixture(scope="module")
def served(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolLauncher]:
    """``configs/pools.yaml`` as ``serve`` runs it: supervised, with its control socket."""
    pools = msgspec.structs.replace(
        load_pools(CONFIGS / "pools.yaml"), model=str(model), drain_timeout_s=DRAIN_TIMEOUT_S
    )
    workdir = tmp_path_factory.mktemp("served")
    with PoolLauncher(pools, workdir) as launcher:
        launcher.start()
        with supervised(launcher, workdir):
            yield launcher


def restart(workdir: Path, target: str) -> subprocess.CompletedProcess[str]:
    """``lmcache-pd restart TARGET --workdir WORKDIR``."""
    command = [sys.executable, "-m", "lmcache_pd.cli", "restart", target, "--workdir", str(workdir)]
    return subprocess.run(command, capture_output=True, text=True, timeout=240)


def complete(server: VLLMServer, model: str) -> dict[str, Any]:
    return server.complete({"model": model, "prompt": [5, 6, 7], "max_tokens": 4}, timeout_s=60)


@pytest.mark.timeout(300)
def test_restart_rolls_an_instance_while_it_streams(served: PoolLauncher) -> None:
    before = served.servers["decode-0"]
    stream = Stream(before, served.pools.model)
    rolled = restart(served.workdir, "decode-0")
    assert rolled.returncode == 0, rolled.stderr
    assert "decode-0: draining" in rolled.stdout and "decode-0: serving again" in rolled.stdout
    assert stream.whole(timeout_s=10), (stream.status, stream.events[-2:])
    again = served.servers["decode-0"]
    assert again is not before and again.url == before.url
    assert complete(again, served.pools.model)["choices"][0]["text"]
    unknown = restart(served.workdir, "decode-7")
    assert unknown.returncode == 1 and "no pool or instance named 'decode-7'" in unknown.stderr
