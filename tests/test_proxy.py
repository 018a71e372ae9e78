"""The routing proxy over real HTTP, in front of stand-in vLLM servers that can misbehave.

The proxy is what is under test here; the stand-ins (``lmcache_pd/harness/standin.py``) answer
like vLLM's
OpenAI API with tokens that are a function of the prompt, and record what they were sent and
which of their requests the proxy cut. The same proxy in front of real vLLM instances is
tested in ``test_proxy_vllm.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
import zmq

from lmcache_pd import auth, protocol
from lmcache_pd.deploy.vllm_server import wait_until_healthy
from lmcache_pd.harness.app_thread import AppThread, proxy_thread
from lmcache_pd.harness.standin import FINGERPRINT, Fault, Standin, StandinState, next_token
from lmcache_pd.protocol import NOTICE_KEY
from lmcache_pd.proxy.config import proxy_config
from lmcache_pd.proxy.routing import NoHealthyInstance, Pool, Role, Upstream
from tests.helpers import free_port, metric_sample, wait_for

MODEL = "tiny"


Instance = Standin | int | None


class Stack:
    """Stand-in prefill and decode servers and a proxy in front of them. An instance given as
    None is dead (nobody listens on its port); one given as a port is the test's to run."""

    def __init__(
        self, prefill: list[Instance], decode: list[Instance], alloc_port: int = 2, **settings
    ):
        """``alloc_port``: where every decode instance's KV alloc channel is said to be."""
        self._exit = ExitStack()
        self.prefill, self.decode = prefill, decode
        self.urls = []
        for instance in (*prefill, *decode):
            port = instance if isinstance(instance, int) else free_port()
            if isinstance(instance, Standin):
                self._exit.enter_context(AppThread(instance.app(), "127.0.0.1", port))
            self.urls.append(f"http://127.0.0.1:{port}")
        config = proxy_config(
            {
                # Every prompt here is short: all are disaggregated unless a test says otherwise.
                "min_disagg_tokens": 0,
                "model": MODEL,
                "port": free_port(),
                "prefill": [{"url": url} for url in self.urls[: len(prefill)]],
                "decode": [
                    {
                        "url": url,
                        "receiver_host": "127.0.0.1",
                        "init_port": 1,
                        "alloc_port": alloc_port,
                    }
                    for url in self.urls[len(prefill) :]
                ],
                **settings,
            }
        )
        self.proxy = self._exit.enter_context(proxy_thread(config))
        self.client = openai.OpenAI(
            base_url=f"{self.proxy.url}/v1", api_key="none", max_retries=0, timeout=30
        )

    def post(self, path: str, timeout: float = 30, **kwargs: Any) -> httpx.Response:
        return httpx.post(f"{self.proxy.url}{path}", timeout=timeout, **kwargs)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the proxy's /metrics (0 if absent)."""
        return metric_sample(self.proxy.url, name, **labels)

    def wait_counted(self, outcome: str, endpoint: str = "/v1/completions") -> None:
        """Until the proxy has counted one request of ``endpoint`` ending in ``outcome``: it
        counts when its handler ends, which can be just after the client read a stream's last
        chunk (a read at once failed once in a full run)."""
        wait_for(
            lambda: (
                self.metric("lmcache_pd_proxy_requests_total", endpoint=endpoint, outcome=outcome)
                == 1
            ),
            5,
            f"one {endpoint} request counted {outcome}",
        )

    def close(self) -> None:
        self._exit.close()


@pytest.fixture
def stacks() -> Iterator[Any]:
    made: list[Stack] = []

    def make(prefill=None, decode=None, **settings) -> Stack:
        stack = Stack(prefill or [Standin()], decode or [Standin()], **settings)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.close()


def expected_tokens(prompt: list[int], count: int) -> list[str]:
    """What one greedy instance would answer: the stand-in's tokens continue the prompt."""
    context, texts = list(prompt), []
    for _ in range(count):
        token = next_token(context)
        context.append(token)
        texts.append(f" t{token}")
    return texts


# ---- routing ----


def test_pick_prefers_fewest_outstanding_then_goes_round_robin() -> None:
    members = [Upstream(f"http://h{i}:1", Role.PREFILL) for i in range(3)]
    pool = Pool(Role.PREFILL, members)
    assert [pool.pick() for _ in range(4)] == [members[0], members[1], members[2], members[0]]
    members[0].outstanding = members[1].outstanding = 2
    assert pool.pick() is members[2]
    assert pool.pick(exclude=[members[2]]) in members[:2]


def test_pick_skips_instances_marked_down_and_fails_when_none_is_left() -> None:
    members = [Upstream(f"http://h{i}:1", Role.DECODE) for i in range(2)]
    pool = Pool(Role.DECODE, members)
    members[0].mark(False, "test")
    assert {pool.pick() for _ in range(3)} == {members[1]}
    with pytest.raises(NoHealthyInstance):
        pool.pick(exclude=[members[1]])


def test_cache_aware_routing_keeps_a_prompts_extensions_on_its_decode_over_real_http(
    stacks,
) -> None:
    """``routing: cache_aware`` (vLLM's router policy, for comparison) through the proxy: a
    follow-up that extends a prompt goes to the decode that prompt went to, a new prompt to the
    other (sent less); control: ``routing: load`` sends the follow-up where round-robin is."""

    def decode_of(stack: Stack, prompt: list[int]) -> int:
        """The index of the decode stand-in the request went to."""
        before = [len(standin.state.received) for standin in stack.decode]
        stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        after = [len(standin.state.received) for standin in stack.decode]
        [went] = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
        return went

    history, fresh, fresh_too = (list(range(n, n + 300)) for n in (100, 1_000, 3_000))
    for routing, same in (("cache_aware", True), ("load", False)):
        stack = stacks(decode=[Standin(), Standin()], routing=routing)
        first = decode_of(stack, history)
        assert decode_of(stack, fresh) != first
        decode_of(stack, fresh_too)
        follow_up = history + list(range(2_000, 2_050))
        assert (decode_of(stack, follow_up) == first) is same, routing


# ---- one request's life ----


