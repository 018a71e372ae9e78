"""``engine: ray`` on a real two-node Ray cluster whose nodes are two network stacks: the head in
one network namespace (prefill's node, and the driver: ``lmcache-pd serve`` and its proxy), a
worker node in another (decode's), joined by a veth pair, so the KV crosses it as between hosts.

The cluster runs with Ray's token auth (``RAY_AUTH_MODE=token``, the token in each node's and
each driver's environment): a caller without it is refused, and ``serve`` does not warn.

Shown, through the proxy with the official ``openai`` client: answers equal to one plain vLLM's
(tokens, logprobs within the end-to-end tolerance) with decode's counters showing the prompt
loaded, not computed, and prefill's that it pushed over UCX's transport for remote peers, with no
fallback and no failed push; the deployment secret in every vLLM's environment (decode's KV ports
authenticated) and on no command line nor in any log; decode's vLLM SIGKILLed as a second decode
instance is added by ``lmcache-pd scale``, Ray restarting the first on new ports while the second
starts, and requests succeeding again through the same proxy on both; the second removed again
after draining the stream it was serving. Everything started is stopped by process group. Needs
root (network namespaces) and Ray; skipped otherwise.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from lmcache_pd.auth import SECRET_ENV, DeploymentKeys, Role
from lmcache_pd.deploy.ray_cluster import asks_for_token
from lmcache_pd.harness import netns
from lmcache_pd.metrics_scrape import decode_sources, scrape
from tests.vllm_support import SERVER_ARGS, PlainVLLM, assert_close_answer, body, prompt

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
openai = pytest.importorskip("openai")

logger = logging.getLogger(__name__)
ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(netns.unavailable() is not None, reason=f"{netns.unavailable()}"),
]
GCS_PORT = 6379  # free in the head's fresh namespace
PROXY_PORT = 8000
NAMESPACE = "lmpd-test"
OUTPUT_TOKENS = 6
PROMPTS = {f"len-{n}": prompt(n, 900 + n) for n in (300, 1000, 2600)}
# Prompts no instance holds when they come (the proxy routes by KV): spread by load, each loads.
# Seeds of their own: ``prompt(300, 1900)`` is the first 300 tokens of ``len-1000``.
FRESH = {f"fresh-{i}": prompt(300, 4900 + i) for i in range(2)}
SERVE_TIMEOUT_S = 600.0
RECOVERY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
# A Ray node stops itself on SIGTERM in ~30 s here; what is ours on it is stopped already.
NODE_GRACE_S = 5.0
REFUSED_RETRY_S = 30.0
# Every node and every driver (serve, scale) of the cluster: Ray's token auth, one token.
RAY_TOKEN_ENV = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


@contextlib.contextmanager
def started(command: list[str], log: Path, grace_s: float = STOP_TIMEOUT_S) -> Iterator[int]:
    """``command`` in a session of its own (pid = process group id), stopped by group on exit:
    SIGTERM, then SIGKILL for what is left after ``grace_s``."""
    with open(log, "w") as out:
        process = subprocess.Popen(
            command,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **RAY_TOKEN_ENV},
        )
    try:
        yield process.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(STOP_TIMEOUT_S)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(STOP_TIMEOUT_S)


def ray_start(side: netns.Side, *args: str) -> list[str]:
    return [
        *side.wrap,
        str(BIN / "ray"),
        "start",
        "--block",
        f"--node-ip-address={side.address}",
        "--num-cpus=2",
        "--object-store-memory=80000000",
        "--disable-usage-stats",
        *args,
    ]


def processes_in(side: netns.Side) -> list[tuple[int, str]]:
    """(pid, command line) of every process in ``side``'s network namespace."""
    target = os.stat(f"{netns.NETNS_DIR}/{side.netns}").st_ino
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.stat(entry / "ns" / "net").st_ino != target:
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # gone meanwhile
            continue
        found.append((int(entry.name), command))
    return found


def vllm_servers(side: netns.Side) -> dict[int, int]:
    """HTTP port -> pid of every vLLM API server in ``side``'s namespace."""
    servers = {}
    for pid, command in processes_in(side):
        if "vllm.entrypoints.openai.api_server" in command:
            servers[int(re.search(r"--port (\d+)", command).group(1))] = pid
    return servers


