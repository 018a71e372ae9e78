"""Answers in OpenAI's shapes: prefill's one-token answer and decode's streamed completion are
read into ``Piece``s, and pieces are written out as the client asked (completion or chat, streamed
chunks or one body).

Decode always answers as a completion (it is given token ids); a chat client gets those pieces
as chat deltas, so its answer reads as if one instance had served the chat request.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from lmcache_pd.proxy.client_request import Endpoint


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    logprob: float
    top: dict[str, float]


@dataclass(slots=True)
class Piece:
    """Some output text, its tokens' logprobs if asked for, and a finish reason if it ends."""

    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def piece_from_prefill(endpoint: Endpoint, choice: dict[str, Any]) -> Piece:
    """Prefill's one choice, in the shape of the endpoint it was asked on."""
    if endpoint is Endpoint.COMPLETIONS:
        return piece_from_completion(choice)
    raw = choice.get("logprobs")
    logprobs = None
    if raw is not None:
        logprobs = [
            TokenLogprob(
                entry["token"],
                entry["logprob"],
                {top["token"]: top["logprob"] for top in entry.get("top_logprobs") or ()},
            )
            for entry in raw.get("content") or ()
        ]
    return Piece(
        (choice.get("message") or {}).get("content") or "",
        logprobs,
        choice.get("finish_reason"),
        choice.get("stop_reason"),
    )


def piece_from_completion(choice: dict[str, Any]) -> Piece:
    """One completion choice (a whole answer's or one streamed chunk's)."""
    raw = choice.get("logprobs")
    logprobs = None
    if raw is not None:
        tops = raw.get("top_logprobs") or [None] * len(raw["tokens"])
        logprobs = [
            TokenLogprob(token, logprob, top or {})
            for token, logprob, top in zip(raw["tokens"], raw["token_logprobs"], tops, strict=True)
        ]
    return Piece(
        choice.get("text") or "",
        logprobs,
        choice.get("finish_reason"),
        choice.get("stop_reason"),
    )


def _chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {
                **one(entry.token, entry.logprob),
                "top_logprobs": [one(token, lp) for token, lp in entry.top.items()],
            }
            for entry in entries
        ]
    }


@dataclass
class ResponseWriter:
    """Turns pieces into the client's chunks or final body, under one id and creation time."""

    endpoint: Endpoint
    model: str
    response_id: str
    created: int = field(default_factory=lambda: int(time.time()))
    # Completions' text_offset runs over the whole answer, across prefill's and decode's parts.
    _text_offset: int = 0
    _sent_role: bool = False

    def _envelope(self, stream: bool) -> dict[str, Any]:
        if self.endpoint is Endpoint.COMPLETIONS:
            obj = "text_completion"
        else:
            obj = "chat.completion.chunk" if stream else "chat.completion"
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}

    def _completion_logprobs(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        offsets = []
        for entry in entries:
            offsets.append(self._text_offset)
            self._text_offset += len(entry.token)
        return {
            "tokens": [entry.token for entry in entries],
            "token_logprobs": [entry.logprob for entry in entries],
            "top_logprobs": [entry.top for entry in entries],
            "text_offset": offsets,
        }

    def chunk(self, piece: Piece) -> dict[str, Any]:
        """One streamed chunk."""
        choice: dict[str, Any] = {"index": 0}
        if self.endpoint is Endpoint.COMPLETIONS:
            choice["text"] = piece.text
            choice["logprobs"] = (
                None if piece.logprobs is None else self._completion_logprobs(piece.logprobs)
            )
        else:
            choice["delta"] = {"content": piece.text}
            if not self._sent_role:
                choice["delta"] = {"role": "assistant", **choice["delta"]}
                self._sent_role = True
            choice["logprobs"] = None if piece.logprobs is None else _chat_logprobs(piece.logprobs)
        choice["finish_reason"] = piece.finish_reason
        choice["stop_reason"] = piece.stop_reason
        return {**self._envelope(stream=True), "choices": [choice]}

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        return {**self._envelope(stream=True), "choices": [], "usage": usage.as_dict()}

    def body(self, pieces: list[Piece], usage: Usage) -> dict[str, Any]:
        """The whole answer as one non-streamed response."""
        text = "".join(piece.text for piece in pieces)
        asked_logprobs = any(piece.logprobs is not None for piece in pieces)
        entries = [entry for piece in pieces for entry in piece.logprobs or ()]
        last = pieces[-1]
        choice: dict[str, Any] = {"index": 0}
        if self.endpoint is Endpoint.COMPLETIONS:
            choice["text"] = text
            choice["logprobs"] = self._completion_logprobs(entries) if asked_logprobs else None
        else:
            choice["message"] = {"role": "assistant", "content": text}
            choice["logprobs"] = _chat_logprobs(entries) if asked_logprobs else None
        choice["finish_reason"] = last.finish_reason
        choice["stop_reason"] = last.stop_reason
        return {**self._envelope(stream=False), "choices": [choice], "usage": usage.as_dict()}


def error_body(message: str, kind: str, status: int) -> dict[str, Any]:
    """OpenAI's (and vLLM's) error shape; also sent as a stream's last event."""
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