@pytest.mark.parametrize("stream", [False, True])
def test_decode_is_sent_the_clients_own_request_going_on_from_prefills_token(
    stacks, stream
) -> None:
    stack = stacks()
    prompt = [5, 6, 7, 8]
    if stream:
        chunks = list(
            stack.client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=5,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish == [None] * 4 + ["length"]
        usage = chunks[-1].usage
        assert len({c.id for c in chunks}) == 1
    else:
        answer = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=5)
        text, usage = answer.choices[0].text, answer.usage
        assert answer.choices[0].finish_reason == "length"
    assert text == "".join(expected_tokens(prompt, 5))
    assert (usage.prompt_tokens, usage.completion_tokens) == (4, 5)
    [(_, _, to_prefill)] = stack.prefill[0].state.received
    [(_, _, to_decode)] = stack.decode[0].state.received
    first = next_token(prompt)
    assert to_prefill["max_tokens"] == 1 and to_prefill["stream"] is False
    # The client's request as it sent it, but for what names prefill's token and shows it.
    params = to_decode.pop("kv_transfer_params")
    assert to_decode.pop("return_token_ids") is True
    sent = {"model": MODEL, "prompt": prompt, "max_tokens": 5}
    if stream:
        sent |= {"stream": True, "stream_options": {"include_usage": True}}
    assert to_decode == sent
    spec = to_prefill["kv_transfer_params"]["disagg_spec"]
    assert params == {"disagg_spec": spec, "first_tok": first}
    assert spec["req_id"].startswith("pd-")
    stack.wait_counted("ok")


def test_events_cut_across_network_reads_are_joined_before_they_are_read(stacks) -> None:
    """Decode's events each arrive in two reads, the first ending mid-line."""
    stack = stacks(decode=[Standin(StandinState(split_s=0.01))])
    prompt = [9, 10, 11]
    chunks = list(
        stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "".join(
        expected_tokens(prompt, 4)
    )
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_upstream_connections_are_reused_across_requests(stacks) -> None:
    """Decode's body ends a moment after its [DONE], as vLLM's can: read to the end anyway, or
    the connection is not pooled."""
    stack = stacks(decode=[Standin(StandinState(end_delay_s=0.05))])
    for stream in (True, False, True, True, False):
        request = {"model": MODEL, "prompt": [1, 2], "max_tokens": 4}
        if stream:
            list(stack.client.completions.create(**request, stream=True))
        else:
            stack.client.completions.create(**request)
    assert len(stack.decode[0].state.received) == 5
    assert len(stack.decode[0].state.peers) == 1
    assert len(stack.prefill[0].state.peers) == 1


def test_chat_answers_in_chat_shape_streamed_and_whole(stacks) -> None:
    stack = stacks()
    messages = [{"role": "user", "content": "hello"}]
    whole = stack.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
    chunks = list(
        stack.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=3, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert whole.choices[0].message.content == streamed
    assert whole.object == "chat.completion" and chunks[0].object == "chat.completion.chunk"
    assert whole.usage.completion_tokens == 3
    # both were asked the chat request (each templates it)
    assert [path for _, path, _ in stack.prefill[0].state.received] == ["/v1/chat/completions"] * 2
    assert [path for _, path, _ in stack.decode[0].state.received] == ["/v1/chat/completions"] * 2


def test_one_token_requests_never_reach_decode_nor_push_kv(stacks) -> None:
    stack = stacks()
    answer = stack.client.completions.create(model=MODEL, prompt=[9, 9], max_tokens=1)
    assert answer.choices[0].text == expected_tokens([9, 9], 1)[0]
    assert answer.choices[0].finish_reason == "length"
    [(_, _, to_prefill)] = stack.prefill[0].state.received
    assert "disagg_spec" not in to_prefill["kv_transfer_params"]
    assert stack.decode[0].state.received == []


@pytest.mark.parametrize("stream", [False, True])
def test_eos_as_first_token_ends_the_answer_without_decode(stacks, stream) -> None:
    stack = stacks(prefill=[Standin(StandinState(fault=Fault.EOS_FIRST))])
    request = {"model": MODEL, "prompt": [1, 2], "max_tokens": 8}
    if stream:
        chunks = list(stack.client.completions.create(**request, stream=True))
        assert [c.choices[0].finish_reason for c in chunks] == ["stop"]
    else:
        answer = stack.client.completions.create(**request)
        assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("", "stop")
        assert answer.usage.completion_tokens == 1
    assert stack.prefill[0].state.received[0][2]["kv_transfer_params"]["disagg_spec"]
    assert stack.decode[0].state.received == []


# ---- model names: LoRA adapters ----


def test_every_name_the_instances_serve_is_served_and_no_other(stacks) -> None:
    """An adapter the instances list (``--lora-modules``) is served, disaggregated (placed by
    its own prefix cache: ``test_kv_index.py``); a name nobody serves gets vLLM's 404 at the
    door, with no instance asked to compute; one loaded at run time through the proxy reaches
    every instance and is served at once."""
    prefill, decode = (Standin(StandinState(adapters=["tuned"])) for _ in range(2))
    stack = stacks(prefill=[prefill], decode=[decode])
    answer = stack.client.completions.create(model="tuned", prompt=[1, 2, 3], max_tokens=3)
    assert answer.model == "tuned" and len(answer.choices[0].text.split()) == 3
    asked = [(path, body["model"]) for _, path, body in decode.state.received]
    assert asked == [("/v1/completions", "tuned")]
    with pytest.raises(openai.NotFoundError, match=r"The model `late` does not exist\. Valid"):
        stack.client.completions.create(model="late", prompt=[1, 2, 3], max_tokens=3)
    assert len(prefill.state.received) == 1  # the 404 came from the door
    loaded = stack.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "/x"})
    assert loaded.status_code == 200 and "added" in loaded.text
    assert prefill.state.adapters == decode.state.adapters == ["tuned", "late"]
    answer = stack.client.completions.create(model="late", prompt=[1, 2, 3], max_tokens=3)
    assert answer.model == "late"
    unnamed = stack.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2})
    assert unnamed.status_code == 200  # no model: the base model's, as vLLM takes it