class Cluster:
    """The two nodes, the driver's proxy, and calls made from the head's namespace."""

    def __init__(self, pair: netns.VethPair, model: Path, workdir: Path) -> None:
        self.pair, self.model, self.workdir = pair, model, workdir
        self.head, self.worker = pair.left, pair.right
        self.proxy = f"http://{self.head.address}:{PROXY_PORT}"
        self.address = f"{self.head.address}:{GCS_PORT}"
        self.refused = 0

    def at_head(self, function: Callable[[], Any], timeout_s: float = 180.0) -> Any:
        return self.head.call(function, timeout_s)

    def decode_urls(self) -> list[str]:
        """Decode instances the proxy routes to now (its per-instance gauge)."""
        text = self.at_head(lambda: httpx.get(f"{self.proxy}/metrics", timeout=5).text, 10)
        return sorted(
            re.findall(r'lmcache_pd_proxy_instance_up\{instance="([^"]+)",role="decode"\}', text)
        )

    def complete(self, tokens: list[int]) -> tuple[list[str], list[float]]:
        """One answer through the proxy. A 503 (the proxy had no instance of a pool up: on
        this 2-core machine a vLLM starting elsewhere has made a healthy one miss its 2 s
        health check) is asked again for up to ``REFUSED_RETRY_S``, and counted."""

        def call() -> tuple[list[str], list[float]]:
            client = openai.OpenAI(
                base_url=f"{self.proxy}/v1", api_key="none", max_retries=0, timeout=120
            )
            request = body(self.model, tokens, OUTPUT_TOKENS)
            deadline = time.monotonic() + REFUSED_RETRY_S
            while True:
                try:
                    choice = client.completions.create(**request).choices[0]
                except openai.InternalServerError as exc:
                    if exc.status_code != 503 or time.monotonic() > deadline:
                        raise
                    self.refused += 1
                    time.sleep(0.5)
                    continue
                return choice.logprobs.tokens, choice.logprobs.token_logprobs

        return self.at_head(call)

    def stream(self, tokens: list[int], max_tokens: int) -> tuple[int, str | None, float]:
        """A streamed answer's token count (its usage), finish reason, and when it ended."""

        def call() -> tuple[int, str | None, float]:
            client = openai.OpenAI(
                base_url=f"{self.proxy}/v1", api_key="none", max_retries=0, timeout=300
            )
            count, finish = 0, None
            for chunk in client.completions.create(
                model=str(self.model),
                prompt=tokens,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ):
                if chunk.usage is not None:
                    count = chunk.usage.completion_tokens
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
            return count, finish, time.monotonic()

        return self.at_head(call, 300)

    def indexed(self) -> dict[str, float]:
        """Prefix-cache blocks the proxy's KV index holds per instance URL (its gauge): the
        instances whose KV events it follows."""
        text = self.at_head(lambda: httpx.get(f"{self.proxy}/metrics", timeout=5).text, 10)
        pattern = r'lmcache_pd_proxy_kv_index_blocks\{instance="([^"]+)"\} (\S+)'
        return {url: float(count) for url, count in re.findall(pattern, text)}

    def decode_counters(self, url: str) -> dict[str, float]:
        return self.worker.call(lambda: scrape(url) | decode_sources(url), 15)

    def scale(self, count: int) -> float:
        """``lmcache-pd scale decode COUNT`` from the head's namespace; its wall time."""
        began = time.monotonic()
        subprocess.run(
            [*self.head.wrap, str(BIN / "lmcache-pd"), "scale", "decode", str(count),
             "--address", self.address, "--namespace", NAMESPACE],
            check=True, timeout=900, capture_output=True, env={**os.environ, **RAY_TOKEN_ENV},
        )  # fmt: skip
        return time.monotonic() - began


def pools_file(cluster: Cluster) -> Path:
    pools = {
        "model": str(cluster.model),
        "engine": "ray",
        "ray": {"address": cluster.address, "namespace": NAMESPACE, "discovery_interval_s": 0.5},
        "proxy": {"host": cluster.head.address, "port": PROXY_PORT, "min_disagg_tokens": 0},
        "vllm_args": list(SERVER_ARGS),
        "prefill": [
            {"config": str(ROOT / "configs/producer.yaml"), "cpus": "0",
             "ray_resources": {"prefill_node": 1}}
        ],
        "decode": [
            {"config": str(ROOT / "configs/consumer.yaml"), "cpus": "1",
             "ray_resources": {"decode_node": 1}}
        ],
    }  # fmt: skip
    path = cluster.workdir / "pools.yaml"
    path.write_text(yaml.safe_dump(pools))
    return path


def process_environment(pid: int) -> dict[str, str]:
    pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(pair.decode(errors="replace").partition("=")[::2] for pair in pairs if pair)


def files_holding(text: str, folders: list[Path]) -> list[Path]:
    """Every file under ``folders`` whose bytes contain ``text``."""
    needle = text.encode()
    return [
        path
        for folder in folders
        for path in sorted(folder.rglob("*"))
        if path.is_file() and needle in path.read_bytes()
    ]


