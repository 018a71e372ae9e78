"""``lmcache-pd serve`` for real: a prefill and a decode vLLM behind the proxy, driven with the
official ``openai`` client over HTTP, against one plain vLLM instance as the reference.

The served pools run as one child process, exactly as a user starts them; its last test stops it
with SIGTERM and checks that nothing it started is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from lmcache_pd.deploy.vllm_server import VLLMServer
from lmcache_pd.metrics_scrape import prompt_tokens_by_source, scrape
from lmcache_pd.proxy.config import MIN_DISAGG_TOKENS
from tests import conformance
from tests.helpers import free_port, metric_sample, wait_for
from tests.vllm_support import SERVER_ARGS, PlainVLLM

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
SERVE_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 60.0
OUTPUT_TOKENS = 8
# How long the relay in front of decode holds each request (the first token comes meanwhile).
DECODE_HOLD_S = 2.0
# How long the relay in front of prefill holds each answer: far longer than a notice takes, so
# that with notices decode is always asked before the answer reaches the proxy.
PREFILL_ANSWER_HOLD_S = 1.0
MODES = ["whole", "streamed"]
LENGTHS = [31, 300, 1000]


def token_prompt(length: int, seed: int = 0) -> list[int]:
    generator = random.Random(length * 100 + seed)
    return [generator.randrange(10, 1500) for _ in range(length)]


# Each mode gets prompts of its own: a prompt seen before is partly served from vLLM's prefix
# cache, whose differently shaped steps move logprobs in the last bits (in a plain instance too).
PROMPTS: dict[str, str | list[int]] = {}
for mode_index, mode in enumerate(MODES):
    PROMPTS[f"short-{mode}"] = f"def add_{mode}(a, b):"
    PROMPTS[f"code-{mode}"] = f'import os\n\ndef walk_{mode}(path):\n    """Yield files."""\n' * 6
    PROMPTS |= {f"len-{n}-{mode}": token_prompt(n, mode_index) for n in LENGTHS}
NAMES = sorted({name.rsplit("-", 1)[0] for name in PROMPTS})


def chat_messages(mode: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You answer in Python."},
        {"role": "user", "content": f"Write a function that reverses a list ({mode})."},
    ]


class Served:
    """``lmcache-pd serve`` in a child process, and what it wrote to its work folder."""

    def __init__(self, model: Path, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        pools = {
            "model": str(model),
            "proxy": {"host": "127.0.0.1", "port": self.port},
            "vllm_args": list(SERVER_ARGS),
            "prefill": [{"config": "configs/producer.yaml", "cpus": "0", "process_cpus": "0"}],
            "decode": [{"config": "configs/consumer.yaml", "cpus": "1"}],
        }
        path = workdir / "pools.yaml"
        path.write_text(yaml.safe_dump(pools))
        self.log = workdir / "serve.log"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lmcache_pd.cli", "serve", str(path), "--workdir", str(workdir)],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            cwd=Path(__file__).parent.parent,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_until_serving(self) -> None:
        deadline = time.monotonic() + SERVE_TIMEOUT_S
        while "serving" not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"lmcache-pd serve did not come up:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def proxy_config(self) -> dict[str, Any]:
        return yaml.safe_load((self.workdir / "proxy.yaml").read_text())

    def stats(self, name: str) -> defaultdict[str, float]:
        """An instance's connector counters, from its vLLM's ``/metrics``."""
        role, index = name.split("-")
        return defaultdict(float, scrape(self.proxy_config()[role][int(index)]["url"]))

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(STOP_TIMEOUT_S)
        return self.process.returncode


@pytest.fixture(scope="module")
def served_and_plain(
    model: Path, plain_vllm: PlainVLLM, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Served, VLLMServer]]:
    """The served pools, and the reference vLLM (if not up yet, it starts alongside)."""
    served = Served(model, tmp_path_factory.mktemp("served"))
    try:
        plain = plain_vllm.server
        served.wait_until_serving()
        yield served, plain
    finally:
        served.stop()


@pytest.fixture(scope="module")
def served(served_and_plain: tuple[Served, VLLMServer]) -> Served:
    return served_and_plain[0]


def client_of(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def completion_request(model: Path, prompt: str | list[int]) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "logprobs": 1,
    }


def completion_answer(client: openai.OpenAI, request: dict[str, Any], stream: bool) -> tuple:
    """(tokens, logprobs, finish reason) of a completion, streamed or not."""
    if not stream:
        choice = client.completions.create(**request).choices[0]
        return choice.logprobs.tokens, choice.logprobs.token_logprobs, choice.finish_reason
    tokens, logprobs, finish = [], [], None
    for chunk in client.completions.create(**request, stream=True):
        choice = chunk.choices[0]
        tokens += choice.logprobs.tokens
        logprobs += choice.logprobs.token_logprobs
        finish = choice.finish_reason or finish
    return tokens, logprobs, finish


def chat_answer(client: openai.OpenAI, model: Path, stream: bool) -> tuple:
    request = {
        "model": str(model),
        "messages": chat_messages(MODES[stream]),
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 1,
    }
    if not stream:
        choice = client.chat.completions.create(**request).choices[0]
        entries = choice.logprobs.content
        text = choice.message.content
    else:
        entries, text = [], ""
        for chunk in client.chat.completions.create(**request, stream=True):
            entries += chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else []
            text += chunk.choices[0].delta.content or ""
    return text, [e.token for e in entries], [e.logprob for e in entries]


@pytest.fixture(scope="module")
def reference(served_and_plain: tuple[Served, VLLMServer], model: Path) -> dict[str, tuple]:
    plain = client_of(served_and_plain[1].url)
    answers = {
        name: completion_answer(plain, completion_request(model, prompt), stream=False)
        for name, prompt in PROMPTS.items()
    }
    for stream, mode in enumerate(MODES):
        answers[f"chat-{mode}"] = chat_answer(plain, model, stream=bool(stream))
    return answers


def prompt_length(model: Path, prompt: str | list[int]) -> int:
    """The prompt's tokens as vLLM counts them (the tokenizer adds a BOS to a text)."""
    from tokenizers import Tokenizer

    if isinstance(prompt, list):
        return len(prompt)
    return len(Tokenizer.from_file(str(model / "tokenizer.json")).encode(prompt).ids)


