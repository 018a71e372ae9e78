"""Which prompts the proxy serves on decode alone: counted in tokens, mostly without tokenizing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmcache_pd.proxy.client_request import ClientRequest, Endpoint
from lmcache_pd.proxy.prompt_size import LONG_BYTES_PER_TOKEN, PromptSizer

MODEL = "m"


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tokenizer whose tokens are whole words: many bytes each, so only it can tell."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "alpha", "beta", "gamma", "delta"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    folder = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save(str(folder / "tokenizer.json"))
    return str(folder)


def completion(prompt: Any) -> ClientRequest:
    return ClientRequest.parse(Endpoint.COMPLETIONS, {"model": MODEL, "prompt": prompt})


def chat(*contents: Any) -> ClientRequest:
    messages = [{"role": "user", "content": content} for content in contents]
    return ClientRequest.parse(Endpoint.CHAT, {"model": MODEL, "messages": messages})


@pytest.mark.parametrize(
    ("prompt", "short"),
    [([1] * 9, True), ([1] * 10, False), ([[1] * 9], True), ([[1] * 10], False)],
)
def test_token_ids_are_counted(prompt: Any, short: bool) -> None:
    assert PromptSizer(10, None).is_short(completion(prompt)) is short


def test_nothing_is_short_at_zero(word_tokenizer: str) -> None:
    assert not PromptSizer(0, word_tokenizer).is_short(completion([1]))
    assert not PromptSizer(0, word_tokenizer).is_short(chat("a"))


def test_a_text_of_fewer_bytes_than_tokens_asked_for_is_short_without_a_tokenizer() -> None:
    sizer = PromptSizer(10, None)
    assert sizer.is_short(completion("abcdefg"))  # 7 bytes (+2 special tokens) < 10 tokens
    assert sizer.is_short(chat("abc", "def"))  # a chat counts its messages' text
    # Between the bounds, with no tokenizer to tell: disaggregated, as before the feature.
    assert not sizer.is_short(completion("abcdefgh"))


def test_a_text_between_the_bounds_is_tokenized(word_tokenizer: str) -> None:
    sizer = PromptSizer(5, word_tokenizer)
    four_words, five_words = "alpha beta gamma delta", "alpha beta gamma delta alpha"
    assert sizer.is_short(completion(four_words))
    assert not sizer.is_short(completion(five_words))
    assert sizer.is_short(chat("alpha beta", [{"type": "text", "text": "gamma delta"}]))
    assert not sizer.is_short(chat("alpha beta gamma", "delta alpha"))


def test_a_text_far_longer_than_the_threshold_is_not_tokenized(word_tokenizer: str) -> None:
    """One 'word' token of many bytes: the tokenizer would say 1 token, the bound says long."""
    sizer = PromptSizer(5, word_tokenizer)
    assert sizer.is_short(completion("x" * (LONG_BYTES_PER_TOKEN * 5)))
    assert not sizer.is_short(completion("x" * (LONG_BYTES_PER_TOKEN * 5 + 1)))


def test_a_model_without_tokenizer_json_counts_without_one(tmp_path: Path, caplog) -> None:
    sizer = PromptSizer(10, str(tmp_path))
    assert "no tokenizer for prompt sizes" in caplog.text
    assert sizer.is_short(completion("abcdefg"))
    assert not sizer.is_short(completion("abcdefgh"))
