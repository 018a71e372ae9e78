"""What a client sees of a disaggregated request: vLLM's own answer to its own request.

Decode is sent the client's request as the client sent it (``ClientRequest.decode_body``), with
its first output token forced to prefill's (``connector/forced_first.py``), and answers it whole;
the proxy passes that answer on with two changes only. The token ids it asked both instances for
(``return_token_ids``, to check the first token) are nulled where the client did not ask for
them, as vLLM writes them then. And where the client streams and its first token can be shown
alone exactly as vLLM would show it (``shows_first_alone``), that token goes out at once, in
vLLM 0.32's own chunk shapes built from prefill's answer, and decode's chunks up to and
including its first token are skipped. Otherwise decode's stream goes out whole: the client's
first token then comes with decode's.

Decode's first token is checked against prefill's. They always agree where decode runs the
forcing processor; where they do not (an instance without it), a whole answer is decode's own
answer to the client's request, exact as it stands (counted), and a stream whose first token is
already out ends with a clear error (counted), never with a continuation of another token.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from lmcache_pd.proxy.client_request import ClientRequest, Endpoint

# Fields of vLLM's answers that ``return_token_ids`` fills (null otherwise), in a choice or at the
# top of a chat stream's first chunk and of a whole answer.
TOKEN_ID_FIELDS = ("prompt_token_ids", "token_ids")


class FirstTokenMismatch(Exception):
    """Decode's answer does not go on from prefill's first token; the message says how."""


def _null_token_ids(answer: dict[str, Any]) -> dict[str, Any]:
    """``answer`` as vLLM writes it without ``return_token_ids``."""
    for holder in (answer, *(answer.get("choices") or ())):
        for name in TOKEN_ID_FIELDS:
            if holder.get(name) is not None:
                holder[name] = None
    return answer


def _drop_first(event: dict[str, Any], first_text: str) -> bool:
    """Take the first token out of a streamed event that holds more (its text, logprobs and
    token ids); False, the event unchanged, where its text does not begin with ``first_text``."""
    choice = event["choices"][0]
    holder, key = (choice["delta"], "content") if "delta" in choice else (choice, "text")
    text = holder.get(key)
    if not isinstance(text, str) or not text.startswith(first_text):
        return False
    holder[key] = text[len(first_text) :]
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        for name, values in logprobs.items():
            if isinstance(values, list):  # content (chat); tokens, token_logprobs, ... (text)
                logprobs[name] = values[1:]
    choice["token_ids"] = choice["token_ids"][1:]
    return True


def _output_ids(answer: dict[str, Any]) -> list[int]:
    choices = answer.get("choices") or ()
    ids = choices[0].get("token_ids") if choices else None
    return ids if isinstance(ids, list) else []


def first_text(prefill_answer: dict[str, Any]) -> str | None:
    """The first token's text in prefill's answer (a chat's message content, a completion's
    text)."""
    choice = prefill_answer["choices"][0]
    message = choice.get("message")
    return message.get("content") if isinstance(message, dict) else choice.get("text")


def shows_first_alone(client: ClientRequest, prefill_answer: dict[str, Any]) -> bool:
    """Whether a stream's first token can go out before decode's stream, exactly as vLLM would
    stream it: not where stop strings are set (vLLM holds back text that may begin one), nor
    where tools are offered or the chat's first token is not plain content (a tool-call or
    reasoning parser shapes its delta)."""
    if not client.stream or client.body.get("stop") or client.body.get("tools"):
        return False
    if client.endpoint is Endpoint.COMPLETIONS:
        return True
    message = (prefill_answer["choices"][0]).get("message") or {}
    return isinstance(message.get("content"), str) and not any(
        message.get(name) for name in ("reasoning", "reasoning_content", "tool_calls")
    )


def whole_answer(prefill_answer: dict[str, Any], client: ClientRequest) -> bytes:
    """Prefill's answer when it is the client's whole answer (it ended at its first token), as
    vLLM answers the client's request: no transfer parameters, token ids only if asked."""
    answer = dict(prefill_answer) | {"kv_transfer_params": None}
    return msgspec.json.encode(answer if client.asks_token_ids else _null_token_ids(answer))


def continued_answer(
    raw: bytes, first_token: int, client: ClientRequest
) -> tuple[bytes, FirstTokenMismatch | None]:
    """Decode's whole answer as the client gets it, and how its first token is not prefill's,
    if it is not (the answer is still decode's own exact answer to the client's request)."""
    answer = msgspec.json.decode(raw)
    ids = _output_ids(answer)
    mismatch = None
    if ids[:1] != [first_token]:
        mismatch = FirstTokenMismatch(
            f"decode's first token {ids[:1]} is not prefill's {first_token}; its own answer "
            "was passed on"
        )
    body = answer if client.asks_token_ids else _null_token_ids(answer)
    return msgspec.json.encode(body), mismatch


