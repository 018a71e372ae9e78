"""A tiny LoRA adapter for the tiny Llama (``model_maker.py``): what the tests serve with
``--enable-lora --lora-modules NAME=DIR`` to check that an adapter's requests go through PD as one
vLLM answers them, and that no adapter's KV is ever loaded for another or the base model.

PEFT's format, which vLLM reads: ``adapter_config.json`` and ``adapter_model.safetensors`` with
``lora_A`` (rank x in) and ``lora_B`` (out x rank) for every attention projection of every layer.
PEFT starts ``lora_B`` at zero (an adapter that changes nothing until trained); here both are
seeded random, large enough that the adapter changes the answer (the tests' negative control).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from lmcache_pd.harness.model_maker import staged_folder

logger = logging.getLogger(__name__)

RANK = 8
SCALE = 0.2  # of the random factors: the adapter moves the logits well past any tie


def _shapes(config: dict) -> dict[str, tuple[int, int]]:
    """(out, in) of each attention projection of the model ``config`` describes."""
    hidden = config["hidden_size"]
    head = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    query = config["num_attention_heads"] * head
    return {
        "q_proj": (query, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, query),
    }


def make_lora(directory: Path, model: Path, *, seed: int = 1) -> Path:
    """Write an adapter for the Llama in ``model`` into ``directory`` (replacing it; built in a
    sibling folder and renamed into place) and return it."""
    from safetensors.torch import save_file

    config = json.loads((model / "config.json").read_text())
    shapes = _shapes(config)
    generator = torch.Generator().manual_seed(seed)

    def factor(*shape: int) -> torch.Tensor:
        return SCALE * torch.randn(*shape, generator=generator)

    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for name, (out, into) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{name}"
            tensors[f"{prefix}.lora_A.weight"] = factor(RANK, into)
            tensors[f"{prefix}.lora_B.weight"] = factor(out, RANK)
    adapter = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": RANK,
        "lora_alpha": 2 * RANK,
        "lora_dropout": 0.0,
        "target_modules": sorted(shapes),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "base_model_name_or_path": str(model),
    }
    directory = Path(directory)
    with staged_folder(directory) as staging:
        save_file(tensors, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
        (staging / "adapter_config.json").write_text(json.dumps(adapter, indent=2) + "\n")
    logger.info("made a rank-%d LoRA adapter (seed %d) for %s in %s", RANK, seed, model, directory)
    return directory