def test_an_instance_back_up_is_given_the_adapters_loaded_at_run_time_before_it_serves(
    stacks,
) -> None:
    """``serve`` starts a dead instance again with its command line's adapters only: before
    the proxy marks it up again, it loads on it those loaded at run time through the proxy and
    not unloaded since. One that fails a load stays down, counted; the instance never down is
    given nothing again (the control)."""
    prefill, decode = Standin(), Standin()
    stack = stacks(prefill=[prefill], decode=[decode], health_interval_s=0.05)
    for name in ("late", "gone"):
        body = {"lora_name": name, "lora_path": f"/{name}"}
        assert stack.post("/v1/load_lora_adapter", json=body).status_code == 200
    assert stack.post("/v1/unload_lora_adapter", json={"lora_name": "gone"}).status_code == 200
    decode.state.healthy = False  # stopped, then started again without "late"
    wait_for(lambda: httpx.get(f"{stack.proxy.url}/health").status_code == 503, what="down")
    decode.state.adapters.clear()
    decode.state.refuse_loads = True
    decode.state.healthy = True
    failures = "lmcache_pd_proxy_adapter_replay_failures_total"
    wait_for(lambda: stack.metric(failures) >= 1, what="a failed load counted")
    assert httpx.get(f"{stack.proxy.url}/health").status_code == 503  # still down
    decode.state.refuse_loads = False
    wait_for(lambda: httpx.get(f"{stack.proxy.url}/health").status_code == 200, what="up")
    assert decode.state.adapters == ["late"]
    answer = stack.client.completions.create(model="late", prompt=[1, 2, 3], max_tokens=3)
    assert answer.model == "late"
    loads = [body for _, path, body in prefill.state.received if path == "/v1/load_lora_adapter"]
    assert [body["lora_name"] for body in loads] == ["late", "gone"]  # asked once each


# ---- bad input ----


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{not json", 400, "malformed JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (b'{"model": "nope", "prompt": "x"}', 404, "does not exist"),
        (b'{"model": 7, "prompt": "x"}', 400, "model"),
        (b'{"model": "tiny"}', 400, "prompt"),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
        (b'{"model": "tiny", "prompt": "x", "n": 0}', 400, "n"),
        (b'{"model": "tiny", "prompt": ["a", [-1]]}', 400, "token ids"),
        (b'{"model": "tiny", "prompt": [1, -3]}', 400, "token ids"),
        (
            b'{"model": "tiny", "prompt": "x", "max_tokens": 2, "min_tokens": 3}',
            400,
            "min_tokens must be less than or equal to max_tokens=2, got 3.",
        ),
    ],
)
def test_bad_requests_get_a_clear_error_and_the_proxy_keeps_serving(
    stacks, body: bytes, status: int, says: str
) -> None:
    stack = stacks()
    response = stack.post("/v1/completions", content=body)
    assert response.status_code == status
    assert says in response.json()["error"]["message"]
    assert stack.prefill[0].state.received == []
    assert stack.client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices
    assert stack.metric(
        "lmcache_pd_proxy_requests_total", endpoint="/v1/completions", outcome="bad_request"
    )


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"n": 2}, "n"),
        ({"prompt": [[5, 6, 7], [8, 9]], "echo": True}, "echo"),
        ({"echo": True}, "echo"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"suffix": "x"}, "suffix"),
        ({"use_beam_search": True}, "beam_search"),
        ({"prompt": None, "prompt_embeds": "AAAA"}, "prompt_embeds"),
    ],
)
def test_fields_no_first_token_can_serve_go_to_decode_alone_unchanged(
    stacks, fields: dict[str, Any], reason: str
) -> None:
    """More than one choice, a prompt computed where it is answered (prompt logprobs, echo;
    a batch of them too), a prompt of embeddings (no token ids to key its KV): decode gets the
    client's own request as it was sent, prefill nothing, and the reason is counted."""
    stack = stacks()
    body = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 3} | fields
    response = stack.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert stack.prefill[0].state.received == []
    [(_, _, to_decode)] = stack.decode[0].state.received
    assert to_decode == body
    name = "lmcache_pd_proxy_not_disaggregated_total"
    assert stack.metric(name, reason=reason) == 1
    assert stack.metric("lmcache_pd_proxy_served_alone_total") == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("prompt", [[4, 2], [[4, 2], [5, 3]]], ids=["one", "batch"])