def test_every_instance_is_warmed_up_before_the_proxy_serves(served: Served) -> None:
    """vLLM compiles its logprobs kernel on the first requests that need it (one sequence, then
    a batch), seconds on the model thread: the launcher has each instance do it before the
    proxy takes traffic."""
    before_serving = served.log.read_text().split("serving", 1)[0]
    for name in ("prefill-0", "decode-0"):
        # rich may wrap the line, putting its source column between the words
        logged = rf"{name}(\s+launcher\.py:\d+)?\s+warmed\s+up"
        assert re.search(logged, before_serving), before_serving[-2000:]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_completions_through_the_proxy_equal_one_instance(
    served: Served, reference: dict, model: Path, name: str, mode: str
) -> None:
    """Prompts under the default ``min_disagg_tokens`` are computed by decode alone, the others
    loaded from prefill's push: both answer as one plain instance does, and decode's own
    counters say which happened."""
    prompt = PROMPTS[f"{name}-{mode}"]
    decode_url = served.proxy_config()["decode"][0]["url"]
    loaded, computed = served.stats("decode-0")["tokens_loaded"], computed_by(decode_url)
    alone = scrape(served.url).get("proxy_served_alone", 0)
    request = completion_request(model, prompt)
    got = completion_answer(client_of(served.url), request, stream=mode == "streamed")
    # tokens, logprobs (bit for bit) and finish reason
    assert got == reference[f"{name}-{mode}"]
    loaded = served.stats("decode-0")["tokens_loaded"] - loaded
    computed = computed_by(decode_url) - computed
    length = prompt_length(model, prompt)
    if length < MIN_DISAGG_TOKENS:
        assert scrape(served.url)["proxy_served_alone"] == alone + 1
        assert (loaded, computed) == (0, length)
    else:  # decode loaded the prompt, and computed only the token prefill made
        assert (loaded, computed) == (length, 1)


def computed_by(url: str) -> float:
    """Prompt tokens decode computed itself, by vLLM's own count."""
    return prompt_tokens_by_source(url).get("local_compute", 0.0)


