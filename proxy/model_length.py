"""Requests past the model's context length, refused before any instance computes, with vLLM's
own answer.

Prefill is asked for one token (``max_tokens: 1``), so a request whose ``max_tokens`` is past the
model's length passes there: its prompt is computed and pushed, and then decode refuses it. vLLM
0.32 checks the length twice (``renderers/params.py``, ``TokenizeParams``; its answer is
``create_error_response`` of the ``VLLMValidationError``, parameter and value appended to the
message): the output tokens asked (``max_tokens``, or a chat's ``max_completion_tokens``) before
anything else, and a prompt's tokens once it has them. It does not refuse a prompt and an output
that only together pass the length: it cuts ``max_tokens`` to what is left (``get_max_tokens``),
and so does decode here.

A prompt is checked here only where its count is the one vLLM checks: token ids, not truncated
(``truncate_prompt_tokens``). A text vLLM first bounds by its characters (by its tokenizer's
longest token, which the proxy does not know), and tokenizes only up to one token past the
length: its words could differ, and prefill refuses such a prompt itself before computing any of
it. The length is learned from the instances' ``/v1/models`` (``model_names.py``); while it is
not known, nothing is checked here.
"""

from __future__ import annotations

from typing import Any

from lmcache_pd.proxy.client_request import BadRequest, ClientRequest, Endpoint


def check_length(client: ClientRequest, max_model_len: int | None) -> None:
    """Raise ``BadRequest``, with vLLM's words, for what vLLM refuses at ``max_model_len``."""
    if max_model_len is None:
        return
    asked = client.max_tokens
    if asked is not None and asked > max_model_len:
        param = "max_tokens"
        if client.endpoint is Endpoint.CHAT and client.body.get("max_completion_tokens"):
            param = "max_completion_tokens"
        raise _refusal(
            f"{param}={asked} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param,
            asked,
        )
    if client.endpoint is not Endpoint.COMPLETIONS or "truncate_prompt_tokens" in client.body:
        return
    for ids in _token_prompts(client.body.get("prompt")):
        if len(ids) > max_model_len:
            # vLLM says "at least" where a tokenizer would have stopped at one past the length.
            count = len(ids)
            qualifier = "at least " if count == max_model_len + 1 else ""
            raise _refusal(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt contains {qualifier}{count} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
                count,
            )


def _token_prompts(prompt: Any) -> list[list[int]]:
    """A completion's prompts given as token ids, in order (of a batch, its token-id ones)."""
    if not isinstance(prompt, list) or not prompt:
        return []
    if isinstance(prompt[0], str | list):  # a batch
        return [one for one in prompt if isinstance(one, list)]
    return [prompt]


def _refusal(message: str, param: str, value: int) -> BadRequest:
    return BadRequest(f"{message} (parameter={param}, value={value})", param=param)