@pytest.mark.parametrize("min_disagg_tokens", [0, 100], ids=["disaggregated", "alone"])
@pytest.mark.parametrize(
    ("header", "field", "name"),
    [("by-header", "by-field", "by-header"), (None, "by-field", "by-field")],
    ids=["header", "field"],
)
def test_an_answer_is_named_as_the_client_named_its_request(
    stacks,
    header: str | None,
    field: str,
    name: str,
    min_disagg_tokens: int,
    prompt: list,
    stream: bool,
) -> None:
    """vLLM names its answer (and every event of it) ``cmpl-NAME`` after the request's
    ``X-Request-Id`` header, else its ``request_id`` field: the proxy names its requests to
    prefill and decode so (the stand-ins name answers as vLLM does); before, every answer was
    named after the proxy's own id (``cmpl-pd-...``)."""
    stack = stacks(min_disagg_tokens=min_disagg_tokens)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "stream": stream}
    headers = {} if header is None else {"X-Request-Id": header}
    response = stack.post("/v1/completions", json=body | {"request_id": field}, headers=headers)
    assert response.status_code == 200, response.text
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
        ids = {json.loads(event)["id"] for event in events}
    else:
        ids = {response.json()["id"]}
    assert ids == {f"cmpl-{name}"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_batch_of_prompts_is_disaggregated_prompt_by_prompt_and_answered_as_one(
    stacks, stream: bool
) -> None:
    """Each prompt of a batch goes to prefill and decode as a request of its own; the answer
    is vLLM's for a batch: a choice per prompt numbered by its place, one id, usage summed (a
    stream's once, at its end), one ``[DONE]``."""
    stack = stacks()
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = stack.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events.pop() == "[DONE]" and "[DONE]" not in events
        chunks = [json.loads(event) for event in events]
        *tokens, last = chunks
        assert last["choices"] == []
        usage = last["usage"]
        texts = {
            place: "".join(
                c["choices"][0]["text"] for c in tokens if c["choices"][0]["index"] == place
            )
            for place in (0, 1)
        }
        assert len({c["id"] for c in chunks}) == 1
        assert all(c["choices"] for c in tokens)
    else:
        answer = response.json()
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        texts = {c["index"]: c["text"] for c in answer["choices"]}
        usage = answer["usage"]
    assert texts == {place: "".join(expected_tokens(p, 3)) for place, p in enumerate(prompts)}
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (7, 6)
    to_prefill = [sent for _, _, sent in stack.prefill[0].state.received]
    to_decode = [sent for _, _, sent in stack.decode[0].state.received]
    assert sorted(sent["prompt"] for sent in to_prefill) == sorted(prompts)
    assert sorted(sent["prompt"] for sent in to_decode) == sorted(prompts)
    assert all(sent["kv_transfer_params"]["first_tok"] for sent in to_decode)
    assert stack.metric("lmcache_pd_proxy_not_disaggregated_total", reason="batch") == 0
    stack.wait_counted("ok")


def test_vllms_other_routes_are_forwarded_to_an_instance_as_they_are(stacks) -> None:
    """/tokenize, /detokenize and /version: nothing to disaggregate, answered by an instance
    as it answers them (its status too), with a body the instances' guard would refuse
    refused here."""
    stack = stacks()
    asked = {"model": MODEL, "prompt": "abc"}
    response = stack.post("/tokenize", json=asked)
    assert response.json() == {"count": 3, "tokens": [97, 98, 99], "max_model_len": 4096}
    assert httpx.get(f"{stack.proxy.url}/version", timeout=5).json() == {"version": FINGERPRINT}
    assert stack.post("/detokenize", json={"model": MODEL, "tokens": [1]}).status_code == 404
    deep = b'{"model": "tiny", "prompt": ' + b"[" * 100 + b"]" * 100 + b"}"
    assert stack.post("/tokenize", content=deep).status_code == 400
    received = [
        path for standin in (*stack.prefill, *stack.decode) for _, path, _ in standin.state.received
    ]
    assert sorted(received) == ["/tokenize", "/version"]


def test_the_responses_api_is_served_by_decode_alone_streamed_as_it_comes(stacks) -> None:
    """/v1/responses goes to a decode instance, never prefill, and comes back as it answered:
    one JSON body, or its SSE events with vLLM's ``event:`` lines, byte for byte; counted as
    served without disaggregation."""
    stack = stacks()
    asked = {"model": MODEL, "input": "hi", "max_output_tokens": 3}
    whole = stack.post("/v1/responses", json=asked)
    assert whole.status_code == 200 and whole.json()["object"] == "response"
    streamed = stack.post("/v1/responses", json=asked | {"stream": True})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert streamed.text.startswith("event: response.output_text.delta\ndata: {")
    assert streamed.text.count("event: ") == 2
    assert stack.prefill[0].state.received == []
    assert [path for _, path, _ in stack.decode[0].state.received] == ["/v1/responses"] * 2
    name = "lmcache_pd_proxy_not_disaggregated_total"
    assert stack.metric(name, reason="responses") == 2
    missing = httpx.get(f"{stack.proxy.url}/v1/responses/resp_1", timeout=5)
    assert missing.status_code == 404  # what the instance answered: no store


def test_a_body_over_the_limit_is_refused(stacks) -> None:
    stack = stacks(max_body_bytes=4096)
    response = stack.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 10_000})
    assert response.status_code == 413


# ---- faults ----


def test_dead_prefill_is_retried_once_on_another_and_marked_down(stacks) -> None:
    stack = stacks(prefill=[None, Standin()], health_interval_s=60)
    for _ in range(3):  # whichever is picked first, every request is answered
        answer = stack.client.completions.create(model=MODEL, prompt=[3], max_tokens=3)
        assert answer.choices[0].text == "".join(expected_tokens([3], 3))
    assert stack.metric("lmcache_pd_proxy_instance_up", role="prefill", instance=stack.urls[0]) == 0


def test_no_live_prefill_is_a_502_within_the_connect_deadline(stacks) -> None:
    stack = stacks(prefill=[None, None], health_interval_s=60)
    started = time.monotonic()
    response = stack.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code in (502, 503)
    assert time.monotonic() - started < 5
    assert stack.metric("lmcache_pd_proxy_prefill_retries_total") <= 1


def test_prefill_500_is_retried_then_reported(stacks) -> None:
    broken = StandinState(fault=Fault.STATUS_500)
    stack = stacks(prefill=[Standin(broken), Standin(StandinState(fault=Fault.STATUS_500))])
    response = stack.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert "prefill instance failed" in message and "127.0.0.1" not in message
    assert stack.metric("lmcache_pd_proxy_prefill_retries_total") == 1


def stack_with_failing_decode(stacks, decode: Fault | None, **settings: Any) -> Stack:
    """A stack whose decode misbehaves as ``decode`` says (None: it was up when last checked,
    and is dead when the request comes), with a 1 s read deadline."""
    settings |= {"timeouts": {"decode_read_s": 1.0}, "health_interval_s": 60}
    if decode is None:
        port = free_port()
        with AppThread(Standin().app(), "127.0.0.1", port):
            return stacks(decode=[port], **settings)
    return stacks(decode=[Standin(StandinState(fault=decode))], **settings)


@pytest.mark.parametrize(
    "decode", [None, Fault.HANG, Fault.DIE_MID_STREAM, Fault.STATUS_500], ids=str
)
@pytest.mark.parametrize("stream", [False, True])
def test_failed_decode_is_a_clear_error_within_the_read_deadline(stacks, decode, stream) -> None:
    stack = stack_with_failing_decode(stacks, decode)
    started = time.monotonic()
    request = {"model": MODEL, "prompt": [4, 2], "max_tokens": 6}
    with pytest.raises(openai.APIError) as failure:
        if stream:
            list(stack.client.completions.create(**request, stream=True))
        else:
            stack.client.completions.create(**request)
    assert time.monotonic() - started < 5
    assert "decode instance" in str(failure.value)
    stack.wait_counted("decode_failed")
    # and the next request is served
    healthy = stacks()
    assert healthy.client.completions.create(model=MODEL, prompt=[1], max_tokens=2).choices


