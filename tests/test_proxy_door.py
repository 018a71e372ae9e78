"""The proxy's door, over real HTTP, in front of stand-in vLLM servers that record what reaches
them (the proxy is what is under test; ``test_proxy_vllm.py`` has the same door in front of real
vLLM): transfer parameters a client smuggles in are refused, malformed and hostile bodies get a
4xx naming the field and never a 5xx, error bodies name no upstream address, the clients' key
(with the official ``openai`` client), the instances' own key on every upstream call, the
admission limit, and a client's ``cache_salt`` and LMCache request options (``lmcache.*`` in
its ``kv_transfer_params``) reaching prefill and decode alike."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml
from aiohttp import web

from lmcache_pd.errors import ConfigError
from lmcache_pd.harness.standin import Fault, Standin, StandinState
from lmcache_pd.protocol import MAX_TAG_CHARS, MAX_TAGS
from lmcache_pd.proxy.app import Proxy
from lmcache_pd.proxy.config import (
    API_KEY_ENV,
    INSTANCE_API_KEY_ENV,
    load_proxy_config,
    proxy_config,
)
from lmcache_pd.request_body import MAX_JSON_DEPTH
from tests.helpers import wait_for
from tests.test_proxy import MODEL, Stack

CLIENT_KEY = "client-key-1"
INSTANCE_KEY = "instance-key-2"
REQ_ID = re.compile(r"\(req pd-[0-9a-f]{32}\)")


class Recorder(Standin):
    """A stand-in that records the ``Authorization`` of every request it gets and, given
    ``key``, answers 401 to a /v1/* request without it, as vLLM's ``--api-key`` does."""

    def __init__(self, state: StandinState | None = None, key: str | None = None) -> None:
        super().__init__(state)
        self.key = key
        self.authorizations: list[tuple[str, str | None]] = []

    def app(self) -> web.Application:
        app = super().app()
        app.middlewares.append(self._check)
        return app

    @web.middleware
    async def _check(self, request: web.Request, handler: Any) -> web.StreamResponse:
        header = request.headers.get("Authorization")
        self.authorizations.append((request.path, header))
        wanted = None if self.key is None else f"Bearer {self.key}"
        if request.path.startswith("/v1/") and wanted is not None and header != wanted:
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    def asked(self) -> list[tuple[str, str | None]]:
        """The generation and model-card requests it got (not the health checks)."""
        return [(path, header) for path, header in self.authorizations if path != "/health"]


@pytest.fixture
def stacks() -> Iterator[Any]:
    made: list[Stack] = []

    def make(prefill=None, decode=None, **settings) -> Stack:
        stack = Stack(prefill or [Recorder()], decode or [Recorder()], **settings)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.close()


def nothing_reached(stack: Stack) -> bool:
    return all(not s.state.received for s in (*stack.prefill, *stack.decode))


def openai_error(response: httpx.Response) -> dict[str, Any]:
    """The error of an OpenAI-shaped error body (fails the test if it is not one)."""
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], response.text
    assert isinstance(error["type"], str) and error["code"] == response.status_code, response.text
    return error


def completion_body(prompt: Any = "x", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, **fields}


def chat_body(content: Any = "x", **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


# ---- transfer parameters are the proxy's to set ----

SMUGGLED = {
    "vllm_xargs: a string": {"vllm_xargs": {"kv_transfer_params": "x"}},
    "vllm_xargs: a list": {"vllm_xargs": {"kv_transfer_params": ["x"]}},
    "vllm_xargs: a spec": {
        "vllm_xargs": {"kv_transfer_params": {"disagg_spec": {"req_id": "r"}}},
    },
    "vllm_xargs: ec_transfer_params": {"vllm_xargs": {"ec_transfer_params": "x"}},
    "kv_transfer_params: a spec": {"kv_transfer_params": {"first_tok_to": "tcp://-:1"}},
    "kv_transfer_params: zero": {"kv_transfer_params": 0},
    "kv_transfer_params: a spec beside a tag": {
        "kv_transfer_params": {"lmcache.tag.tenant": "a", "disagg_spec": {"req_id": "r"}},
    },
    "kv_transfer_params: a tag not a string": {"kv_transfer_params": {"lmcache.tag.tenant": 7}},
    "kv_transfer_params: a tag too long": {
        "kv_transfer_params": {"lmcache.tag.tenant": "a" * (MAX_TAG_CHARS + 1)},
    },
    "kv_transfer_params: too many tags": {
        "kv_transfer_params": {f"lmcache.tag.t{i}": "a" for i in range(MAX_TAGS + 1)},
    },
    "kv_transfer_params: skip_save not a boolean": {
        "kv_transfer_params": {"lmcache.skip_save": "yes"},
    },
    "ec_transfer_params": {"ec_transfer_params": {"x": 1}},
}


@pytest.mark.parametrize("alone", [True, False], ids=["served_alone", "disaggregated"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("smuggled", list(SMUGGLED), ids=list(SMUGGLED))
def test_transfer_parameters_from_a_client_are_refused_naming_the_field(
    stacks, smuggled: str, endpoint: str, alone: bool
) -> None:
    """vLLM reads ``kv_transfer_params`` from the sampling params' ``extra_args``, which it fills
    from ``vllm_xargs`` too: a short prompt went to decode with them unchanged, and decode's
    500 reached the client as a 502. Control: the same body without them is served."""
    stack = stacks(min_disagg_tokens=1000 if alone else 0)
    body = chat_body() if endpoint == "chat" else completion_body()
    path = f"/v1/{'chat/' if endpoint == 'chat' else ''}completions"
    fields = SMUGGLED[smuggled]
    response = stack.post(path, json=body | fields)
    assert response.status_code == 400, response.text
    [field] = fields
    assert field in openai_error(response)["message"]
    assert nothing_reached(stack)
    assert stack.post(path, json=body).status_code == 200  # the control
    assert stack.post(path, json=body | {field: None}).status_code == 200  # null is no value


@pytest.mark.parametrize("smuggled", list(SMUGGLED), ids=list(SMUGGLED))
def test_transfer_parameters_sent_to_the_responses_api_are_refused_naming_the_field(
    stacks, smuggled: str
) -> None:
    """vLLM's Responses API reads ``kv_transfer_params``, ``ec_transfer_params`` and
    ``vllm_xargs`` into the same ``extra_args`` as completions: forwarded unread, they reached
    decode's engine (a client setting the proxy's params). Control: the same body without
    them is served, and counted when refused."""
    stack = stacks()
    body = {"model": MODEL, "input": "x", "max_output_tokens": 4}
    fields = SMUGGLED[smuggled]
    response = stack.post("/v1/responses", json=body | fields)
    assert response.status_code == 400, response.text
    [field] = fields
    assert field in openai_error(response)["message"]
    assert nothing_reached(stack)
    name = "lmcache_pd_proxy_requests_total"
    assert stack.metric(name, endpoint="/v1/responses", outcome="bad_request") == 1
    assert stack.post("/v1/responses", json=body).status_code == 200  # the control


# ---- malformed and hostile bodies ----


def deep(levels: int, inner: bytes = b"1") -> bytes:
    return b"[" * levels + inner + b"]" * levels


def raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


# (endpoint, body, what the error message names)
HOSTILE: dict[str, tuple[str, bytes, str]] = {
    "an array 10000 deep": ("completions", deep(10_000), "nested"),
    "an object 10000 deep": ("chat", b'{"a":' * 10_000 + b"1" + b"}" * 10_000, "nested"),
    "a field 10000 deep": ("completions", raw(completion_body())[:-1] + b',"user":'
                           + deep(10_000) + b"}", "nested"),
    "logit_bias past the depth": ("completions", raw(completion_body())[:-1]
                                  + b',"logit_bias":' + deep(MAX_JSON_DEPTH) + b"}", "logit_bias"),
    "a list": ("completions", b"[1, 2]", "JSON object"),
    "a string": ("chat", b'"hello"', "JSON object"),
    "a number": ("completions", b"42", "JSON object"),
    "null": ("chat", b"null", "JSON object"),
    "nothing": ("completions", b"", "malformed JSON"),
    "truncated": ("completions", b'{"model": "tiny", "prompt": "x"', "malformed JSON"),
    "not UTF-8": ("completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', "malformed JSON"),
    "NaN": ("completions", b'{"model": "tiny", "prompt": "x", "temperature": NaN}', "malformed"),
    "max_tokens a fraction": ("completions", raw(completion_body(max_tokens=1.5)), "max_tokens"),
    "model a number": ("completions", raw(completion_body() | {"model": 5}), "model"),
    "prompt an object": ("completions", raw(completion_body({})), "prompt"),
    "prompt an empty list": ("completions", raw(completion_body([])), "prompt"),
    "prompt an empty batch": ("completions", raw(completion_body([[]])), "prompt"),
    "prompt ids and text": ("completions", raw(completion_body([1, "a"])), "prompt"),
    "prompt of objects": ("completions", raw(completion_body([{"a": 1}])), "prompt"),
    "prompt negative ids": ("completions", raw(completion_body([1, -3])), "prompt"),
    "prompt a bool": ("completions", raw(completion_body(True)), "prompt"),
    "stream a string": ("completions", raw(completion_body(stream="yes")), "stream"),
    "stream_options a number": ("chat", raw(chat_body(stream_options=5)), "stream_options"),
    "max_tokens negative": ("completions", raw(completion_body(max_tokens=-1)), "max_tokens"),
    "n of 0": ("chat", raw(chat_body(n=0)), "n"),
    "cache_salt a number": ("completions", raw(completion_body(cache_salt=5)), "cache_salt"),
    "cache_salt empty": ("chat", raw(chat_body(cache_salt="")), "cache_salt"),
    "messages an object": ("chat", raw({"model": MODEL, "messages": {}}), "messages"),
    "messages empty": ("chat", raw({"model": MODEL, "messages": []}), "messages"),
    "a message a string": ("chat", raw({"model": MODEL, "messages": ["hi"]}), "messages[0]"),
    "a message without role": ("chat", raw({"model": MODEL, "messages": [{"content": "x"}]}),
                               "role"),
    "content a number": ("chat", raw(chat_body(5)), "content"),
    "a part a number": ("chat", raw(chat_body([5])), "content[0]"),
    "a part a list": ("chat", raw(chat_body([[{"type": "text", "text": "x"}]])), "content[0]"),
    "a text part's text a number": ("chat", raw(chat_body([{"type": "text", "text": 5}])), "text"),
    "a part's type a number": ("chat", raw(chat_body([{"type": 5}])), "type"),
    "content parts past the depth": ("chat", raw(chat_body([{"type": "text", "text": "x",
                                     "x": json.loads(deep(MAX_JSON_DEPTH))}])), "messages"),
    "an unknown model": ("completions", raw(completion_body() | {"model": "other"}), "other"),
    "a batch with negative ids": ("completions", raw(completion_body(["a", [-3]])), "prompt"),
    "vllm_xargs": ("chat", raw(chat_body(vllm_xargs={"kv_transfer_params": "x"})), "vllm_xargs"),
    "over max_body_bytes": ("completions", raw(completion_body("x" * 70_000)), "body size"),
}  # fmt: skip


def test_hostile_bodies_get_a_4xx_naming_the_field_and_the_proxy_keeps_serving(stacks) -> None:
    """Every body is answered 4xx (400, 404, 413) with an OpenAI-shaped error naming what is
    wrong, none reaches an instance, each is counted, and the proxy serves normally after (the
    control: a good body of each endpoint, before and after). Before the door checked them, a
    deep body was a 500 (msgspec's RecursionError), and so were a text part whose text is no
    string and a body nested under the recursion limit (the proxy could not re-encode it)."""
    stack = stacks(max_body_bytes=65_536, min_disagg_tokens=8)
    good = {"completions": completion_body("ok"), "chat": chat_body("ok")}
    for endpoint, body in good.items():
        assert stack.post(f"/v1/{'chat/' * (endpoint == 'chat')}completions", json=body).is_success
    answered = {}
    for name, (endpoint, body, names) in HOSTILE.items():
        path = f"/v1/{'chat/' * (endpoint == 'chat')}completions"
        response = stack.post(path, content=body, headers={"Content-Type": "application/json"})
        answered[name] = response.status_code
        assert 400 <= response.status_code < 500, (name, response.status_code, response.text)
        assert names in openai_error(response)["message"], (name, response.text)
    assert set(answered.values()) == {400, 404, 413}, answered
    assert [len(s.state.received) for s in stack.decode] == [2], "only the good bodies reached"
    bad = sum(
        stack.metric("lmcache_pd_proxy_requests_total", endpoint=e, outcome="bad_request")
        for e in ("/v1/completions", "/v1/chat/completions")
    )
    assert bad == len(HOSTILE)
    for endpoint, body in good.items():
        assert stack.post(f"/v1/{'chat/' * (endpoint == 'chat')}completions", json=body).is_success
    assert httpx.get(f"{stack.proxy.url}/health").status_code == 200


# ---- what an error tells the client ----


def assert_names_no_upstream(message: str, stack: Stack, role: str) -> None:
    assert f"{role} instance" in message and REQ_ID.search(message), message
    for url in stack.urls:
        assert url not in message and url.rsplit(":", 1)[1] not in message, message
    assert "127.0.0.1" not in message and "http" not in message, message


def logged_with_its_req_id(caplog: pytest.LogCaptureFixture, message: str, url: str) -> bool:
    """Whether an error line of the proxy names the request of ``message`` and ``url``."""
    req_id = REQ_ID.search(message)[0][5:-1]
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    return any(req_id in line and url in line for line in lines)


def test_a_failed_prefill_tells_the_client_the_role_and_request_not_the_address(
    stacks, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: "prefill instance http://127.0.0.1:PORT: answered 500: b'...'"."""
    failing = StandinState(fault=Fault.STATUS_500)
    stack = stacks(prefill=[Recorder(failing)])
    response = stack.post("/v1/completions", json=completion_body())
    assert response.status_code == 502
    message = openai_error(response)["message"]
    assert_names_no_upstream(message, stack, "prefill")
    assert logged_with_its_req_id(caplog, message, stack.urls[0])


@pytest.mark.parametrize("alone", [False, True], ids=["disaggregated", "served_alone"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_failed_decode_tells_the_client_the_role_and_request_not_the_address(
    stacks, caplog: pytest.LogCaptureFixture, stream: bool, alone: bool
) -> None:
    failing = StandinState(fault=Fault.DIE_MID_STREAM if stream else Fault.STATUS_500)
    stack = stacks(decode=[Recorder(failing)], min_disagg_tokens=1000 if alone else 0)
    request = completion_body([4, 2], max_tokens=6, stream=stream)
    with httpx.stream("POST", f"{stack.proxy.url}/v1/completions", json=request) as response:
        text = response.read().decode()
    if stream:  # the error is the stream's last event
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        message = events[-1]["error"]["message"]
    else:
        assert response.status_code == 502
        message = json.loads(text)["error"]["message"]
    assert_names_no_upstream(message, stack, "decode")
    assert logged_with_its_req_id(caplog, message, stack.urls[1])


def test_no_model_card_names_no_address(stacks) -> None:
    stack = stacks(prefill=[Recorder(key="not the proxy's")])
    response = httpx.get(f"{stack.proxy.url}/v1/models")
    assert response.status_code == 503
    assert "127.0.0.1" not in openai_error(response)["message"]


# ---- the clients' key ----


def client(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.proxy.url}/v1", api_key=key, max_retries=0, timeout=30)


def test_with_an_api_key_only_clients_that_send_it_are_served(stacks) -> None:
    stack = stacks(api_key=CLIENT_KEY, min_disagg_tokens=8)
    served = client(stack, CLIENT_KEY)
    assert served.completions.create(model=MODEL, prompt=[1, 2], max_tokens=3).choices
    assert served.completions.create(model=MODEL, prompt=list(range(9)), max_tokens=3).choices
    assert list(served.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "hi"}], max_tokens=3, stream=True))  # fmt: skip
    assert [m.id for m in served.models.list()] == ["standin"]
    asked = sum(len(s.state.received) for s in (*stack.prefill, *stack.decode))
    for wrong in ("wrong", CLIENT_KEY + "x", CLIENT_KEY[:-1]):
        with pytest.raises(openai.AuthenticationError):
            client(stack, wrong).completions.create(model=MODEL, prompt=[1], max_tokens=3)
    with pytest.raises(openai.AuthenticationError):
        client(stack, "wrong").models.list()
    for headers in ({}, {"Authorization": f"Basic {CLIENT_KEY}"}, {"Authorization": CLIENT_KEY}):
        response = stack.post("/v1/chat/completions", json=chat_body(), headers=headers)
        assert response.status_code == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        assert openai_error(response)["type"] == "AuthenticationError"
    # The routes forwarded to an instance ask for it too.
    assert stack.post("/tokenize", json={"model": MODEL, "prompt": "x"}).status_code == 401
    assert httpx.get(f"{stack.proxy.url}/version").status_code == 401
    keyed = {"Authorization": f"Bearer {CLIENT_KEY}"}
    assert httpx.get(f"{stack.proxy.url}/version", headers=keyed).status_code == 200
    assert sum(len(s.state.received) for s in (*stack.prefill, *stack.decode)) == asked + 1
    assert stack.metric("lmcache_pd_proxy_refused_total", reason="unauthorized") == 9
    # Probes and scrapers carry no key.
    assert httpx.get(f"{stack.proxy.url}/health").status_code == 200
    assert httpx.get(f"{stack.proxy.url}/metrics").status_code == 200


def test_without_an_api_key_any_client_is_served(stacks) -> None:
    """The control: no ``api_key``, no check."""
    stack = stacks()
    assert client(stack, "anything").completions.create(model=MODEL, prompt=[1], max_tokens=2)
    assert stack.post("/v1/completions", json=completion_body()).status_code == 200


def test_the_key_can_come_from_a_file_or_the_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "client.key"
    key_file.write_text(f"  {CLIENT_KEY}\n")
    config = {
        "model": MODEL,
        "prefill": [{"url": "http://127.0.0.1:1"}],
        "decode": [{"url": "http://127.0.0.1:2", "receiver_host": "h", "init_port": 3,
                    "alloc_port": 4}],
        "api_key_file": str(key_file),
    }  # fmt: skip
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(config))
    assert load_proxy_config(path, environ={}).client_key() == CLIENT_KEY
    environ = {API_KEY_ENV: "from-env", INSTANCE_API_KEY_ENV: INSTANCE_KEY}
    from_env = load_proxy_config(path, environ=environ)
    assert (from_env.client_key(), from_env.instance_key()) == ("from-env", INSTANCE_KEY)
    with pytest.raises(ConfigError, match="api_key"):
        proxy_config(config | {"api_key": CLIENT_KEY})  # named twice
    with pytest.raises(ConfigError, match="api_key"):
        proxy_config(config | {"api_key_file": None, "api_key": "has space"})
    with pytest.raises(ConfigError, match="API_KEY"):
        load_proxy_config(path, environ={API_KEY_ENV: "has space"})
    missing = proxy_config(config | {"api_key_file": str(tmp_path / "missing.key")})
    with pytest.raises(ConfigError, match=r"missing\.key"):
        Proxy(missing)  # before anything listens


# ---- the instances' key ----


@pytest.mark.parametrize("instance_key", [INSTANCE_KEY, None], ids=["instance_key", "none"])
def test_every_upstream_call_carries_the_instances_key_never_the_clients(
    stacks, instance_key: str | None
) -> None:
    """The served model names' listing at start, prefill, decode (asked on a first-token notice
    and on the answer), a prompt served by decode alone and the model card: each call carries
    the instances' key, and the client's own Authorization goes nowhere. Control: with no
    instance key, calls carry none."""
    prefill = Recorder(StandinState(first_delay_s=0.5, notice_shift=0), key=instance_key)
    decode = Recorder(key=instance_key)
    settings: dict[str, Any] = {"api_key": CLIENT_KEY, "min_disagg_tokens": 8}
    if instance_key is not None:
        settings["instance_api_key"] = instance_key
    stack = stacks(prefill=[prefill], decode=[decode], **settings)
    served = client(stack, CLIENT_KEY)
    served.completions.create(model=MODEL, prompt=list(range(10)), max_tokens=4)  # notice
    list(served.chat.completions.create(model=MODEL, messages=[
        {"role": "user", "content": "x" * 20}], max_tokens=4, stream=True))  # fmt: skip
    served.completions.create(model=MODEL, prompt=[1, 2], max_tokens=4)  # decode alone
    served.models.list()
    wanted = None if instance_key is None else f"Bearer {instance_key}"
    assert prefill.asked() == [
        ("/v1/models", wanted),
        ("/v1/completions", wanted),
        ("/v1/chat/completions", wanted),
        ("/v1/models", wanted),
    ]
    assert decode.asked() == [
        ("/v1/completions", wanted),
        ("/v1/chat/completions", wanted),  # the client's own request
        ("/v1/completions", wanted),
    ]
    assert stack.metric("lmcache_pd_proxy_first_token_notices_total", outcome="used") >= 1


@pytest.mark.parametrize("alone", [False, True], ids=["disaggregated", "served_alone"])
def test_an_instance_refusing_the_proxys_key_is_the_proxys_failure_not_the_clients(
    stacks, alone: bool
) -> None:
    """A 401 from an instance means the proxy holds the wrong key: the client gets a 502 (not
    vLLM's 401, which would read as its own key refused), counted as ``unauthorized``."""
    stack = stacks(
        decode=[Recorder(key="the-instances")],
        instance_api_key="not-the-instances",
        min_disagg_tokens=1000 if alone else 0,
        health_interval_s=60,
    )
    response = stack.post("/v1/completions", json=completion_body([4, 2]))
    assert response.status_code == 502
    assert_names_no_upstream(openai_error(response)["message"], stack, "decode")
    errors = stack.metric(
        "lmcache_pd_proxy_upstream_errors_total",
        role="decode",
        instance=stack.urls[1],
        kind="unauthorized",
    )
    assert errors == 1


# ---- the admission limit ----


@pytest.mark.parametrize("limit", [2, 8])
def test_past_max_in_flight_requests_get_503_with_retry_after(stacks, limit: int) -> None:
    """Two requests held at a slow prefill fill a limit of 2: the next ones are refused at once
    with 503 and Retry-After, counted, while /health and /metrics still answer; once the two
    end, requests are taken again. Control: a limit of 8 takes them all."""
    stack = stacks(prefill=[Recorder(StandinState(first_delay_s=2.0))], max_in_flight=limit)
    with ThreadPoolExecutor(6) as pool:
        held = [pool.submit(stack.post, "/v1/completions", json=completion_body()) for _ in "ab"]
        wait_for(lambda: stack.metric("lmcache_pd_proxy_in_flight") == 2, 10, "two in flight")
        asked = [pool.submit(stack.post, "/v1/completions", json=completion_body()) for _ in "abcd"]
        later = [future.result() for future in asked]
        assert httpx.get(f"{stack.proxy.url}/health").status_code == 200
        if limit == 2:
            for response in later:
                assert response.status_code == 503 and response.headers["Retry-After"] == "1"
                assert "retry" in openai_error(response)["message"]
            refused = stack.metric("lmcache_pd_proxy_refused_total", reason="over_capacity")
            assert refused == 4
        else:
            assert [response.status_code for response in later] == [200] * 4
        assert [future.result().status_code for future in held] == [200, 200]
    assert stack.metric("lmcache_pd_proxy_in_flight") == 0
    assert stack.post("/v1/completions", json=completion_body()).status_code == 200


# ---- cache_salt ----


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("salt", ["tenant-a", None], ids=["salted", "unsalted"])
def test_a_clients_cache_salt_reaches_prefill_and_decode_unchanged(
    stacks, salt: str | None, endpoint: str, stream: bool
) -> None:
    """Before, decode's request (token ids, built by the proxy) went without it: decode's prefix
    cache then served another tenant's blocks. Control: no salt, none on either."""
    stack = stacks()
    body = chat_body("hello there") if endpoint == "chat" else completion_body([5, 6, 7])
    if salt is not None:
        body["cache_salt"] = salt
    path = f"/v1/{'chat/' * (endpoint == 'chat')}completions"
    response = stack.post(path, json=body | {"stream": stream})
    assert response.status_code == 200
    [(_, _, to_prefill)] = stack.prefill[0].state.received
    [(_, _, to_decode)] = stack.decode[0].state.received
    assert to_prefill.get("cache_salt") == salt
    assert to_decode.get("cache_salt") == salt


@pytest.mark.parametrize("alone", [True, False], ids=["served_alone", "disaggregated"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_vllm_xargs_of_a_custom_extension_reach_prefill_and_decode_unchanged(
    stacks, endpoint: str, alone: bool
) -> None:
    """vLLM 0.32 takes ``vllm_xargs`` (a custom extension's arguments, in the sampling params'
    ``extra_args``); the door refused any before, where one vLLM serves them. Only the keys
    vLLM reads transfer parameters from are refused
    (``test_transfer_parameters_from_a_client_are_refused_naming_the_field``)."""
    stack = stacks(min_disagg_tokens=1000 if alone else 0)
    body = chat_body("hello there") if endpoint == "chat" else completion_body([5, 6, 7])
    xargs = {"colour": "blue", "sizes": [1, 2]}
    path = f"/v1/{'chat/' * (endpoint == 'chat')}completions"
    assert stack.post(path, json=body | {"vllm_xargs": xargs}).status_code == 200
    received = [sent for s in (*stack.prefill, *stack.decode) for _, _, sent in s.state.received]
    assert len(received) == (1 if alone else 2)
    assert all(sent["vllm_xargs"] == xargs for sent in received)


def test_a_prompt_served_by_decode_alone_keeps_its_cache_salt(stacks) -> None:
    stack = stacks(min_disagg_tokens=100)
    response = stack.post("/v1/completions", json=completion_body([5, 6], cache_salt="t-b"))
    assert response.status_code == 200
    [(_, _, to_decode)] = stack.decode[0].state.received
    assert to_decode["cache_salt"] == "t-b"
    assert not stack.prefill[0].state.received


# ---- LMCache's request options ----

LMCACHE_OPTIONS = {"lmcache.tag.tenant": "a", "lmcache.skip_save": True, "lmcache.ttl": 60}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_lmcache_request_options_reach_prefill_and_decode_beside_the_proxys_params(
    stacks, endpoint: str, stream: bool
) -> None:
    """A client of an LMCache deployment sends ``lmcache.*`` options in ``kv_transfer_params``
    (its tags, ``lmcache.skip_save``, LMCache's others): the door lets them in and both
    prefill and decode get them, beside the proxy's own params, which a client cannot set
    (``test_transfer_parameters_from_a_client_are_refused_naming_the_field``)."""
    stack = stacks()
    body = chat_body("hello there") if endpoint == "chat" else completion_body([5, 6, 7])
    path = f"/v1/{'chat/' * (endpoint == 'chat')}completions"
    params = {"kv_transfer_params": LMCACHE_OPTIONS}
    assert stack.post(path, json=body | params | {"stream": stream}).status_code == 200
    [(_, _, to_prefill)] = stack.prefill[0].state.received
    [(_, _, to_decode)] = stack.decode[0].state.received
    for sent in (to_prefill, to_decode):
        ours = {k: v for k, v in sent["kv_transfer_params"].items() if not k.startswith("lmcache.")}
        assert sent["kv_transfer_params"] == LMCACHE_OPTIONS | ours
        assert ours["disagg_spec"]["req_id"]  # the proxy's, beside them


def test_lmcache_request_options_reach_decode_serving_alone(stacks) -> None:
    stack = stacks(min_disagg_tokens=100)
    body = completion_body([5, 6], kv_transfer_params=LMCACHE_OPTIONS)
    assert stack.post("/v1/completions", json=body).status_code == 200
    [(_, _, to_decode)] = stack.decode[0].state.received
    assert to_decode["kv_transfer_params"] == LMCACHE_OPTIONS
    assert not stack.prefill[0].state.received