@pytest.mark.parametrize("mode", MODES)
def test_chat_through_the_proxy_equals_one_instance(
    served: Served, reference: dict, model: Path, mode: str
) -> None:
    got = chat_answer(client_of(served.url), model, stream=mode == "streamed")
    assert got == reference[f"chat-{mode}"]


def test_usage_and_models_read_as_from_one_instance(
    served_and_plain: tuple[Served, VLLMServer], model: Path
) -> None:
    served, plain = served_and_plain
    prompt = {"model": str(model), "prompt": "usage counts", "max_tokens": 5, "temperature": 0}
    want = client_of(plain.url).completions.create(**prompt).usage
    assert client_of(served.url).completions.create(**prompt).usage == want
    chunks = list(
        client_of(served.url).completions.create(
            **prompt, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage == want
    assert [m.id for m in client_of(served.url).models.list()] == [str(model)]


class Relay:
    """A TCP relay in front of an instance. When a request reaches it, it notes the time and
    looks, without reading, at what the client's socket has already received: on loopback a send
    lands in the receiver's buffer within the sender's own send call, so the bytes found there
    are exactly those the proxy had sent the client before it asked the instance."""

    def __init__(self, target_port: int, hold_s: float = 0.0, answer_hold_s: float = 0.0) -> None:
        """``hold_s``: how long each request waits in the relay before it goes on;
        ``answer_hold_s``: how long each answer waits before it goes back."""
        self.port = free_port()
        self._hold_s = hold_s
        self._answer_hold_s = answer_hold_s
        self.client: socket.socket | None = None
        self.seen: list[tuple[float, bytes]] = []  # (arrival, what the client had by then)
        self._target = target_port
        self._ready = threading.Event()
        threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True).start()
        assert self._ready.wait(5)

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
        self._ready.set()
        async with server:
            await server.serve_forever()

    def _note(self) -> None:
        if self.client is None:
            self.seen.append((time.monotonic(), b""))
            return
        try:
            had = self.client.recv(1 << 16, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            had = b""
        self.seen.append((time.monotonic(), had))

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)

        async def pipe(src, dst, asking: bool) -> None:
            while data := await src.read(1 << 16):
                if asking and data.startswith(b"POST "):
                    self._note()
                    await asyncio.sleep(self._hold_s)
                elif not asking and data.startswith(b"HTTP/"):
                    await asyncio.sleep(self._answer_hold_s)
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(
            pipe(reader, up_writer, True), pipe(up_reader, writer, False), return_exceptions=True
        )


def send_by_hand(connection: socket.socket, body: dict[str, Any]) -> None:
    """Send a completion request on a raw socket, so that nothing reads the answer unasked."""
    payload = json.dumps(body).encode()
    connection.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload
    )
    return connection


