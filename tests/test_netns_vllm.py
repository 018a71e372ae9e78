"""End to end across two network stacks: a prefill vLLM in one network namespace, a decode vLLM
in another (joined by a veth pair, as two hosts are), the proxy in front, each with the shipped
configs/producer.yaml and configs/consumer.yaml (only the decode's address set); every answer
must equal one plain vLLM's, and decode's counters must show the KV loaded, not recomputed.

The proxy runs on a thread of this process moved into prefill's namespace (it reaches decode
over the veth), and requests go to it from there. Needs root and ``ip``; skipped otherwise.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from lmcache_pd.deploy.vllm_server import START_TIMEOUT_S, VLLMServer
from lmcache_pd.harness import netns
from lmcache_pd.harness.app_thread import proxy_thread
from lmcache_pd.metrics_scrape import scrape
from lmcache_pd.proxy.config import DecodeInstance, PrefillInstance, ProxyConfig
from tests.helpers import free_port
from tests.vllm_support import SERVER_ARGS, PlainVLLM, answer, assert_close_answer, body, prompt

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(netns.unavailable() is not None, reason=f"{netns.unavailable()}"),
]
OUTPUT_TOKENS = 6
PROMPTS = {f"len-{n}": prompt(n, 500 + n) for n in (31, 300, 1000, 2600)}
# The consumer config's own ports: free in decode's fresh namespace.
INIT_PORT, ALLOC_PORT = 55555, 55556
REQUEST_TIMEOUT_S = 120.0


def connector(role: str, config: str) -> dict:
    return {
        "kv_connector": "LMCachePDConnector",
        "kv_connector_module_path": "lmcache_pd.connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"config_path": str(CONFIGS / config)},
    }


def test_prefill_and_decode_in_two_namespaces_answer_as_one_plain_vllm(
    model: Path, plain_vllm: PlainVLLM, tmp_path: Path
) -> None:
    with netns.veth_pair("lmpd-e2e") as pair:
        left, right = pair.left, pair.right
        prefill = VLLMServer(
            model,
            8100,
            tmp_path / "prefill.log",
            kv_transfer_config=connector("kv_producer", "producer.yaml"),
            cpu=0,
            extra_args=SERVER_ARGS,
            log_stats=True,
            wait=False,
            wrap=left.wrap,
        )
        decode = VLLMServer(
            model,
            8200,
            tmp_path / "decode.log",
            kv_transfer_config=connector("kv_consumer", "consumer.yaml"),
            cpu=1,
            env={"LMCACHE_PD_RECEIVER_HOST": right.address},
            extra_args=SERVER_ARGS,
            log_stats=True,
            wait=False,
            host=right.address,
            wrap=right.wrap,
        )
        with prefill, decode:
            reference = plain_vllm.answers(PROMPTS, OUTPUT_TOKENS)  # while they start
            left.call(prefill.wait_until_healthy, START_TIMEOUT_S + 10)
            right.call(decode.wait_until_healthy, START_TIMEOUT_S + 10)
            config = ProxyConfig(
                model=str(model),
                prefill=[PrefillInstance(prefill.url)],
                decode=[DecodeInstance(decode.url, right.address, INIT_PORT, ALLOC_PORT)],
                port=free_port(),
                min_disagg_tokens=0,  # the transfer is under test: short prompts too
            )
            # Entered on a thread inside prefill's namespace: the proxy's own thread is born
            # there, and so are its sockets.
            proxy = left.call(proxy_thread(config).__enter__, 30)
            try:
                for name, tokens in PROMPTS.items():
                    request = body(model, tokens, OUTPUT_TOKENS)
                    got = left.call(
                        lambda request=request: httpx.post(
                            f"{proxy.url}/v1/completions", json=request, timeout=REQUEST_TIMEOUT_S
                        ).json(),
                        REQUEST_TIMEOUT_S + 5,
                    )
                    assert_close_answer(answer(got), reference[name], name)
            finally:
                proxy.__exit__(None, None, None)
            consumer = right.call(lambda: scrape(decode.url), 30)
            producer = left.call(lambda: scrape(prefill.url), 30)
    # Every prompt token's KV was loaded (decode computes only the first output token's).
    assert consumer["tokens_loaded"] == sum(len(t) for t in PROMPTS.values()), consumer
    assert consumer["loads_failed"] == 0
    assert producer["peers_remote_transport"] == 1, producer
    assert producer["peers_fallback_transport"] == producer["push_failures"] == 0
