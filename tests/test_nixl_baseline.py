"""The serving benchmark's baseline (``benchmarks/nixl_baseline.py``): vLLM's own NixlConnector
1P1D behind a router that follows vLLM's protocol.

First the router alone, between stand-ins for vLLM (``lmcache_pd/harness/standin.py``): what P
and D are
sent, and how failures and a client that goes away are handled. Then the real thing: its greedy
answers must equal one plain vLLM instance's, streamed and not, and vLLM's own counters on D
must show that the prompt came over NIXL from P rather than being computed again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.nixl_baseline import PREFILL_PARAMS, NixlBaseline, NixlRouter
from lmcache_pd.deploy.vllm_server import VLLMServer
from lmcache_pd.harness.app_thread import AppThread
from lmcache_pd.harness.standin import Fault, Standin, StandinState, next_token
from tests.helpers import free_port, wait_for
from tests.vllm_support import (
    LOGPROB_TOLERANCE,
    SERVER_ARGS,
    Answer,
    PlainVLLM,
    answer,
    prompt,
)

logger = logging.getLogger(__name__)

# ---- the router between stand-ins ----


class Routed:
    """A stand-in P and D, and the router in front of them, each in a thread."""

    def __init__(
        self, prefill: Standin | int, decode: Standin | int, read_timeout_s: float = 5.0
    ) -> None:
        """A port instead of a stand-in: nobody listens there."""
        self._stack = contextlib.ExitStack()
        urls = []
        for upstream in (prefill, decode):
            if isinstance(upstream, int):
                urls.append(f"http://127.0.0.1:{upstream}")
            else:
                thread = AppThread(upstream.app(), "127.0.0.1", free_port())
                urls.append(self._stack.enter_context(thread).url)
        router = NixlRouter(urls[0], urls[1], connect_timeout_s=1.0, read_timeout_s=read_timeout_s)
        self.url = self._stack.enter_context(AppThread(router.app(), "127.0.0.1", free_port())).url
        self.prefill, self.decode = prefill, decode

    def post(self, body: dict[str, Any], timeout_s: float = 10.0) -> httpx.Response:
        return httpx.post(f"{self.url}/v1/completions", json=body, timeout=timeout_s)

    def close(self) -> None:
        self._stack.close()


@pytest.fixture
def routed() -> Iterator[Any]:
    made: list[Routed] = []

    def make(prefill: Standin | int | None = None, decode: Standin | int | None = None, **kw):
        made.append(Routed(prefill or Standin(), decode or Standin(), **kw))
        return made[-1]

    yield make
    for one in made:
        one.close()


def sse_events(response: httpx.Response) -> list[dict[str, Any] | str]:
    """A streamed answer's events, ``[DONE]`` as the string."""
    events: list[dict[str, Any] | str] = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else msgspec.json.decode(data))
    return events


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_gets_one_token_and_decode_the_client_body_with_prefills_params(
    routed, stream: bool
) -> None:
    prefill, decode = Standin(), Standin()
    router = routed(prefill, decode)
    body = {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 6,
        "max_completion_tokens": 6,
        "min_tokens": 2,
        "logprobs": 1,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        if stream:
            events = sse_events(response)
            texts = [e["choices"][0]["text"] for e in events[:-2] if isinstance(e, dict)]
            assert len(texts) == 6 and events[-1] == "[DONE]"
            assert events[-2]["usage"]["completion_tokens"] == 6
        else:
            response.read()
            assert response.json()["choices"][0]["text"]  # decode's answer, passed through
    [(_, _, sent_to_prefill)] = prefill.state.received
    assert sent_to_prefill == {
        "model": "m",
        "prompt": [5, 6, 7],
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "logprobs": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_PARAMS,
    }
    [(_, _, sent_to_decode)] = decode.state.received
    # The stand-in's prefill answers {"first_tok": ...} where vLLM's answers its block ids.
    assert sent_to_decode == {**body, "kv_transfer_params": {"first_tok": next_token([5, 6, 7])}}


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("fault", ["status_500", "hang", "nobody_there"])
def test_failing_upstream_is_a_502_within_the_read_deadline(routed, role: str, fault: str) -> None:
    upstream: Standin | int = {
        "status_500": lambda: Standin(StandinState(fault=Fault.STATUS_500)),
        "hang": lambda: Standin(StandinState(fault=Fault.HANG)),
        "nobody_there": free_port,
    }[fault]()
    healthy = Standin()
    router = routed(
        **{role: upstream, "decode" if role == "prefill" else "prefill": healthy},
        read_timeout_s=0.5,
    )
    started = time.monotonic()
    response = router.post({"model": "m", "prompt": [1, 2], "max_tokens": 4})
    assert time.monotonic() - started < 5
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == 502 and error["message"].startswith(f"{role} ")
    if role == "prefill":
        assert healthy.state.received == []  # decode never asked


def test_decode_failing_mid_stream_ends_the_stream_with_an_error_event(routed) -> None:
    router = routed(decode=Standin(StandinState(fault=Fault.DIE_MID_STREAM)))
    body = {"model": "m", "prompt": [1, 2], "max_tokens": 8, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert [e["choices"][0]["text"] != "" for e in events[:2]] == [True, True]
    assert events[2]["error"]["code"] == 502
    assert "decode" in events[2]["error"]["message"]
    assert events[3:] == ["[DONE]"]


def test_client_that_disconnects_mid_stream_cancels_decodes_request(routed) -> None:
    decode = Standin(StandinState(token_delay_s=0.2))
    router = routed(decode=decode)
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body) as response:
        lines = (line for line in response.iter_lines() if line)
        assert next(lines).startswith("data: ")
    wait_for(lambda: decode.state.cancelled == 1, 5, "decode's request cut")
    assert decode.state.in_flight == 0


def test_health_needs_both_and_models_come_from_prefill(routed) -> None:
    router = routed()
    assert httpx.get(f"{router.url}/health").status_code == 200
    assert httpx.get(f"{router.url}/v1/models").json()["data"][0]["id"] == "standin"
    down = routed(decode=free_port())
    assert httpx.get(f"{down.url}/health").json() == {"up": {"prefill": True, "decode": False}}


def test_malformed_body_is_a_400(routed) -> None:
    router = routed()
    response = httpx.post(f"{router.url}/v1/completions", content=b"{not json")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "BadRequestError"


# ---- the real thing: vLLM with NixlConnector ----

LENGTHS = [40, 300, 1000]
MODES = ["whole", "streamed"]
OUTPUT_TOKENS = 8
# D's steps after a load differ from a plain instance's prefill: logprobs are compared within
# LOGPROB_TOLERANCE (see tests/vllm_support.py).

# A prompt of its own per mode: one seen before would be served partly from the prefix cache.
PROMPTS = {
    f"len-{n}-{mode}": prompt(n, 1000 * n + index)
    for n in LENGTHS
    for index, mode in enumerate(MODES)
}
PROMPTS["control"] = prompt(300, 7)


def body(model: Path, tokens: list[int], stream: bool = False) -> dict[str, Any]:
    return {
        "model": str(model),
        "prompt": tokens,
        "max_tokens": OUTPUT_TOKENS,
        "temperature": 0,
        "logprobs": 1,
        "stream": stream,
    }


def streamed_answer(url: str, request: dict[str, Any]) -> tuple[Answer, float]:
    """The tokens and logprobs of a streamed completion, and its time to first token (s)."""
    tokens: list[str] = []
    logprobs: list[float] = []
    started, first = time.perf_counter(), None
    with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for event in sse_events(response):
            if event == "[DONE]":
                break
            assert isinstance(event, dict) and "error" not in event, event
            for choice in event["choices"]:
                if choice["logprobs"] and choice["logprobs"]["tokens"]:
                    first = first or time.perf_counter()
                    tokens += choice["logprobs"]["tokens"]
                    logprobs += choice["logprobs"]["token_logprobs"]
    assert first is not None
    return (tokens, logprobs), first - started


def prompt_tokens_by_source(server: VLLMServer) -> dict[str, float]:
    """vLLM's ``vllm:prompt_tokens_by_source`` counters: ``local_compute``, ``local_cache_hit``
    and ``external_kv_transfer`` (tokens loaded by the KV connector, here over NIXL)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        sample.labels["source"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "vllm:prompt_tokens_by_source"
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {source: after[source] - before.get(source, 0.0) for source in after}


@pytest.fixture(scope="module")
def reference(plain_vllm: PlainVLLM) -> dict[str, Answer]:
    return plain_vllm.answers(PROMPTS, OUTPUT_TOKENS)


@pytest.fixture(scope="module")
def baseline(
    model: Path, reference: dict, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[NixlBaseline]:
    started = time.perf_counter()
    pd = NixlBaseline(
        model, tmp_path_factory.mktemp("nixl"), extra_args=SERVER_ARGS, log_stats=True
    )
    with pd:
        logger.warning(
            "nixl baseline up in %.1f s; warm-up request %.1f s",
            time.perf_counter() - started,
            pd.warm_up(),
        )
        yield pd
    assert pd.prefill is not None and pd.decode is not None
    assert not pd.prefill.running and not pd.decode.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{pd.url}/health")


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("length", LENGTHS)
def test_answer_equals_one_instance_and_decode_loaded_the_prompt_over_nixl(
    baseline: NixlBaseline, reference: dict, model: Path, length: int, mode: str
) -> None:
    assert baseline.prefill is not None and baseline.decode is not None
    name = f"len-{length}-{mode}"
    tokens = PROMPTS[name]
    before_p = prompt_tokens_by_source(baseline.prefill)
    before_d = prompt_tokens_by_source(baseline.decode)
    if mode == "streamed":
        got, ttft = streamed_answer(baseline.url, body(model, tokens, stream=True))
        logger.warning("%s: TTFT %.0f ms through the router", name, 1000 * ttft)
    else:
        response = httpx.post(
            f"{baseline.url}/v1/completions", json=body(model, tokens), timeout=120
        )
        assert response.status_code == 200, response.text
        got = answer(response.json())
    assert got[0] == reference[name][0]
    assert got[1] == pytest.approx(reference[name][1], abs=LOGPROB_TOLERANCE, rel=0)
    # P computed the prompt; D loaded all of it from P and computed none of it.
    wait_for(
        lambda: (
            delta(prompt_tokens_by_source(baseline.decode), before_d)["external_kv_transfer"]
            >= length
        ),
        5,
        "D's counters",
    )
    assert delta(prompt_tokens_by_source(baseline.prefill), before_p)["local_compute"] == length
    assert delta(prompt_tokens_by_source(baseline.decode), before_d) == {
        "local_compute": 0,
        "local_cache_hit": 0,
        "external_kv_transfer": length,
    }


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_control_decode_asked_directly_computes_the_prompt_itself(
    baseline: NixlBaseline, reference: dict, model: Path
) -> None:
    """Negative control for the counters above: without P's kv_transfer_params, D's counters
    show the prompt computed locally and nothing loaded (and the same answer)."""
    assert baseline.decode is not None
    before = prompt_tokens_by_source(baseline.decode)
    got = answer(baseline.decode.complete(body(model, PROMPTS["control"])))
    assert got[0] == reference["control"][0]
    assert got[1] == pytest.approx(reference["control"][1], abs=LOGPROB_TOLERANCE, rel=0)
    wait_for(
        lambda: delta(prompt_tokens_by_source(baseline.decode), before)["local_compute"] > 0,
        5,
        "D's counters",
    )
    assert delta(prompt_tokens_by_source(baseline.decode), before) == {
        "local_compute": 300,
        "local_cache_hit": 0,
        "external_kv_transfer": 0,
    }