def first_events(
    client: ClientRequest, prefill_answer: dict[str, Any], response_id: str, ends: bool
) -> list[dict[str, Any]]:
    """The stream's events for prefill's first token, in vLLM's shapes: a chat's role chunk,
    then the token's chunk; where the answer ``ends`` there, that chunk finishes it, with the
    usage chunk if asked (the caller adds ``[DONE]``)."""
    choice = prefill_answer["choices"][0]
    asked = client.asks_token_ids
    prompt_ids = prefill_answer.get("prompt_token_ids") or choice.get("prompt_token_ids")
    token_ids = choice.get("token_ids") if asked else None
    head = {"id": response_id, "object": "", "created": int(time.time()), "model": client.model}
    events: list[dict[str, Any]] = []
    if client.endpoint is Endpoint.CHAT:
        head["object"] = "chat.completion.chunk"
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}}
        role |= {"logprobs": None, "finish_reason": None}
        events.append(
            head
            | {
                "choices": [role],
                "prompt_token_ids": prompt_ids if asked else None,
                "prompt_text": None,
            }
        )
        token: dict[str, Any] = {"index": 0, "delta": {"content": choice["message"]["content"]}}
        token |= {"logprobs": choice.get("logprobs"), "finish_reason": None}
        if ends:
            token |= {
                "finish_reason": choice["finish_reason"],
                "stop_reason": choice["stop_reason"],
            }
        events.append(head | {"choices": [token | {"token_ids": token_ids}]})
    else:
        head["object"] = "text_completion"
        token = {"index": 0, "text": choice["text"], "logprobs": choice.get("logprobs")}
        token |= {
            "finish_reason": choice["finish_reason"] if ends else None,
            "stop_reason": choice["stop_reason"] if ends else None,
            "prompt_token_ids": prompt_ids if asked else None,
            "token_ids": token_ids,
        }
        events.append(head | {"choices": [token]})
    if ends:
        fingerprint = {"system_fingerprint": prefill_answer.get("system_fingerprint")}
        if client.include_usage:
            usage = prefill_answer.get("usage") or {}
            counts = {
                name: usage.get(name)
                for name in ("prompt_tokens", "total_tokens", "completion_tokens")
            }
            events.append(head | {"choices": [], "usage": counts} | fingerprint)
        else:
            events[-1] |= fingerprint
    return events


class DecodeRelay:
    """Decode's streamed events as the client gets them, one at a time."""

    def __init__(
        self, client: ClientRequest, first_token: int, first_text: str | None = None
    ) -> None:
        """``first_text``: where the client has the first token already (``first_events``),
        its text: decode's events up to and including it are not passed on, and one that
        joins it with the next tokens (vLLM joins a stream's outputs while its reader lags) is
        passed on without it."""
        self._asked_ids = client.asks_token_ids
        self._first_token = first_token
        self._checked = False
        self._first_text = first_text
        self._skipping = first_text is not None

    def relay(self, data: bytes) -> bytes | None:
        """The event's data for the client, or None where it is skipped (``[DONE]`` too: a
        client that has it may hang up, and decode's body is read to its end first). Raises
        ``FirstTokenMismatch`` at a first token that is not prefill's."""
        if data == b"[DONE]":
            return None  # the caller's to send, once decode's answer has ended
        if self._as_sent():
            return data
        event = msgspec.json.decode(data)
        if not self._checked and (ids := _output_ids(event)):
            self._checked = True
            if ids[0] != self._first_token:
                raise FirstTokenMismatch(
                    f"decode's first token {ids[0]} is not prefill's {self._first_token}"
                )
            if self._skipping:
                self._skipping = False
                if len(ids) == 1:
                    return None
                assert self._first_text is not None
                if not _drop_first(event, self._first_text):
                    raise FirstTokenMismatch(
                        "decode's stream joined its first token with the next, in text that "
                        "does not begin with the first token's"
                    )
        if self._skipping:
            return None
        if not self._asked_ids:
            _null_token_ids(event)
        return msgspec.json.encode(event)

    def _as_sent(self) -> bool:
        """Past the first token, with the token ids the client asked for: events go on as
        decode wrote them, not decoded again (per token)."""
        return self._checked and not self._skipping and self._asked_ids