def wait_for(
    what: str,
    check: Callable[[], bool],
    timeout_s: float,
    explain: Callable[[], object] | None = None,
) -> float:
    """Seconds until ``check()`` holds (exceptions count as not yet); fails at the deadline,
    with what ``explain`` returns then."""
    began = time.monotonic()
    while time.monotonic() - began < timeout_s:
        with contextlib.suppress(Exception):
            if check():
                return time.monotonic() - began
        time.sleep(0.5)
    why = ""
    if explain is not None:
        try:
            why = f"; then: {explain()}"
        except Exception as exc:  # the explanation must not hide the failure
            why = f"; no explanation: {exc!r}"
    pytest.fail(f"{what}: not within {timeout_s} s{why}")


@pytest.fixture(scope="module")
def reference(plain_vllm: PlainVLLM) -> dict[str, tuple]:
    return plain_vllm.answers(PROMPTS | FRESH, OUTPUT_TOKENS)


def test_pools_on_a_two_node_ray_cluster_serve_restart_and_scale(
    model: Path,
    reference: dict[str, tuple],
    tmp_path: Path,
    record_property: Callable[[str, object], None],
) -> None:
    measured: dict[str, float] = {}
    with netns.veth_pair("lmpd-ray") as pair:
        cluster = Cluster(pair, model, tmp_path)
        temp = f"/tmp/lmpd-ray-{os.getpid()}"  # Ray's sockets: a short path of our own
        with contextlib.ExitStack() as stack:
            stack.callback(subprocess.run, ["rm", "-rf", temp], check=False)
            head_command = ray_start(
                cluster.head, "--head", f"--port={GCS_PORT}", "--include-dashboard=false",
                f"--temp-dir={temp}", '--resources={"prefill_node": 1}',
            )  # fmt: skip
            stack.enter_context(started(head_command, tmp_path / "ray-head.log", NODE_GRACE_S))
            wait_for(
                "the Ray head",
                lambda: "Ray runtime started" in (tmp_path / "ray-head.log").read_text(),
                60,
            )
            worker_command = ray_start(
                cluster.worker, f"--address={cluster.address}", '--resources={"decode_node": 2}'
            )
            stack.enter_context(started(worker_command, tmp_path / "ray-worker.log", NODE_GRACE_S))
            serve = [*cluster.head.wrap, str(BIN / "lmcache-pd"), "serve", str(pools_file(cluster)),
                     "--workdir", str(tmp_path / "run")]  # fmt: skip
            began = time.monotonic()
            stack.enter_context(started(serve, tmp_path / "serve.log"))
            measured["serve_ready_s"] = wait_for(
                "serve's proxy",
                lambda: (
                    cluster.at_head(
                        lambda: httpx.get(f"{cluster.proxy}/health", timeout=2).status_code, 5
                    )
                    == 200
                ),
                SERVE_TIMEOUT_S,
            )

            # Placement: prefill on the head's node, decode on the worker's.
            assert len(vllm_servers(cluster.head)) == 1
            [decode_port] = vllm_servers(cluster.worker)
            [decode_url] = cluster.decode_urls()
            assert decode_url == f"http://{cluster.worker.address}:{decode_port}"

            # Ray's token: a caller without it is refused (the control), so serve did not warn.
            assert cluster.at_head(lambda: asks_for_token(cluster.address), 30) is True
            assert "Ray's token" not in (tmp_path / "serve.log").read_text()
            # Each vLLM's share of the deployment secret (its role's, of the proxy's
            # deployment): in its environment, on no command line.
            proxy_share = (tmp_path / "run" / "kv.proxy.key").read_text().strip()
            deployment = DeploymentKeys.from_share(proxy_share).deployment
            shares = {proxy_share}
            for side, role in ((cluster.head, Role.PRODUCER), (cluster.worker, Role.CONSUMER)):
                for pid in vllm_servers(side).values():
                    share = process_environment(pid).get(SECRET_ENV, "")
                    keys = DeploymentKeys.from_share(share)
                    assert (keys.role, keys.deployment) == (role, deployment)
                    shares.add(share)
                assert not [c for _, c in processes_in(side) for s in shares if s in c]

            # Answers equal one plain vLLM's; decode loaded the prompts.
            before = cluster.decode_counters(decode_url)
            for name, tokens in PROMPTS.items():
                assert_close_answer(cluster.complete(tokens), reference[name], name)
            after = cluster.decode_counters(decode_url)
            loaded = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
            computed = after.get("local_compute", 0) - before.get("local_compute", 0)
            assert loaded >= sum(len(t) for t in PROMPTS.values()) - 3 * 256, (loaded, computed)
            assert after["loads_failed"] == before.get("loads_failed", 0)
            assert after["consumer_unauthenticated"] == 0  # its KV ports know the secret
            # Prefill reached decode's node over UCX's transport for a remote peer, not its
            # fallback, and no push failed.
            [prefill_port] = vllm_servers(cluster.head)
            prefill_url = f"http://{cluster.head.address}:{prefill_port}"
            producer = cluster.at_head(lambda: scrape(prefill_url), 15)
            assert producer["peers_remote_transport"] == 1, producer
            assert producer["peers_fallback_transport"] == producer["push_failures"] == 0, producer
            # Both instances publish their KV events from their nodes; the proxy follows them.
            both = sorted([decode_url, prefill_url])
            wait_for("both instances indexed", lambda: min(cluster.indexed().values()) > 0, 10)
            assert sorted(cluster.indexed()) == both

            # Decode's vLLM dies as a second decode is asked for: Ray restarts the first on new
            # ports while the second starts (both at once, as churn in a cluster has them), and
            # requests succeed again through the same proxy, on both.
            os.killpg(vllm_servers(cluster.worker)[decode_port], signal.SIGKILL)
            with ThreadPoolExecutor(1) as scaling:
                scaled_up = scaling.submit(cluster.scale, 2)

                def both_decodes_serve() -> bool:
                    urls = cluster.decode_urls()
                    return len(urls) == 2 and decode_url not in urls

                measured["restart_and_scale_up_s"] = wait_for(
                    "the restarted decode and the added one routed to",
                    both_decodes_serve,
                    RECOVERY_TIMEOUT_S,
                    explain=cluster.decode_urls,
                )
                measured["scale_up_s"] = scaled_up.result(timeout=RECOVERY_TIMEOUT_S)
            urls = cluster.decode_urls()
            assert len(vllm_servers(cluster.worker)) == 2
            for name, tokens in PROMPTS.items():
                assert_close_answer(cluster.complete(tokens), reference[name], name)
            # Prompts nobody holds go round-robin between idle equals: each decode loads one.
            for name, tokens in FRESH.items():
                assert_close_answer(cluster.complete(tokens), reference[name], name)
            wait_for(
                "each decode's loads counted",
                lambda: all(cluster.decode_counters(url)["tokens_loaded"] > 0 for url in urls),
                15,
                explain=lambda: {u: cluster.decode_counters(u) for u in urls} | cluster.indexed(),
            )
            # The restarted decode publishes on new ports: the proxy follows it there, and no
            # longer the old one; and the added one.
            wait_for(
                "both decodes indexed, the old ports not",
                lambda: (
                    all((indexed := cluster.indexed()).get(url, 0) > 0 for url in urls)
                    and decode_url not in indexed
                ),
                10,
                explain=cluster.indexed,
            )

            # Shrinking back drains: two streams in flight (one on each decode) both finish.
            def loads() -> float:
                return sum(cluster.decode_counters(u).get("loads_completed", 0) for u in urls)

            loaded_before = loads()
            with ThreadPoolExecutor(2) as streams:
                # Prompts neither holds, so that both go through prefill and load.
                running = [
                    streams.submit(cluster.stream, prompt(300, 2900 + i), 400) for i in (0, 1)
                ]
                wait_for(
                    "both streams at decode",
                    lambda: loads() >= loaded_before + 2,
                    60,
                    explain=lambda: {u: cluster.decode_counters(u) for u in urls},
                )
                measured["scale_down_s"] = cluster.scale(1)
                scaled = time.monotonic()
                finished = [future.result(timeout=300) for future in running]
            assert [(count, finish) for count, finish, _ in finished] == [(400, "length")] * 2
            # The leaving instance was stopped only after its stream ended.
            assert scaled > max(ended for _, _, ended in finished)
            wait_for("the proxy routing to one", lambda: len(cluster.decode_urls()) == 1, 10)
            assert len(vllm_servers(cluster.worker)) == 1
            measured["serve_total_s"] = time.monotonic() - began
            measured["answers_refused_503"] = cluster.refused
            # No log of serve's, Ray's or any instance's holds a share (the proxy's own file
            # does; the secret itself is in no file).
            for share in shares:
                holding = files_holding(share, [tmp_path, Path(temp)])
                mine = [tmp_path / "run" / "kv.proxy.key"] if share == proxy_share else []
                assert holding == mine, holding
        # serve, then both nodes, stopped by process group: nothing is left in either namespace
        # (Ray's idle workers end with their raylet).
        for side in (cluster.head, cluster.worker):
            wait_for(f"every process in {side.netns} ended", lambda s=side: not processes_in(s), 30)
    logger.info("measured on the two-node Ray cluster: %s", json.dumps(measured))
    record_property("ray_cluster_seconds", measured)