# ---- selective disaggregation: short prompts served by decode alone ----


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_prompt_under_min_disagg_tokens_is_served_by_decode_alone(
    stacks, stream: bool, endpoint: str
) -> None:
    """The client's own request goes to decode (asking the token ids that show where a stream
    is, nulled for the client), no KV is involved, and decode's answer reaches the client as
    decode wrote it; a prompt at the threshold is disaggregated."""
    stack = stacks(min_disagg_tokens=8)
    if endpoint == "chat":
        short: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}]}
        long: dict[str, Any] = {"messages": [{"role": "user", "content": "x" * 200}]}
        create = stack.client.chat.completions.create
    else:
        short, long = {"prompt": list(range(5, 12))}, {"prompt": list(range(5, 13))}
        create = stack.client.completions.create
    answer = create(model=MODEL, max_tokens=3, stream=stream, **short)
    chunks = list(answer) if stream else [answer]
    assert stack.prefill[0].state.received == []
    [(_, path, to_decode)] = stack.decode[0].state.received
    assert path == f"/v1/{'chat/' if endpoint == 'chat' else ''}completions"
    asked = {"model": MODEL, "max_tokens": 3, "stream": stream, "return_token_ids": True}
    assert to_decode == asked | short
    assert chunks[-1].system_fingerprint == FINGERPRINT  # decode's own answer
    assert stack.metric("lmcache_pd_proxy_served_alone_total") == 1
    stack.wait_counted("ok", path)
    # Control: a prompt of min_disagg_tokens goes through prefill first.
    answer = create(model=MODEL, max_tokens=3, stream=stream, **long)
    if stream:
        list(answer)
    assert len(stack.prefill[0].state.received) == 1
    assert stack.metric("lmcache_pd_proxy_served_alone_total") == 1


@pytest.mark.parametrize(
    ("decode", "stream"),
    [
        (None, False),
        (Fault.HANG, True),
        (Fault.STATUS_500, False),
        (Fault.STATUS_500, True),
        (Fault.DIE_MID_STREAM, True),  # a whole answer has no middle to die in
    ],
    ids=str,
)
def test_decode_failing_a_request_it_serves_alone_is_a_clear_error(stacks, decode, stream) -> None:
    stack = stack_with_failing_decode(stacks, decode, min_disagg_tokens=100)
    started = time.monotonic()
    with pytest.raises(openai.APIError) as failure:
        answer = stack.client.completions.create(
            model=MODEL, prompt=[4, 2], max_tokens=6, stream=stream
        )
        if stream:
            list(answer)
    assert time.monotonic() - started < 5
    assert "decode instance" in str(failure.value)
    stack.wait_counted("decode_failed")
    assert stack.prefill[0].state.received == []


