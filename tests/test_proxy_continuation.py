"""What the client gets of decode's answer: passed on with the token ids it did not ask for
nulled, decode's chunks up to the first token skipped where the proxy showed it already, and a
first token that is not prefill's never continued silently."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from lmcache_pd.proxy.client_request import ClientRequest, Endpoint
from lmcache_pd.proxy.continuation import (
    DecodeRelay,
    FirstTokenMismatch,
    continued_answer,
    first_events,
    shows_first_alone,
)

FIRST = 42


def client(endpoint: Endpoint = Endpoint.COMPLETIONS, **fields: Any) -> ClientRequest:
    body: dict[str, Any] = {"model": "m", "max_tokens": 4, "stream": True} | fields
    if endpoint is Endpoint.CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = [1, 2, 3]
    return ClientRequest.parse(endpoint, body)


def chunk(ids: list[int] | None, text: str = "x") -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": None, "token_ids": ids}
    return msgspec.json.encode({"id": "cmpl-r", "choices": [choice], "prompt_token_ids": None})


def test_decodes_chunks_up_to_the_first_token_are_skipped_where_it_went_out_already() -> None:
    relay = DecodeRelay(client(), (FIRST,), "x")
    assert relay.relay(chunk(None, "")) is None  # a chat's role chunk: before the first token
    assert relay.relay(chunk([FIRST])) is None
    passed = msgspec.json.decode(relay.relay(chunk([7], "y")))
    assert passed["choices"][0] == {
        "index": 0,
        "text": "y",
        "finish_reason": None,
        "token_ids": None,
    }
    assert relay.relay(b"[DONE]") is None  # the caller's, once decode's body has ended
    # Control: shown with decode's stream, nothing is skipped; ids asked for stay.
    whole = DecodeRelay(client(return_token_ids=True), (FIRST,))
    assert msgspec.json.decode(whole.relay(chunk([FIRST])))["choices"][0]["token_ids"] == [FIRST]


def test_a_stream_without_token_ids_is_never_skipped_silently() -> None:
    """vLLM hides a chat stream's token ids where reasoning is hidden (``include_reasoning``
    false, with a parser): skipping up to the client's first token, every event was skipped,
    and the client got one token and ``[DONE]``. Now the relay says it cannot go on."""
    relay = DecodeRelay(client(), (FIRST,), "x")
    assert relay.relay(chunk(None, "")) is None  # the role chunk: no text, skipped
    with pytest.raises(FirstTokenMismatch, match="no token ids"):
        relay.relay(chunk(None, "x"))


@pytest.mark.parametrize("first_text", ["x", None])
def test_a_first_token_that_is_not_prefills_is_never_passed_on(first_text: str | None) -> None:
    relay = DecodeRelay(client(), (FIRST,), first_text)
    with pytest.raises(FirstTokenMismatch, match="not the forced"):
        relay.relay(chunk([FIRST + 1]))


def test_a_chunk_joining_the_first_token_with_the_next_is_passed_on_without_it() -> None:
    """vLLM joins a stream's outputs while its reader lags: the first token the client has
    already is taken out of the chunk (text, logprobs, ids), the rest passed on; text that does
    not begin with the first token's cannot be split, and is never passed on."""
    relay = DecodeRelay(client(logprobs=1), (FIRST,), "ab")
    event = msgspec.json.decode(chunk([FIRST, 7], "abcd"))
    event["choices"][0]["logprobs"] = {
        "text_offset": [0, 2],
        "token_logprobs": [-1.0, -2.0],
        "tokens": ["ab", "cd"],
        "top_logprobs": [{"ab": -1.0}, {"cd": -2.0}],
    }
    passed = msgspec.json.decode(relay.relay(msgspec.json.encode(event)))["choices"][0]
    assert passed["text"] == "cd" and passed["token_ids"] is None
    assert passed["logprobs"] == {
        "text_offset": [2],
        "token_logprobs": [-2.0],
        "tokens": ["cd"],
        "top_logprobs": [{"cd": -2.0}],
    }
    unsplittable = DecodeRelay(client(), (FIRST,), "zz")
    with pytest.raises(FirstTokenMismatch, match="does not go on"):
        unsplittable.relay(chunk([FIRST, 7], "abcd"))


def test_a_whole_answer_is_decodes_own_with_ids_nulled_and_a_mismatch_named() -> None:
    answer = {
        "choices": [{"index": 0, "text": "ab", "token_ids": [FIRST, 7], "prompt_token_ids": None}],
        "prompt_token_ids": [1, 2, 3],
        "kv_transfer_params": None,
    }
    body, mismatch = continued_answer(msgspec.json.encode(answer), (FIRST,), client(stream=False))
    assert mismatch is None
    got = msgspec.json.decode(body)
    assert got["prompt_token_ids"] is None and got["choices"][0]["token_ids"] is None
    assert got["choices"][0]["text"] == "ab"
    _, mismatch = continued_answer(msgspec.json.encode(answer), (FIRST + 1,), client(stream=False))
    assert mismatch is not None


