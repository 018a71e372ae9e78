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
    reasoning parser shapes its delta), nor where every event carries the usage so far
    (``continuous_usage_stats``: decode's first event has it)."""
    if not client.stream or client.body.get("stop") or client.body.get("tools"):
        return False
    if client.continuous_usage:
        return False
    if client.endpoint is Endpoint.COMPLETIONS:
        return True
    message = (prefill_answer["choices"][0]).get("message") or {}
    # A token of no text yet (part of a character) is a chunk without content in vLLM's
    # stream, if any: decode's stream shows it as vLLM does.
    return bool(message.get("content")) and not any(
        message.get(name) for name in ("reasoning", "reasoning_content", "tool_calls")
    )


def whole_answer(prefill_answer: dict[str, Any], client: ClientRequest) -> bytes:
    """Prefill's answer when it is the client's whole answer (it ended at its first token), as
    vLLM answers the client's request: no transfer parameters, token ids only if asked."""
    answer = dict(prefill_answer) | {"kv_transfer_params": None}
    return msgspec.json.encode(answer if client.asks_token_ids else _null_token_ids(answer))


def continued_answer(
    raw: bytes, forced: tuple[int, ...], client: ClientRequest
) -> tuple[bytes, FirstTokenMismatch | None]:
    """Decode's whole answer as the client gets it, and how its output does not begin with the
    ``forced`` tokens, if it does not (the answer is still decode's own exact answer to the
    client's request). One served alone for a field is passed on as it is."""
    if client.alone_reason is not None:
        return raw, None
    answer = msgspec.json.decode(raw)
    ids = _output_ids(answer)
    mismatch = None
    if tuple(ids[: len(forced)]) != forced:
        mismatch = FirstTokenMismatch(
            f"decode's output {ids[: len(forced)]} does not begin with the forced {list(forced)}; "
            "its own answer was passed on"
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
                # the rendered prompt, where asked (``return_prompt_text``): prefill's answer
                # has it, as vLLM's first chunk
                "prompt_text": prefill_answer.get("prompt_text"),
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


class CannotContinue(Exception):
    """A stream that the client has part of cannot go on on another decode exactly; the
    message says why."""


class DecodeRelay:
    """Decode's streamed events as the client gets them, one at a time, and what the client
    has of the answer: so that, when decode fails under the stream, another decode can be
    forced through the same tokens (``resume``) and its events passed on from where the client
    is, none twice, none missing."""

    def __init__(
        self, client: ClientRequest, forced: tuple[int, ...], first_text: str | None = None
    ) -> None:
        """``forced``: the tokens decode's output must begin with (prefill's first token; none
        for a request decode serves alone). ``first_text``: where the client has the first
        token already (``first_events``), its text: decode's events up to and including it are
        not passed on, and one that joins it with the next tokens (vLLM joins a stream's
        outputs while its reader lags) is passed on without it."""
        self._asked_ids = client.asks_token_ids
        self._chat = client.endpoint is Endpoint.CHAT
        self._forced = forced
        # What the client has: output token ids, text, whether any event, a finish reason.
        self._sent_ids: list[int] = list(forced[:1]) if first_text is not None else []
        self._sent_text: list[str] = [first_text] if first_text else []
        self._started = first_text is not None
        self._finished = False
        # Whether every event so far is one choice's plain text (no tool call or reasoning
        # delta, no second choice): only then is a stream cut at a token continued exactly.
        self._plain = True
        self._restart()

    def _restart(self) -> None:
        """Read a new decode stream from its start: its events up to what the client has are
        checked against that and skipped."""
        self._seen_ids = 0
        self._seen_text = 0
        self._skip_ids = len(self._sent_ids)
        self._skip_text = "".join(self._sent_text)
        self._skipping = self._started

    @property
    def started(self) -> bool:
        """Whether the client has any event of the answer."""
        return self._started

    def resume(self) -> tuple[int, ...]:
        """After decode failed: the tokens the next decode's output must begin with (what the
        client has, or at least the forced ones); its stream is then read from its start.
        Raises ``CannotContinue`` where the client's part cannot be matched token by token."""
        if self._started and not self._plain:
            raise CannotContinue("the stream has more than one choice's plain text")
        self._forced = tuple(self._sent_ids) or self._forced
        self._restart()
        return self._forced

    def relay(self, data: bytes) -> bytes | None:
        """The event's data for the client, or None where it is skipped (``[DONE]`` too: a
        client that has it may hang up, and decode's body is read to its end first). Raises
        ``FirstTokenMismatch`` where decode's output is not what the client has."""
        if data == b"[DONE]":
            return None  # the caller's to send, once decode's answer has ended
        event = msgspec.json.decode(data)
        choices = event.get("choices") or []
        ids: list[int] = []
        text = ""
        if choices:
            self._plain = self._plain and len(choices) == 1 and _plain(choices[0])
            ids = choices[0].get("token_ids") or []
            text = _text(choices[0])
            self._check(ids)
        changed = False
        if self._skipping:
            kept = self._skip(event, ids, text)
            if kept is None:
                return None
            changed, ids, text = True, *kept
        self._seen_ids += len(ids)
        self._seen_text += len(text)
        self._sent_ids += ids
        if text:
            self._sent_text.append(text)
        self._started = True
        self._finished = self._finished or any(c.get("finish_reason") for c in choices)
        if not self._asked_ids:
            if self._chat and choices and all(map(_carries_ids_only, choices)):
                return None  # vLLM sends no chunk for it where the client asks no ids
            _null_token_ids(event)
            changed = True
        return msgspec.json.encode(event) if changed else data

    def _check(self, ids: list[int]) -> None:
        """Raise ``FirstTokenMismatch`` where ``ids``, at the stream's position, are not the
        forced tokens."""
        start = self._seen_ids
        for position, token in enumerate(ids[: max(len(self._forced) - start, 0)], start):
            if token != self._forced[position]:
                raise FirstTokenMismatch(
                    f"decode's output token {position} is {token}, not the forced "
                    f"{self._forced[position]}"
                )

    def _skip(
        self, event: dict[str, Any], ids: list[int], text: str
    ) -> tuple[list[int], str] | None:
        """While the client has what this event holds: None, the event skipped (its text checked
        against the client's); the event that goes past it is cut to what is new (its ids, text
        and logprobs) and the skipping ends. Events without tokens before it (a chat's role
        chunk) are skipped."""
        if text and not ids:  # never skip what cannot be matched token by token
            raise FirstTokenMismatch("decode's stream carries no token ids to go on from")
        drop_ids = min(len(ids), self._skip_ids - self._seen_ids)
        expected = self._skip_text[self._seen_text :]
        drop_text = min(len(text), len(expected))
        if text[:drop_text] != expected[:drop_text]:
            raise FirstTokenMismatch("decode's text does not go on from what the client has")
        self._seen_ids += drop_ids
        self._seen_text += drop_text
        if not ids or self._seen_ids < self._skip_ids:
            return None
        self._skipping = False
        choice = event["choices"][0]
        rest_ids, rest_text = ids[drop_ids:], text[drop_text:]
        if not rest_ids and not (choice.get("finish_reason") and not self._finished):
            return None
        _cut(choice, drop_ids, rest_text)
        return rest_ids, rest_text


def _plain(choice: dict[str, Any]) -> bool:
    """Whether a streamed choice is the first choice's plain text (a completion's text, a chat's
    content and role)."""
    delta = choice.get("delta")
    extra = () if delta is None else (v for k, v in delta.items() if k not in ("role", "content"))
    return choice.get("index", 0) == 0 and not any(extra)


def _carries_ids_only(choice: dict[str, Any]) -> bool:
    """Whether a chat chunk's choice is one vLLM 0.32 sends only because token ids were asked:
    a step whose delta its parser held back (a tool call's or reasoning's control tokens, text
    not yet whole), with no logprobs and no finish (``chat_stream_generator``: an empty
    ``DeltaMessage`` stands in for none)."""
    return (
        choice.get("delta") == {}
        and choice.get("logprobs") is None
        and choice.get("finish_reason") is None
    )


def _text(choice: dict[str, Any]) -> str:
    """A streamed choice's text: a chat delta's content, a completion's text."""
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def _cut(choice: dict[str, Any], drop_ids: int, rest_text: str) -> None:
    """Take a streamed choice's first ``drop_ids`` tokens out (their ids and logprobs; the
    prompt's ids, which only a stream's first event carries), leaving ``rest_text``."""
    delta = choice.get("delta")
    if isinstance(delta, dict):
        delta["content"] = rest_text
    else:
        choice["text"] = rest_text
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict):
        for name, values in logprobs.items():
            if isinstance(values, list):  # content (chat); tokens, token_logprobs, ... (text)
                logprobs[name] = values[drop_ids:]
    choice["token_ids"] = choice["token_ids"][drop_ids:]
    if choice.get("prompt_token_ids") is not None:
        choice["prompt_token_ids"] = None