def vllms_refusal(
    max_model_len: int, asked: int, param: str, prompt: list[int] | None = None
) -> dict[str, Any]:
    """What vLLM 0.32 answers a request its length checks refuse, made by its own code: the
    checks (``TokenizeParams``: the output tokens asked, then the prompt's) and the answer its
    error handler makes of the error (``create_error_response``)."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.params import TokenizeParams

    try:
        params = TokenizeParams(
            max_total_tokens=max_model_len,
            max_output_tokens=asked,
            max_total_tokens_param="max_model_len",
            max_output_tokens_param=param,
        )
        if prompt is not None:
            params.apply_post_tokenization(None, {"prompt_token_ids": prompt})
    except VLLMValidationError as exc:
        return create_error_response(exc).model_dump()
    raise AssertionError("vLLM takes this request")


@pytest.mark.parametrize(
    ("path", "fields", "expected"),
    [
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 65}, (65, "max_tokens", None)),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100},
            (100, "max_completion_tokens", None),
        ),
        (
            "/v1/completions",
            {"prompt": list(range(65)), "max_tokens": 4},
            (4, "max_tokens", list(range(65))),
        ),
        (
            "/v1/completions",
            {"prompt": [[1, 2], list(range(70))], "max_tokens": 4},
            (4, "max_tokens", list(range(70))),
        ),
    ],
    ids=["max_tokens", "max_completion_tokens", "prompt_one_past", "prompt_of_a_batch"],
)
def test_a_request_past_the_models_length_gets_vllms_400_and_no_prefill(
    stacks, path: str, fields: dict[str, Any], expected: tuple
) -> None:
    """Prefill is asked for one token, so a ``max_tokens`` past the model's length (64 here, as
    the instances' ``/v1/models`` says) passed there: the prompt was computed and pushed, then
    decode refused it (its answer passed on, ``test_decode_refusing_what_prefill_took_...``).
    Now the proxy refuses it first, as vLLM does and in its words (made by vLLM's own code,
    ``vllms_refusal``), and so a prompt of token ids past the length; no instance is asked.
    The control: a prompt and output that only together pass the length are served (vLLM cuts
    ``max_tokens`` to what is left)."""
    prefill = Standin(StandinState(max_model_len=64))
    stack = stacks(prefill=[prefill], decode=[Standin(StandinState(max_model_len=64))])
    response = stack.post(path, json={"model": MODEL, **fields})
    assert (response.status_code, response.json()) == (400, vllms_refusal(64, *expected))
    assert prefill.state.received == []
    stack.wait_counted("bad_request", path)
    served = stack.post(
        "/v1/completions", json={"model": MODEL, "prompt": list(range(60)), "max_tokens": 10}
    )
    assert served.status_code == 200 and len(prefill.state.received) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_decode_refusing_what_prefill_took_passes_its_answer_on(stacks, stream) -> None:
    """vLLM checks some limits (``max_tokens`` past the model's length) only where more than one
    token is asked: prefill serves its one, decode refuses. The client gets decode's own refusal
    (its 400, or as the stream's last event), not a 502."""
    stack = stack_with_failing_decode(stacks, Fault.STATUS_400, min_disagg_tokens=0)
    if stream:
        chunks = stack.client.completions.create(
            model=MODEL, prompt=[4, 2], max_tokens=6, stream=True
        )
        with pytest.raises(openai.APIError, match="refused by the stand-in"):
            list(chunks)
    else:
        with pytest.raises(openai.BadRequestError, match="refused by the stand-in"):
            stack.client.completions.create(model=MODEL, prompt=[4, 2], max_tokens=6)
    assert stack.prefill[0].state.received  # prefill served its token first
    stack.wait_counted("upstream_rejected")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stream_prefill_refuses_is_answered_as_decode_answers_the_clients_own_request(
    stacks, stream: bool
) -> None:
    """vLLM refuses some fields only once its stream is open (an error event in a 200
    stream), and prefill, asked without streaming, answers 400: a streamed request prefill
    refuses goes to decode unchanged, whose answer (here the stand-in's stream) the client
    gets; before, the client got prefill's 400. A whole one gets prefill's refusal (control)."""
    stack = stacks(prefill=[Standin(StandinState(fault=Fault.STATUS_400))], min_disagg_tokens=0)
    body = {"model": MODEL, "prompt": [4, 2], "max_tokens": 3, "stream": stream}
    response = stack.post("/v1/completions", json=body)
    to_decode = [sent for _, _, sent in stack.decode[0].state.received]
    if not stream:
        assert response.status_code == 400 and to_decode == []
        return
    assert response.status_code == 200, response.text
    assert response.text.rstrip().endswith("data: [DONE]")
    assert to_decode == [body]
    name = "lmcache_pd_proxy_not_disaggregated_total"
    assert stack.metric(name, reason="prefill_refused") == 1


def test_decode_refusing_a_request_it_serves_alone_passes_its_answer_on(stacks) -> None:
    stack = stacks(decode=[Standin(StandinState(fault=Fault.STATUS_400))], min_disagg_tokens=100)
    with pytest.raises(openai.BadRequestError, match="refused by the stand-in"):
        stack.client.completions.create(model=MODEL, prompt=[4, 2], max_tokens=6)
    assert stack.metric(
        "lmcache_pd_proxy_requests_total", endpoint="/v1/completions", outcome="upstream_rejected"
    )


def test_client_that_disconnects_mid_stream_cancels_decode(stacks) -> None:
    decode = Standin(StandinState(token_delay_s=0.2))
    stack = stacks(decode=[decode])
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{stack.proxy.url}/v1/completions", json=body) as response:
        events = (line for line in response.iter_lines() if line)
        assert all(next(events).startswith("data: ") for _ in range(2))
    wait_for(lambda: decode.state.cancelled == 1, 5, "decode's stream cut")
    assert decode.state.in_flight == 0 and stack.prefill[0].state.in_flight == 0
    wait_for(
        lambda: (
            stack.metric(
                "lmcache_pd_proxy_requests_total",
                endpoint="/v1/completions",
                outcome="client_disconnected",
            )
            == 1
        ),
        5,
        "the disconnect counted",
    )


def test_client_that_disconnects_during_prefill_cancels_it_and_never_reaches_decode(
    stacks,
) -> None:
    prefill = Standin(StandinState(first_delay_s=5))
    stack = stacks(prefill=[prefill])
    with pytest.raises(httpx.ReadTimeout):
        stack.post("/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=0.5)
    wait_for(lambda: prefill.state.cancelled == 1, 5, "prefill's request cut")
    assert prefill.state.in_flight == 0
    time.sleep(0.2)
    assert stack.decode[0].state.received == []


# ---- first-token notices: decode asked on prefill's engine's word, before its answer ----


def _text_of(stack: Stack, prompt: list[int], max_tokens: int, stream: bool) -> str:
    if not stream:
        answer = stack.client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens)
        return answer.choices[0].text
    chunks = stack.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True
    )
    return "".join(c.choices[0].text for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("notice", [0, None], ids=["notice", "no_notice"])
def test_decode_is_asked_on_prefills_first_token_notice_before_its_answer(
    stacks, stream, notice
) -> None:
    prefill = Standin(StandinState(first_delay_s=0.5, notice_shift=notice))
    stack = stacks(prefill=[prefill])
    prompt = [5, 6, 7, 8]
    assert _text_of(stack, prompt, 5, stream) == "".join(expected_tokens(prompt, 5))
    [(prefill_asked, _, to_prefill)] = prefill.state.received
    [(decode_asked, _, to_decode)] = stack.decode[0].state.received
    assert to_prefill["kv_transfer_params"][NOTICE_KEY].startswith("tcp://127.0.0.1:")
    assert to_decode["prompt"] == prompt
    assert to_decode["kv_transfer_params"]["first_tok"] == next_token(prompt)
    metric = "lmcache_pd_proxy_first_token_notices_total"
    if notice is None:  # the control: decode waits for prefill's answer
        assert decode_asked - prefill_asked >= 0.5
        assert stack.metric(metric, outcome="after_answer") == 1
    else:
        assert decode_asked - prefill_asked < 0.4
        assert stack.metric(metric, outcome="used") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_notice_that_disagrees_with_prefills_answer_is_never_what_decode_continues(
    stacks, stream
) -> None:
    prefill = Standin(StandinState(first_delay_s=0.5, notice_shift=1))
    decode = Standin(StandinState(token_delay_s=0.2))
    stack = stacks(prefill=[prefill], decode=[decode])
    prompt = [5, 6, 7, 8]
    assert _text_of(stack, prompt, 5, stream) == "".join(expected_tokens(prompt, 5))
    first = next_token(prompt)
    asked = [body["kv_transfer_params"]["first_tok"] for _, _, body in decode.state.received]
    assert asked == [first + 1, first]
    assert decode.state.cancelled == 1
    metric = "lmcache_pd_proxy_first_token_notices_total"
    assert stack.metric(metric, outcome="mismatched") == 1


def test_an_answer_that_ends_at_its_first_token_cancels_decode_asked_on_its_notice(
    stacks,
) -> None:
    prefill = Standin(StandinState(first_delay_s=0.5, notice_shift=0, fault=Fault.EOS_FIRST))
    decode = Standin(StandinState(first_delay_s=2))  # still computing when prefill answers
    stack = stacks(prefill=[prefill], decode=[decode])
    answer = stack.client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=5)
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == ("", "stop")
    assert len(decode.state.received) == 1
    wait_for(lambda: decode.state.cancelled == 1, 5, "decode's stream cut")
    metric = "lmcache_pd_proxy_first_token_notices_total"
    assert stack.metric(metric, outcome="unused") == 1


def test_garbage_on_the_notice_port_is_ignored_and_notices_keep_working(stacks) -> None:
    prefill = Standin(StandinState(first_delay_s=0.3, notice_shift=0))
    stack = stacks(prefill=[prefill])
    prompt = [5, 6, 7, 8]
    assert _text_of(stack, prompt, 3, False) == "".join(expected_tokens(prompt, 3))
    address = prefill.state.received[0][2]["kv_transfer_params"][NOTICE_KEY]
    context = zmq.Context()
    try:
        sender = context.socket(zmq.PUSH)
        sender.connect(address)
        sender.send(b"\xc1 not msgpack")
        sender.send(b"\x93\x01\x02")  # an array, but not a notice
        sender.close(linger=1000)
    finally:
        context.term()
    assert _text_of(stack, prompt, 3, True) == "".join(expected_tokens(prompt, 3))
    metric = "lmcache_pd_proxy_first_token_notices_total"
    assert stack.metric(metric, outcome="used") == 2


def test_a_stranger_refused_at_the_notice_board_is_counted_on_metrics(
    stacks, tmp_path: Path
) -> None:
    """Review 55.7's last piece: the board admits producers' keys alone, and a key of no role
    that knocks (it holds the board's public key, as anyone may) shows on the proxy's /metrics."""
    secret = auth.generate_secret()
    (tmp_path / "secret").write_text(secret)
    port = free_port()
    stack = stacks(secret_file=str(tmp_path / "secret"), notice_port=port)
    assert stack.metric("lmcache_pd_proxy_notice_peers_refused_total") == 0
    server = auth.DeploymentKeys.from_secret(secret, auth.Role.PRODUCER).server_publics
    context = zmq.Context()
    stranger = context.socket(zmq.DEALER)
    try:
        stranger.setsockopt(zmq.LINGER, 0)
        stranger.curve_serverkey = server[auth.Door.NOTICES]
        stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
        stranger.connect(f"tcp://127.0.0.1:{port}")
        stranger.send(b"knock")
        wait_for(
            lambda: stack.metric("lmcache_pd_proxy_notice_peers_refused_total") >= 1,
            30,
            "the refusal counted",
        )
    finally:
        stranger.close()
        context.term()


def test_a_client_that_leaves_after_the_notice_cancels_prefill_and_decode(stacks) -> None:
    prefill = Standin(StandinState(first_delay_s=5, notice_shift=0))
    decode = Standin(StandinState(token_delay_s=0.2))
    stack = stacks(prefill=[prefill], decode=[decode])
    with pytest.raises(httpx.ReadTimeout):
        stack.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6]}, timeout=0.5)
    wait_for(lambda: prefill.state.cancelled == 1, 5, "prefill's request cut")
    wait_for(lambda: decode.state.cancelled == 1, 5, "decode's stream cut")
    assert prefill.state.in_flight == decode.state.in_flight == 0