def prefill_answer(content: str | None = "a", **message: Any) -> dict[str, Any]:
    return {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, **message},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
                "token_ids": [FIRST],
            }
        ],
        "prompt_token_ids": [1, 2, 3],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
        "system_fingerprint": "fp",
    }


def test_the_first_token_goes_out_alone_only_where_vllm_would_show_it_so() -> None:
    chat = Endpoint.CHAT
    assert shows_first_alone(client(chat), prefill_answer())
    assert not shows_first_alone(client(chat, stop=["x"]), prefill_answer())
    assert not shows_first_alone(client(chat), prefill_answer(None, tool_calls=[{}]))
    assert not shows_first_alone(client(chat), prefill_answer("", reasoning="think"))
    assert not shows_first_alone(client(chat, stream=False), prefill_answer())
    # a token of no text yet: vLLM's chunk has no content (before, "content": "" went out)
    assert not shows_first_alone(client(chat), prefill_answer(""))
    # vLLM's first event carries the usage so far: decode's has it (before, it went out alone,
    # without)
    continuous = {"include_usage": True, "continuous_usage_stats": True}
    for endpoint in (chat, Endpoint.COMPLETIONS):
        assert not shows_first_alone(client(endpoint, stream_options=continuous), prefill_answer())


def test_a_chat_hiding_its_reasoning_is_served_by_decode_alone() -> None:
    """vLLM hides a chat stream's token ids where reasoning is hidden: decode's stream could
    not be followed from prefill's first token. Control: shown, or on completions (no such
    field there), it is disaggregated."""
    assert client(Endpoint.CHAT, include_reasoning=False).alone_reason == "include_reasoning"
    assert client(Endpoint.CHAT, include_reasoning=True).alone_reason is None
    assert client(Endpoint.COMPLETIONS, include_reasoning=False).alone_reason is None


def test_the_first_events_are_vllms_chat_chunks() -> None:
    events = first_events(client(Endpoint.CHAT), prefill_answer(), "chatcmpl-r", ends=False)
    role, token = events
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert token["choices"][0] == {
        "index": 0,
        "delta": {"content": "a"},
        "logprobs": None,
        "finish_reason": None,
        "token_ids": None,
    }
    assert {event["id"] for event in events} == {"chatcmpl-r"}
    assert role["prompt_text"] is None
    # The rendered prompt where asked (return_prompt_text), as prefill's answer has it (before,
    # always None)
    shown = prefill_answer() | {"prompt_text": "<s>hi"}
    asked = first_events(client(Endpoint.CHAT, return_prompt_text=True), shown, "c", ends=False)
    assert asked[0]["prompt_text"] == "<s>hi"
    ended = first_events(
        client(Endpoint.CHAT, stream_options={"include_usage": True}),
        prefill_answer(),
        "chatcmpl-r",
        ends=True,
    )
    assert ended[1]["choices"][0]["finish_reason"] == "length"
    assert ended[2]["usage"] == {"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}
    assert ended[2]["system_fingerprint"] == "fp" and "system_fingerprint" not in ended[1]


def chat_chunk(ids: list[int], delta: dict[str, Any], logprobs: Any = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": None}
    return msgspec.json.encode({"id": "c", "choices": [choice | {"token_ids": ids}]})


@pytest.mark.parametrize("asked", [False, True], ids=["ids_not_asked", "ids_asked"])
def test_a_chat_chunk_sent_only_for_its_token_ids_reaches_a_client_that_asked_for_them(
    asked: bool,
) -> None:
    """vLLM sends a chat chunk whose delta its parser held back (a tool call's or reasoning's
    control tokens) only where token ids are asked: the proxy asks decode for them, so it
    passes such a chunk on only to a client that asked too. A held-back delta with logprobs
    goes to every client, as vLLM sends it."""
    fields = {"return_token_ids": True} if asked else {}
    relay = DecodeRelay(client(Endpoint.CHAT, **fields), (FIRST,))
    assert relay.relay(chat_chunk([FIRST], {"content": "a"})) is not None
    assert (relay.relay(chat_chunk([7], {})) is not None) is asked
    assert relay.relay(chat_chunk([8], {}, {"content": []})) is not None
    assert relay.relay(chat_chunk([9], {"content": ""})) is not None
    # What the client has goes on counting the held-back token (a migration forces it too).
    assert relay.resume() == (FIRST, 7, 8, 9)
