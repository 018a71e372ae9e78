"""Whether a prompt is too short to be worth a transfer (selective disaggregation).

For a short prompt, prefill on one instance and a transfer to another cost more than the decode
instance computing the prompt itself: the proxy then sends the request to decode alone. The
decision needs the prompt's length in tokens without a round trip, and mostly without the
tokenizer: with a byte-level tokenizer (GPT-2's, Llama 3's, the tiny model's) every token covers
at least one byte, so a text of fewer bytes than the threshold is short, and a text many times
longer is not; only texts in between are tokenized. A chat counts the text of its messages, not
its template's few tokens. Without a tokenizer, a text in between is disaggregated, as before.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from lmcache_pd.proxy.client_request import ClientRequest, Endpoint, completion_prompt

logger = logging.getLogger(__name__)

# Special tokens a tokenizer may add to a text (a BOS, an EOS).
MAX_ADDED_TOKENS = 2
# A text of over this many bytes per threshold token is taken as long without being tokenized:
# English runs ~4 bytes a token, and misjudging a rare longer one only disaggregates it.
LONG_BYTES_PER_TOKEN = 16


class PromptSizer:
    """Tells whether a request's prompt has fewer than ``min_tokens`` tokens (0: never)."""

    def __init__(self, min_tokens: int, tokenizer_dir: str | None) -> None:
        self.min_tokens = min_tokens
        self._tokenizer = None
        if min_tokens and tokenizer_dir:
            self._tokenizer = _load_tokenizer(tokenizer_dir)

    def is_short(self, request: ClientRequest) -> bool:
        if not self.min_tokens:
            return False
        prompt = _prompt_of(request)
        if isinstance(prompt, list):
            return len(prompt) < self.min_tokens
        size = len(prompt.encode())
        if size + MAX_ADDED_TOKENS < self.min_tokens:
            return True
        if size > LONG_BYTES_PER_TOKEN * self.min_tokens or self._tokenizer is None:
            return False
        return len(self._tokenizer.encode(prompt).ids) < self.min_tokens


def _prompt_of(request: ClientRequest) -> str | list[int]:
    """A completion's text or token ids (a batch of one unwrapped, as the door allows), or a
    chat's message texts joined."""
    body = request.body
    if request.endpoint is Endpoint.COMPLETIONS:
        return completion_prompt(body["prompt"])
    texts = []
    for message in body["messages"]:
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):  # parts: only texts count (the door checked them)
            texts += [part if isinstance(part, str) else part.get("text") or "" for part in content]
    return "\n".join(texts)


def _load_tokenizer(directory: str) -> Any:
    """The fast tokenizer of a Hugging Face model folder (its ``tokenizer.json``); None, said
    once, if it has none (an older model's ``tokenizer.model`` alone, say)."""
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises plain Exceptions for missing or bad files
        logger.warning(
            "no tokenizer for prompt sizes (%s): a text goes to decode alone only if its byte "
            "count shows it short",
            exc,
        )
        return None
    logger.info("prompt sizes from the tokenizer in %s", directory)
    return tokenizer
