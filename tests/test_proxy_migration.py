"""A decode that fails under an answer: the answer goes on on another decode, forced through the
tokens the client has, and the client sees one answer, no error, no token twice or missing
(stand-in instances: the proxy is under test; real vLLM's forcing is checked in
test_proxy_vllm.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from lmcache_pd.harness.app_thread import AppThread
from lmcache_pd.harness.standin import Fault, Standin, StandinState
from tests.helpers import free_port
from tests.test_proxy import MODEL, Stack, expected_tokens

PROMPT = [4, 2, 9]
TOKENS = 6


@pytest.fixture
def stacks() -> Iterator[Any]:
    made: list[Stack] = []

    def make(decode: list[Any], **settings: Any) -> Stack:
        settings = {"timeouts": {"decode_read_s": 1.0}, "health_interval_s": 60} | settings
        stack = Stack([Standin()], decode, **settings)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.close()


def failing_first(stacks: Any, fault: Fault | None, **settings: Any) -> Stack:
    """A stack whose first decode instance fails as ``fault`` says (None: it was up when the
    proxy started, and is dead when the request comes), its second healthy."""
    if fault is not None:
        return stacks([Standin(StandinState(fault=fault)), Standin()], **settings)
    port = free_port()
    with AppThread(Standin().app(), "127.0.0.1", port):
        return stacks([port, Standin()], **settings)


def answer_text(stack: Stack, stream: bool, chat: bool, **fields: Any) -> str:
    """The client's answer's text, read with the official client (an error raises)."""
    if chat:
        messages = [{"role": "user", "content": "hi"}]
        create: Any = stack.client.chat.completions.create
        request: dict[str, Any] = {"messages": messages}
    else:
        create, request = stack.client.completions.create, {"prompt": PROMPT}
    answer = create(model=MODEL, max_tokens=TOKENS, stream=stream, **request, **fields)
    if not stream:
        choice = answer.choices[0]
        return choice.message.content if chat else choice.text
    parts = []
    for chunk in answer:
        for choice in chunk.choices:
            parts.append((choice.delta.content if chat else choice.text) or "")
    return "".join(parts)


CAUSES = {
    None: "connect",
    Fault.HANG: "timeout",
    Fault.DIE_MID_STREAM: "broken",
    Fault.STATUS_500: "status",
}


@pytest.mark.parametrize("fault", list(CAUSES), ids=str)
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_whose_decode_fails_goes_on_elsewhere_whole(stacks, fault, stream) -> None:
    """Each way a decode fails, streamed and whole: the client gets the whole answer, the one a
    healthy decode gives; the second decode was forced through what the client had (for a
    stream cut after two tokens, both), and the cause is counted."""
    stack = failing_first(stacks, fault)
    assert answer_text(stack, stream, chat=False) == "".join(expected_tokens(PROMPT, TOKENS))
    stack.wait_counted("ok")
    assert stack.metric("lmcache_pd_proxy_decode_migrations_total", cause=CAUSES[fault]) == 1
    [(_, _, body)] = stack.decode[1].state.received
    params = body["kv_transfer_params"]
    assert "disagg_spec" not in params  # nothing was pushed there: it computes the prompt
    had = 2 if fault is Fault.DIE_MID_STREAM and stream else 1
    assert [params["first_tok"], *params.get("next_toks", [])] == [
        int(text.removeprefix(" t")) for text in expected_tokens(PROMPT, had)
    ]


@pytest.mark.parametrize("chat", [False, True])
def test_a_stream_cut_mid_answer_goes_on_from_where_the_client_is(stacks, chat) -> None:
    """Chat and completions, the usage chunk asked: one role chunk, every token once, one usage
    total (the second decode's, which counts the forced tokens)."""
    stack = failing_first(stacks, Fault.DIE_MID_STREAM)
    create: Any = stack.client.chat.completions.create if chat else stack.client.completions.create
    request: dict[str, Any] = (
        {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": PROMPT}
    )
    chunks = list(
        create(
            model=MODEL,
            max_tokens=TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            **request,
        )
    )
    roles = [c for c in chunks if c.choices and chat and c.choices[0].delta.role]
    assert len(roles) == (1 if chat else 0)
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == TOKENS
    texts = [
        (c.choices[0].delta.content if chat else c.choices[0].text) or ""
        for c in chunks
        if c.choices
    ]
    assert len([t for t in texts if t]) == TOKENS  # each token once, in its own chunk


def test_migrations_are_bounded_and_a_refusal_is_counted(stacks) -> None:
    """With ``decode_migrations: 0`` the answer ends with an error as before (the control);
    with every decode failing, it ends with one after the bound."""
    for settings, refused in (({"decode_migrations": 0}, "limit"), ({}, "no_instance")):
        dying = [Standin(StandinState(fault=Fault.STATUS_500)) for _ in range(2)]
        stack = stacks(dying, **settings)
        with pytest.raises(openai.APIError, match="decode instance"):
            answer_text(stack, stream=True, chat=False)
        assert stack.metric("lmcache_pd_proxy_migrations_refused_total", reason=refused) == 1


def test_a_short_prompt_served_alone_goes_on_elsewhere_too(stacks) -> None:
    """Served by decode alone (no first token from prefill), cut after its second token: the
    next decode is forced through the two the client has."""
    stack = failing_first(stacks, Fault.DIE_MID_STREAM, min_disagg_tokens=100)
    assert answer_text(stack, True, chat=False) == "".join(expected_tokens(PROMPT, TOKENS))
    assert stack.prefill[0].state.received == []
    [(_, _, body)] = stack.decode[1].state.received
    forced = [body["kv_transfer_params"]["first_tok"], *body["kv_transfer_params"]["next_toks"]]
    assert len(forced) == 2


def test_a_stream_served_alone_for_a_field_goes_on_only_before_its_first_event(stacks) -> None:
    """``echo`` is served by decode alone, its events passed on unread: before its first event
    it goes on elsewhere; after, the stream ends with an error (counted ``not_plain``)."""
    early = failing_first(stacks, None)
    assert answer_text(early, True, chat=False, echo=True)
    cut = failing_first(stacks, Fault.DIE_MID_STREAM)
    with pytest.raises(openai.APIError, match="decode instance"):
        answer_text(cut, True, chat=False, echo=True)
    assert cut.metric("lmcache_pd_proxy_migrations_refused_total", reason="not_plain") == 1