def test_first_token_reaches_the_client_without_waiting_for_decode(
    served: Served, model: Path, tmp_path: Path
) -> None:
    """A second proxy, in its own process, fronts the same instances with decode behind a relay
    that holds each request for a while, and prefill behind one that holds each answer: the first
    token reaches the client during decode's hold, and decode was asked on prefill's first-token
    notice, before prefill's answer reached the proxy (the proxy's own count; its control, the
    same with notices off, asks decode only after the first token is sent)."""
    for notices in (True, False):
        config = served.proxy_config()
        decode, prefill = config["decode"][0], config["prefill"][0]
        watch = Relay(_port_of(decode["url"]), hold_s=DECODE_HOLD_S)
        slow_prefill = Relay(_port_of(prefill["url"]), answer_hold_s=PREFILL_ANSWER_HOLD_S)
        config |= {
            "port": free_port(),
            "prefill": [{**prefill, "url": f"http://127.0.0.1:{slow_prefill.port}"}],
            "decode": [{**decode, "url": f"http://127.0.0.1:{watch.port}"}],
            "first_token_notices": notices,
            # The same prompts go through twice (notices on, then off): by KV, decode would hold
            # them the second time and serve them alone. This is about the disaggregated path.
            "routing": "load",
        }
        path = tmp_path / "proxy.yaml"
        path.write_text(yaml.safe_dump(config))
        proxy = subprocess.Popen(
            [sys.executable, "-m", "lmcache_pd.cli", "proxy", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{config['port']}"
        try:
            wait_for(lambda u=url: _answers(f"{u}/health"), 20, "the second proxy")
            for length in (300, 1000):
                _first_token_before_decode_answers(watch, config["port"], model, length, notices)
            used = metric_sample(url, "lmcache_pd_proxy_first_token_notices_total", outcome="used")
            assert used == (2 if notices else 0)
        finally:
            proxy.terminate()
            proxy.wait(10)


def _port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def _first_token_before_decode_answers(
    watch: Relay, port: int, model: Path, length: int, notices: bool
) -> None:
    """With notices decode is asked on the engine's word, before the client has the token (whose
    answer the relay holds): the client reads at once, and its first token must come after decode
    was asked and while decode's request is held. Without, the client reads nothing until decode
    is asked, and the token's event must be in its socket by then."""
    request = {**completion_request(model, token_prompt(length, seed=7)), "stream": True}
    asked = len(watch.seen)
    with socket.create_connection(("127.0.0.1", port), timeout=120) as connection:
        # The relay peeks at the client's socket only while nothing else reads it.
        watch.client = None if notices else connection
        started = time.monotonic()
        send_by_hand(connection, request)
        received = b""
        if notices:
            while b"data: {" not in received:
                received += connection.recv(1 << 16)
        else:
            wait_for(lambda: len(watch.seen) > asked, 60, "decode's request")
        first_at = time.monotonic()
        while chunk := connection.recv(1 << 16):
            received += chunk
    [(asked_at, had)] = watch.seen[asked:]
    events = [line for line in received.split(b"\n") if line.startswith(b"data: {")]
    if notices:
        assert asked_at < first_at < asked_at + DECODE_HOLD_S
    else:
        assert events[0] in had, had
    # vLLM may put several tokens in one event when its client lags: count tokens
    tokens = [json.loads(event[6:])["choices"][0]["logprobs"]["tokens"] for event in events]
    assert sum(map(len, tokens)) == OUTPUT_TOKENS and b"[DONE]" in received
    logging.getLogger(__name__).info(
        "%d tokens, notices %s: decode asked %.1f ms after the request, first token out by %.1f",
        length,
        notices,
        1e3 * (asked_at - started),
        1e3 * (first_at - started),
    )


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _running(instance_url: str) -> float:
    """Requests running or waiting in a vLLM instance, from its Prometheus metrics."""
    total = 0.0
    for line in httpx.get(f"{instance_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return total


# ---- API conformance: whole answers, the served pools against one plain vLLM ----


def loaded_and_computed(url: str) -> tuple[float, float]:
    """Prompt tokens decode loaded from a transfer and computed, by vLLM's own counts."""
    sources = prompt_tokens_by_source(url)
    return sources.get("external_kv_transfer", 0.0), sources.get("local_compute", 0.0)


def notices(served: Served) -> dict[str, float]:
    """What the proxy's first-token notices did, by outcome."""
    name = "lmcache_pd_proxy_first_token_notices_total"
    return {o: metric_sample(served.url, name, outcome=o) for o in ("used", "after_answer")}


def not_disaggregated(served: Served, reason: str | None) -> float:
    name = "lmcache_pd_proxy_not_disaggregated_total"
    return 0.0 if reason is None else metric_sample(served.url, name, reason=reason)


def assert_conforms(
    served: Served,
    plain: VLLMServer,
    body: dict[str, Any],
    chat: bool,
    alone: bool = False,
    prompts: int = 1,
    prompt_tokens: int = conformance.PROMPT_TOKENS,
    naming: frozenset[str] = conformance.NAMING_FIELDS,
) -> conformance.Answer:
    """The served answer is the plain one, field for field (``conformance.differences``), and
    it was disaggregated: decode loaded all ``prompt_tokens`` of each of its ``prompts`` but
    the last; or, ``alone``, decode computed them all. Returns the answer."""
    decode_url = served.proxy_config()["decode"][0]["url"]
    before = loaded_and_computed(decode_url)
    got = conformance.ask(client_of(served.url), body, chat)
    after = loaded_and_computed(decode_url)
    want = conformance.ask(client_of(plain.url), body, chat)
    found = conformance.differences(got, want, naming=naming)
    assert not found, found
    if conformance.refused(want):
        return got  # refused by both alike (prompt_logprobs streamed): nothing was computed
    loaded, computed = (a - b for a, b in zip(after, before, strict=True))
    if alone:
        assert loaded == 0 and computed >= prompts * prompt_tokens, (loaded, computed)
    else:
        least = prompts * (prompt_tokens - 1)
        assert loaded >= least and computed == prompts, (loaded, computed)
    return got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("case", conformance.CASES, ids=lambda case: case.name)
def test_every_request_field_is_answered_as_one_vllm_answers_it(
    served_and_plain: tuple[Served, VLLMServer], model: Path, case: conformance.Case, stream: bool
) -> None:
    """Decode is sent the client's own request, its first token forced to prefill's: the
    answer, streamed or whole, is one vLLM's, with its KV loaded, not computed."""
    served, plain = served_and_plain
    before, alone = notices(served), not_disaggregated(served, case.alone)
    body = case.body(str(model), stream)
    naming = conformance.NAMING_FIELDS - {"id"} if case.named else conformance.NAMING_FIELDS
    answer = assert_conforms(
        served,
        plain,
        body,
        case.chat,
        case.alone is not None,
        case.prompts,
        case.prompt_tokens,
        naming,
    )
    refused = ("streamed" if stream else "whole") in case.refused
    assert conformance.refused(answer) == refused, answer
    if refused:  # nothing went on after the refusal
        return
    if case.calls is not None and not stream:
        assert conformance.called_tools(answer) == [case.calls], answer
    after = notices(served)
    if case.alone is not None:  # served by decode alone, unchanged: counted by its reason
        assert not_disaggregated(served, case.alone) == alone + 1
        return
    # decode was asked on prefill's notice, or on its answer where that came first (per prompt)
    asked = after["used"] + after["after_answer"] - before["used"] - before["after_answer"]
    assert asked == case.prompts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_stop_string_across_the_first_two_tokens_stops_as_in_one_vllm(
    served_and_plain: tuple[Served, VLLMServer], model: Path, stream: bool
) -> None:
    """The stop string is the end of the first token and the start of the second (taken from
    the plain answer): vLLM holds back the first token's text that begins it, so the proxy does
    not show that token alone. The control: the stop string cuts the plain answer."""
    served, plain = served_and_plain
    # a prompt of its own each way: decode's prefix cache holds one seen before
    body = conformance.Case("stop", {"logprobs": 1}, seed=20 + stream).body(str(model), False)
    stop = conformance.stop_spanning_two_tokens(conformance.ask(client_of(plain.url), body, False))
    body |= {"stop": [stop], "stream": stream}
    assert_conforms(served, plain, body, chat=False)
    whole = conformance.ask(client_of(plain.url), body | {"stream": False}, False)
    assert whole["choices"][0]["finish_reason"] == "stop"


def test_vllms_other_routes_answer_through_the_proxy_as_from_one_vllm(
    served_and_plain: tuple[Served, VLLMServer], model: Path
) -> None:
    """/tokenize (a text and a chat), /detokenize and /version, forwarded to an instance (with
    its key: the instances refuse the proxy's callers without it)."""
    served, plain = served_and_plain
    asks = [
        ("POST", "/tokenize", {"model": str(model), "prompt": "def f(x):"}),
        ("POST", "/tokenize", {"model": str(model), "messages": chat_messages("routes")}),
        ("POST", "/detokenize", {"model": str(model), "tokens": [100, 200, 300]}),
        ("GET", "/version", None),
    ]
    for method, path, body in asks:
        got = httpx.request(method, f"{served.url}{path}", json=body, timeout=30)
        want = httpx.request(method, f"{plain.url}{path}", json=body, timeout=30)
        assert (got.status_code, got.json()) == (want.status_code, want.json()), path


@pytest.mark.parametrize("stream", [False, True], ids=MODES)
@pytest.mark.parametrize("case", conformance.RESPONSES_CASES, ids=lambda case: case.name)
def test_the_responses_api_answers_as_one_vllm(
    served_and_plain: tuple[Served, VLLMServer],
    model: Path,
    case: conformance.ResponsesCase,
    stream: bool,
) -> None:
    """/v1/responses, served by a decode instance alone (and counted so): the same answer as
    one vLLM's, whole or event by event (ids and times aside), field by field of vLLM 0.32's
    Responses request (``conformance.RESPONSES_CASES``)."""
    served, plain = served_and_plain
    body = case.body(str(model), stream)
    alone = not_disaggregated(served, "responses")
    got = conformance.ask_responses(client_of(served.url), body)
    want = conformance.ask_responses(client_of(plain.url), body)
    found = conformance.differences(got, want, naming=conformance.RESPONSES_NAMING)
    assert not found, found
    assert ("refusal" in want) == case.refused, want
    if "request_id" in case.fields:  # the response is named after it
        ids = conformance.response_ids(got)
        assert ids and ids == conformance.response_ids(want), (ids, want)
    assert not_disaggregated(served, "responses") == alone + 1


def test_a_response_is_not_stored_as_in_one_vllm(
    served_and_plain: tuple[Served, VLLMServer],
) -> None:
    """With no store (vLLM's default), the same refusal to retrieve one."""
    served, plain = served_and_plain
    served_gone, plain_gone = (
        httpx.get(f"{url}/v1/responses/resp_0", timeout=30) for url in (served.url, plain.url)
    )
    assert (served_gone.status_code, served_gone.json()) == (404, plain_gone.json())
    assert plain_gone.status_code == 404


def test_decode_was_asked_on_first_token_notices(served: Served) -> None:
    """Across the conformance cases, most of decode's requests went out on prefill's notice,
    before its answer (the rest on the answer, which came first)."""
    found = notices(served)
    assert found["used"] >= found["after_answer"] and found["used"] > 0, found


def test_the_seed_and_logit_bias_change_one_vllms_answer(
    served_and_plain: tuple[Served, VLLMServer], model: Path
) -> None:
    """The controls of the conformance cases: what they set changes the answer, so an equal
    answer through the proxy says it was applied there too."""
    plain = client_of(served_and_plain[1].url)

    def text(**fields: Any) -> str:
        body = conformance.Case("control", fields, seed=2).body(str(model), False)
        return conformance.ask(plain, body, False)["choices"][0]["text"]

    assert text(temperature=1.5, seed=7) != text(temperature=1.5, seed=8)
    assert text(logit_bias={"100": 100}) != text()


FORCED = 10  # tokens of an answer forced on its continuation (what a client had)


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_an_answer_forced_through_its_first_tokens_goes_on_as_that_answer(
    served_and_plain: tuple[Served, VLLMServer], model: Path, sampling: str
) -> None:
    """What a decode migration relies on (``proxy/migration.py``): the client's request sent
    again to an instance that computes the prompt, its first ``FORCED`` output tokens forced to
    an answer's (``first_tok``, ``next_toks``; every vLLM here loads the processor), answers
    that answer: the same tokens, logprobs within the end-to-end tolerance, the same usage.
    Seeded sampling at temperature 1.5 with penalties too: the forced positions draw as they
    did. Control: other forced tokens change what follows."""
    url = served_and_plain[1].url
    body: dict[str, Any] = {
        "model": str(model),
        "prompt": "The history of the printing press",
        "max_tokens": 3 * FORCED,
        "logprobs": 2,
        "return_token_ids": True,
    }
    body["temperature"] = 0.0
    if sampling == "seeded":
        body |= {"temperature": 1.5, "seed": 7, "presence_penalty": 0.8, "frequency_penalty": 0.5}

    def ask(**params: Any) -> dict[str, Any]:
        extra = {"kv_transfer_params": params} if params else {}
        answer = httpx.post(f"{url}/v1/completions", json=body | extra, timeout=120)
        assert answer.status_code == 200, answer.text
        return answer.json()

    want = ask()
    ids = want["choices"][0]["token_ids"]
    assert len(ids) == 3 * FORCED
    got = ask(first_tok=ids[0], next_toks=ids[1:FORCED])
    assert got["choices"][0]["token_ids"] == ids
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    assert got["usage"] == want["usage"]
    assert not conformance.differences(got, want), conformance.differences(got, want)
    other = [*ids[: FORCED - 1], (ids[FORCED - 1] + 1) % 1000]
    changed = ask(first_tok=other[0], next_toks=other[1:])
    assert changed["choices"][0]["token_ids"][FORCED:] != ids[FORCED:]


def test_client_that_disconnects_leaves_nothing_running_upstream(
    served: Served, model: Path
) -> None:
    config = served.proxy_config()
    prefill, decode = config["prefill"][0]["url"], config["decode"][0]["url"]
    request = {
        **completion_request(model, token_prompt(500, seed=8)),
        # Long enough to outlast the control below on an idle core (1000 tokens once ran out
        # within its first seconds: the control then found nothing running).
        "max_tokens": 3000,
        # Still running when the client leaves, whatever the tiny model says: a greedy answer
        # whose logprobs differ within tolerance between runs could otherwise reach its end of
        # sequence early, and the control below would find nothing running.
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{served.url}/v1/completions", json=request, timeout=60) as response:
        events = (line for line in response.iter_lines() if line)
        for _ in range(3):
            next(events)
        # The control: decode is serving it. At least one, not exactly one: a request of an
        # earlier test that vLLM has not yet retired is no leak of this one (the next wait
        # still requires every upstream back at 0). vLLM's gauge once read 0 for 10 s while its
        # own log said "Running: 1 reqs" (a full-suite run, 2026-11-24): the proxy's count of
        # requests in flight upstream says it too.
        wait_for(
            lambda: _running(decode) >= 1 or scrape(served.url).get("proxy_outstanding", 0) >= 1,
            10,
            "decode running the request",
        )
    wait_for(lambda: _running(decode) == 0 and _running(prefill) == 0, 15, "upstreams idle")
    wait_for(lambda: served.stats("decode-0")["consumer_used_pages"] == 0, 15, "pages freed")
    # and the proxy keeps serving
    assert client_of(served.url).completions.create(model=str(model), prompt="x", max_tokens=3)


def instance_urls(served: Served) -> list[str]:
    config = served.proxy_config()
    return [instance["url"] for instance in config["prefill"] + config["decode"]]


@pytest.mark.parametrize("smuggled", [{"kv_transfer_params": "x"}, {"kv_transfer_params": ["x"]}])
def test_transfer_parameters_smuggled_in_vllm_xargs_get_400_and_the_instances_keep_serving(
    served: Served, model: Path, smuggled: dict[str, Any]
) -> None:
    """vLLM copies ``vllm_xargs`` into the sampling params' ``extra_args``, where it looks for
    ``kv_transfer_params``: a short prompt (served by decode alone) carrying them reached decode
    unchanged, decode answered 500, and the client got a 502. The door refuses them, on either
    path and endpoint; the control: the same requests without them are answered, and every
    instance is still healthy."""
    client = client_of(served.url)
    requests = {
        "short completion": {"prompt": "def f(", "max_tokens": 3},
        "long completion": {"prompt": token_prompt(300, seed=11), "max_tokens": 3},
        "short chat": {"messages": chat_messages("smuggled"), "max_tokens": 3},
    }
    for name, request in requests.items():
        create = (
            client.chat.completions.create if "messages" in request else (client.completions.create)
        )
        with pytest.raises(openai.BadRequestError, match="vllm_xargs"):
            create(model=str(model), **request, extra_body={"vllm_xargs": smuggled})
        assert create(model=str(model), **request).choices, name
    for url in instance_urls(served):
        assert httpx.get(f"{url}/health", timeout=5).status_code == 200


# Bodies the proxy's door lets through (it checks only what it reads) for vLLM to refuse.
LEFT_TO_VLLM = {
    "an image_url that is a number": {"content": [{"type": "image_url", "image_url": 5}]},
    "an image to a text model": {
        "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    },
    "a part of an unknown type": {"content": [{"type": "no-such-part", "text": "x"}]},
    "a cache_salt with a slash": {"content": "x", "cache_salt": "a/b"},
}


@pytest.mark.parametrize("case", list(LEFT_TO_VLLM))
def test_what_the_door_leaves_to_vllm_is_refused_with_a_4xx_not_a_5xx(
    served: Served, model: Path, case: str
) -> None:
    """Served by decode alone and through prefill (a long text added), each is vLLM's 4xx,
    passed on; the proxy then still serves."""
    fields = dict(LEFT_TO_VLLM[case])
    content = fields.pop("content")
    for padding in ("", "x " * 400):
        if isinstance(content, str):
            padded: str | list = content + padding
        else:
            padded = [*content, {"type": "text", "text": padding or "x"}]
        message = {"role": "user", "content": padded}
        body = {"model": str(model), "messages": [message], "max_tokens": 2, **fields}
        response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=120)
        assert 400 <= response.status_code < 500, (case, response.status_code, response.text)
    assert client_of(served.url).completions.create(model=str(model), prompt="x", max_tokens=2)


def test_an_instance_serve_started_refuses_calls_without_its_key(
    served: Served, model: Path
) -> None:
    """Each instance answers 401 to a call without the key ``serve`` gave it (on vLLM's own
    /v1 paths, and on /invocations, which vLLM's check leaves open and which runs a completion:
    a way around the proxy to the engine); the control: with the key (which the proxy reads
    from the file its config names) both are served. /health and /metrics stay open, and the
    key is on no command line."""
    key_file = Path(served.proxy_config()["instance_api_key_file"])
    key = key_file.read_text().strip()
    assert key and (key_file.stat().st_mode & 0o077) == 0
    body = {"model": str(model), "prompt": "x", "max_tokens": 2}
    with_key = {"Authorization": f"Bearer {key}"}
    for url in instance_urls(served):
        for path in ("/v1/completions", "/invocations"):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                response = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=30)
                assert response.status_code == 401, (url, path, response.text)
            response = httpx.post(f"{url}{path}", json=body, headers=with_key, timeout=120)
            assert response.status_code == 200, (url, path, response.text)
        assert httpx.get(f"{url}/v1/models", timeout=5).status_code == 401
        for path in ("/health", "/metrics"):
            assert httpx.get(f"{url}{path}", timeout=5).status_code == 200
    for pid in _descendants(served.process.pid):
        with contextlib.suppress(OSError):
            assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_vllm_benchmark_client_runs_against_the_proxy(served: Served, tmp_path: Path) -> None:
    """vLLM's own serving benchmark, as documented in benchmarks/vllm_bench_client.py (run as
    a module from the repository's root: run by its path, its folder would come first on the
    import path, and its neighbour ``kernels.py`` would pass for the ``kernels`` package that
    transformers looks for)."""
    result_file = "vllm-bench.json"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.vllm_bench_client",
            "--backend",
            "openai",
            "--base-url",
            served.url,
            "--dataset-name",
            "random",
            "--random-input-len",
            "200",
            "--random-output-len",
            "8",
            "--num-prompts",
            "4",
            "--save-result",
            "--result-dir",
            str(tmp_path),
            "--result-filename",
            result_file,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parent.parent,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads((tmp_path / result_file).read_text())
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["total_output_tokens"] == 4 * 8


def test_process_cpus_keep_every_process_of_an_instance_there(served: Served) -> None:
    """prefill-0 has ``process_cpus: "0"``: its API server, engine core and worker run on core
    0 alone; decode-0 has none (control): its API server and engine core run anywhere."""
    config = served.proxy_config()
    every_cpu = os.sched_getaffinity(0)
    assert len(every_cpu) >= 2  # else the control tells nothing
    for role, wanted in (("prefill", {0}), ("decode", every_cpu)):
        port = config[role][0]["url"].rsplit(":", 1)[1]
        server = next(
            pid
            for pid in _descendants(served.process.pid)
            if f"\0--port\0{port}\0" in Path(f"/proc/{pid}/cmdline").read_text()
        )
        processes = [server, *_descendants(server)]
        assert len(processes) >= 3, processes  # API server, engine core, worker
        placed = {pid: os.sched_getaffinity(pid) for pid in processes}
        if role == "decode":
            assert placed[server] == wanted, placed
        else:
            assert all(cpus == wanted for cpus in placed.values()), placed


def test_sigterm_stops_every_process_and_frees_every_port(served: Served) -> None:
    config = served.proxy_config()
    ports = [served.port] + [
        int(instance["url"].rsplit(":", 1)[1]) for instance in config["prefill"] + config["decode"]
    ]
    ports += [config["decode"][0]["init_port"], config["decode"][0]["alloc_port"]]
    started = _descendants(served.process.pid)
    assert len(started) >= 2  # control: the vLLM instances (and their engine processes)
    assert served.stop() == 0
    assert not [pid for pid in started if Path(f"/proc/{pid}").exists()]
    for port in ports:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(("127.0.0.1", port))  # fails if anything still holds it


def _descendants(root: int) -> list[int]:
    """Every process below ``root``, from the parent ids in /proc."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        parents[int(pid)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found