def test_health_checks_mark_an_instance_down_and_back_up(stacks) -> None:
    port = free_port()
    stack = stacks(decode=[port], health_interval_s=0.1, timeouts={"health_s": 0.5})

    def health() -> int:
        return httpx.get(f"{stack.proxy.url}/health").status_code

    assert health() == 503  # its only decode instance is not there
    with pytest.raises(openai.InternalServerError):
        stack.client.completions.create(model=MODEL, prompt=[1], max_tokens=3)
    with AppThread(Standin().app(), "127.0.0.1", port):
        wait_for(lambda: health() == 200, 5, "decode marked up")
        assert stack.client.completions.create(model=MODEL, prompt=[1], max_tokens=3).choices
    wait_for(lambda: health() == 503, 5, "decode marked down")
    assert stack.metric("lmcache_pd_proxy_instance_up", role="decode", instance=stack.urls[-1]) == 0


class AllocChannel:
    """Decode's KV alloc port, as the test sees it: records the drop notices the proxy sends
    and acknowledges each, as a consumer does."""

    def __init__(self) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.notices: list[protocol.KVAbandoned] = []

    def receive(self, timeout_s: float) -> list[protocol.KVAbandoned]:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and self._socket.poll(int(left * 1000)):
            identity, body = self._socket.recv_multipart()
            notice = protocol.ALLOC_REQUESTS.decode(body)
            assert isinstance(notice, protocol.KVAbandoned)
            self.notices.append(notice)
            ack = protocol.AbandonAck(version=notice.version, req_id=notice.req_id, known=True)
            self._socket.send_multipart([identity, protocol.encode(ack)])
        return self.notices

    def close(self) -> None:
        self._socket.close()
        self._context.term()


@pytest.fixture
def alloc_channel() -> Iterator[AllocChannel]:
    channel = AllocChannel()
    yield channel
    channel.close()


@pytest.mark.parametrize(
    ("case", "prefill", "decode"),
    [
        ("answer ended at the first token", StandinState(fault=Fault.EOS_FIRST), StandinState()),
        ("prefill failed", StandinState(fault=Fault.STATUS_500), StandinState()),
        ("decode failed", StandinState(), StandinState(fault=Fault.STATUS_500)),
    ],
)
def test_kv_pushed_to_a_decode_that_will_not_load_it_is_dropped_there(
    stacks, alloc_channel: AllocChannel, case: str, prefill, decode
) -> None:
    """Prefill pushed the prompt's KV to the decode instance picked for it; when decode is not
    asked (or fails), the proxy tells its alloc channel, so its pages go back at once."""
    stack = stacks(
        prefill=[Standin(prefill)], decode=[Standin(decode)], alloc_port=alloc_channel.port
    )
    with contextlib.suppress(openai.APIError):
        stack.client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=8)
    [notice] = alloc_channel.receive(timeout_s=2)
    assert notice.reason is protocol.AbandonReason.CLIENT_GONE
    assert notice.req_id.startswith("pd-"), case
    assert stack.metric("lmcache_pd_proxy_kv_drops_total") == 1


