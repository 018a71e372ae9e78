"""The tiny vision-language model maker: what it writes loads in transformers as an Idefics3 whose
processor puts an image's placeholders where the chat put the image, the image changes the
answer, and builds are reproducible."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from typer.testing import CliRunner

from lmcache_pd.cli import app
from lmcache_pd.harness import vision_maker
from lmcache_pd.harness.model_maker import MAKER_VERSION, MARKER
from lmcache_pd.harness.vision_maker import (
    FAKE_IMAGE_TOKEN,
    GLOBAL_IMAGE_TOKEN,
    IMAGE_SIZE,
    IMAGE_TOKEN,
    IMAGE_TOKENS,
    ensure_vision_model,
    make_vision_model,
)

if TYPE_CHECKING:
    from PIL import Image

FILES = (
    "chat_template.jinja",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "preprocessor_config.json",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    MARKER,
)
MESSAGES = [
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Look: "},
            {"type": "image"},
            {"type": "text", "text": "What is it?"},
        ],
    }
]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One build shared by the module's tests: a build takes a few seconds."""
    return make_vision_model(tmp_path_factory.mktemp("model") / "tiny-vlm")


def digests(directory: Path) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in FILES}


def flat(colour: tuple[int, int, int]) -> Image.Image:
    """An image of one colour, of another size than the model's: the processor resizes it."""
    from PIL import Image

    return Image.new("RGB", (IMAGE_SIZE + 8, IMAGE_SIZE - 4), colour)


def test_config_is_an_idefics3_over_a_small_gqa_llama(built: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(built)
    assert type(config).__name__ == "Idefics3Config"
    text, vision = config.text_config, config.vision_config
    assert text.model_type == "llama"
    assert text.num_key_value_heads < text.num_attention_heads
    assert text.hidden_size <= 128 and text.num_hidden_layers == 2
    assert vision.hidden_size <= 128 and vision.num_hidden_layers == 2
    assert vision.image_size == IMAGE_SIZE
    assert (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2 == IMAGE_TOKENS
    tokenizer = AutoTokenizer.from_pretrained(built)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert text.vocab_size == len(tokenizer)  # the trained vocabulary and the added tokens


def test_weights_load_into_transformers_idefics3(built: Path) -> None:
    from transformers import Idefics3ForConditionalGeneration

    model, info = Idefics3ForConditionalGeneration.from_pretrained(built, output_loading_info=True)
    assert info["missing_keys"] == set()
    assert info["unexpected_keys"] == set()
    assert info["mismatched_keys"] == set()
    assert str(model.dtype) == "torch.float32"


def test_processor_puts_the_images_placeholders_where_the_chat_put_it(built: Path) -> None:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(built)
    prompt = processor.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert prompt == f"<s><|user|>\nLook: {IMAGE_TOKEN}What is it?</s>\n<|assistant|>\n"
    # As vLLM processes a chat prompt: its special tokens are the template's.
    inputs = processor(images=[[flat((200, 30, 30))]], text=prompt, add_special_tokens=False)
    ids = inputs["input_ids"][0]
    tokenizer = processor.tokenizer
    fake, image, global_image = (
        tokenizer.convert_tokens_to_ids(token)
        for token in (FAKE_IMAGE_TOKEN, IMAGE_TOKEN, GLOBAL_IMAGE_TOKEN)
    )
    start = ids.index(fake)
    placeholders = [fake, global_image, *[image] * IMAGE_TOKENS, fake]
    assert ids[start : start + len(placeholders)] == placeholders
    assert ids.count(image) == IMAGE_TOKENS  # one image, one tile
    assert tokenizer.decode(ids[:start]) == "<s><|user|>\nLook: "
    assert inputs["pixel_values"].shape == (1, 1, 3, IMAGE_SIZE, IMAGE_SIZE)


def test_text_only_chats_render_as_the_llamas(built: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    messages = [{"role": "user", "content": "Hello?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<s><|user|>\nHello?</s>\n<|assistant|>\n"


def test_another_image_changes_the_greedy_answer(built: Path) -> None:
    """The model-level negative control of every image test: the image reaches the answer."""
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(built)
    model = Idefics3ForConditionalGeneration.from_pretrained(built)
    prompt = processor.apply_chat_template(MESSAGES, add_generation_prompt=True)

    def answer(colour: tuple[int, int, int]) -> list[int]:
        inputs = processor(
            images=[[flat(colour)]], text=prompt, add_special_tokens=False, return_tensors="pt"
        )
        out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    red = answer((200, 30, 30))
    assert answer((200, 30, 30)) == red
    assert answer((20, 30, 230)) != red


def test_two_builds_are_byte_identical(built: Path, tmp_path: Path) -> None:
    again = make_vision_model(tmp_path / "again")
    assert digests(again) == digests(built)


def test_ensure_vision_model_keeps_a_matching_build(
    built: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(
        vision_maker, "make_vision_model", lambda d, *, seed: calls.append(seed) or d
    )
    assert ensure_vision_model(built) == built
    assert calls == []
    assert ensure_vision_model(built, seed=7) == built  # another seed is another model: rebuilt
    assert calls == [7]
    assert json.loads((built / MARKER).read_text())["architecture"] == "idefics3"


def test_a_folder_it_did_not_write_is_refused(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        make_vision_model(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_cli_make_model_writes_the_vision_model(built: Path, tmp_path: Path) -> None:
    llama = tmp_path / "llama"
    llama.mkdir()
    # A Llama build's marker: kept as it is, so that the command builds the vision model alone.
    (llama / MARKER).write_text(json.dumps({"maker_version": MAKER_VERSION, "seed": 0}))
    result = CliRunner().invoke(app, ["make-model", str(llama), "--vision", str(tmp_path / "v")])
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith(str(tmp_path / "v"))
    assert digests(tmp_path / "v") == digests(built)