def test_a_client_that_hangs_up_on_done_had_its_whole_answer(
    stacks, alloc_channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The official client closes its connection as it reads ``[DONE]``, and aiohttp cancels
    the proxy's handler at its next await (here made certain: ending the response raises the
    cancellation): the request is counted ``ok``, and its KV, which decode loaded, is never
    dropped (a fleet run counted 25 of ~440 complete answers ``client_disconnected``, each
    with a drop notice)."""
    from lmcache_pd.proxy import answer

    async def hung_up(_: object) -> None:
        raise asyncio.CancelledError

    monkeypatch.setattr(answer, "close_after_done", hung_up)
    stack = stacks(alloc_port=alloc_channel.port)
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{stack.proxy.url}/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                break  # and hang up
    stack.wait_counted("ok")
    assert alloc_channel.receive(timeout_s=0.5) == []


def test_a_client_that_leaves_mid_stream_has_its_kv_dropped(stacks, alloc_channel) -> None:
    decode = Standin(StandinState(token_delay_s=0.2))
    stack = stacks(decode=[decode], alloc_port=alloc_channel.port)
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{stack.proxy.url}/v1/completions", json=body) as response:
        events = (line for line in response.iter_lines() if line)
        assert all(next(events).startswith("data: ") for _ in range(2))
    [notice] = alloc_channel.receive(timeout_s=2)
    assert "client_disconnected" in notice.detail


def test_a_client_that_leaves_during_prefill_has_its_kv_dropped(stacks, alloc_channel) -> None:
    """The client gives up before its first token: the notice says so (not an internal
    error, which is what the operator would otherwise read in decode's log)."""
    stack = stacks(
        prefill=[Standin(StandinState(first_delay_s=2.0))], alloc_port=alloc_channel.port
    )
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 8}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.proxy.url}/v1/completions", json=body, timeout=0.5)
    [notice] = alloc_channel.receive(timeout_s=3)
    assert "client_disconnected" in notice.detail, notice.detail


def test_a_request_decode_answered_sends_no_drop(stacks, alloc_channel: AllocChannel) -> None:
    """Control: decode loaded (or computed) the prompt and released it itself."""
    stack = stacks(alloc_port=alloc_channel.port)
    for stream in (False, True):
        answer = stack.client.completions.create(
            model=MODEL, prompt=[5, 6], max_tokens=8, stream=stream
        )
        if stream:
            list(answer)
    assert alloc_channel.receive(timeout_s=1) == []
    assert stack.metric("lmcache_pd_proxy_kv_drops_total") == 0


# ---- placement ----


def _loop_thread_cpus(pid: int) -> set[str]:
    """The allowed CPUs (as Linux lists them) of the threads that serve: the main thread, which
    runs the event loop, and the loop's workers (a library may have started an idle thread of
    its own at import, before the proxy chose its CPUs)."""
    lists = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        if task.name != str(pid) and (task / "comm").read_text().strip() != "libuv-worker":
            continue
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists.add(line.split(":", 1)[1].strip())
    return lists


@pytest.mark.skipif(
    not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2,
    reason="needs Linux's /proc and two CPUs to tell a pinned proxy from a free one",
)
@pytest.mark.parametrize("cpus", ["0", None])
@pytest.mark.processes
def test_the_proxy_runs_on_the_cpus_it_is_given(cpus: str | None, tmp_path: Path) -> None:
    """``lmcache-pd proxy`` in its own process, in front of a stand-in pair: the threads that
    serve on ``cpus`` (a pools file's ``proxy: {cpus}``); None (control): not."""
    standins = [Standin(), Standin()]
    urls = [f"http://127.0.0.1:{free_port()}" for _ in standins]
    port = free_port()
    config = {
        "model": MODEL,
        "port": port,
        "prefill": [{"url": urls[0]}],
        "decode": [{"url": urls[1], "receiver_host": "127.0.0.1", "init_port": 1, "alloc_port": 2}],
        **({"cpus": cpus} if cpus is not None else {}),
    }
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    with ExitStack() as running:
        for standin, url in zip(standins, urls, strict=True):
            running.enter_context(AppThread(standin.app(), "127.0.0.1", int(url.rsplit(":")[-1])))
        proxy = subprocess.Popen(
            [sys.executable, "-m", "lmcache_pd.cli", "proxy", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        # Its exit takes ~2 s idle (the interpreter's own teardown of torch and transformers),
        # past 10 s on a loaded machine (seen in a run beside vLLM tests).
        running.callback(proxy.wait, 60)
        running.callback(proxy.terminate)
        wait_until_healthy(f"http://127.0.0.1:{port}", proxy, 30)
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        allowed = _loop_thread_cpus(proxy.pid)
        if cpus is None:
            assert allowed and "0" not in allowed, allowed  # control: every CPU
        else:
            assert allowed == {cpus}, allowed


def test_a_retried_prefill_pushes_under_an_id_of_its_own_and_only_the_failed_ones_kv_is_dropped(
    stacks, alloc_channel: AllocChannel
) -> None:
    """The first prefill fails (500) after it may have pushed; the retry on the other pushes
    under an id of its own, decode loads under that one, and the proxy drops the failed
    attempt's KV only. With one id for both, the failed attempt's abandon notice (a producer
    re-sends it for seconds) dropped the retry's KV, and decode recomputed after every retry."""
    broken, good = Standin(StandinState(fault=Fault.STATUS_500)), Standin()
    stack = stacks(prefill=[broken, good], alloc_port=alloc_channel.port, health_interval_s=60)
    for _ in range(2):  # whichever is picked first, one request meets the broken one first
        answer = stack.client.completions.create(model=MODEL, prompt=[5, 6], max_tokens=4)
        assert answer.choices[0].text == "".join(expected_tokens([5, 6], 4))

    def ids(standin: Standin) -> set[str]:
        return {
            b["kv_transfer_params"]["disagg_spec"]["req_id"] for _, _, b in standin.state.received
        }

    failed = ids(broken)
    assert failed and {f"{first}~1" for first in failed} <= ids(good)
    loaded = ids(stack.decode[0])
    assert {f"{first}~1" for first in failed} <= loaded and not failed & loaded
    notices = alloc_channel.receive(timeout_s=2)
    assert {notice.req_id for notice in notices} == failed
    assert all("attempt failed" in notice.detail for notice in notices)
