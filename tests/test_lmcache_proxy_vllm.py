"""An LMCache PD deployment behind LMCache's proxy protocol, for real: a prefill and a decode
vLLM started as LMCache's xpyd and 1p1d launchers start them (``LMCACHE_CONFIG_FILE`` with
their YAML keys, an ``LMCACHE_*`` variable, ``"kv_connector": "LMCacheConnectorV1"`` and their
extras, ``--no-enable-prefix-caching``), with our module path, behind a client that speaks their
proxy's protocol, written here from it (``TheirProxy``): prompt ids to prefill with
``max_tokens: 1`` and ``{"ret_first_tok": true, "disagg_spec": ...}``, then one ``ProxyNotif``
per decode rank on a ZMQ PULL socket, then decode the prompt plus ``first_tok`` with no transfer
parameters, streamed. Greedy answers must equal the plain vLLM's, and decode's counters must show
the prompt loaded, not computed.

The short form (``make test``) runs prompts of 1, 257 and 1000 tokens, two at once and the
negative control; ``PD_LMCACHE_PROXY_FULL=1`` runs the whole list (1, 255, 257, 1000 and 3000
tokens, four at once, and the 1p1d shape, whose proxy sends no ``disagg_spec`` and waits for no
notice).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import yaml
import zmq

from lmcache_pd.deploy.vllm_server import VLLMServer
from lmcache_pd.metrics_scrape import prompt_tokens_by_source, scrape
from tests.helpers import free_port, wait_for
from tests.vllm_support import SERVER_ARGS, PlainVLLM, assert_close_answer, body, prompt

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
FULL = os.environ.get("PD_LMCACHE_PROXY_FULL") == "1"
LENGTHS = [1, 255, 257, 1000, 3000] if FULL else [1, 257, 1000]
AT_ONCE = 4 if FULL else 2
OUTPUT_TOKENS = 6
NOTICE_WAIT_S = 30.0  # their proxy waits forever; this client fails the test instead

PROMPTS = {f"len-{n}": prompt(n, 5800 + n) for n in LENGTHS}
PROMPTS |= {f"together-{i}": prompt(400 + 50 * i, 5900 + i) for i in range(AT_ONCE)}
PROMPTS["early"] = prompt(700, 5950)  # the negative control's
if FULL:
    PROMPTS |= {f"1p1d-{n}": prompt(n, 6000 + n) for n in (1, 257, 1000)}

# Their launchers' extras (named in a warning here, as meaning nothing to lmcache-pd).
PREFILL_EXTRAS = {"discard_partial_chunks": False, "lmcache_rpc_port": "producer1"}
DECODE_EXTRAS = {**PREFILL_EXTRAS, "lmcache_rpc_port": "consumer1", "skip_last_n_tokens": 1}


class PDMsgBase(msgspec.Struct, tag=True):
    """Their proxy's messages, from their struct definitions: tagged by class name."""


class ProxyNotif(PDMsgBase):
    req_id: str


class TheirProxy:
    """A client that speaks LMCache's proxy protocol to a prefill and a decode instance, and
    reads the notices prefill sends on its PULL socket (on a thread of its own)."""

    def __init__(self, port: int, model: Path) -> None:
        self.model = model
        self.notices: Counter[str] = Counter()
        self.arrived: dict[str, float] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.RCVTIMEO, 100)
        self._socket.bind(f"tcp://127.0.0.1:{port}")
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        decoder = msgspec.msgpack.Decoder(ProxyNotif)
        while not self._stop.is_set():
            try:
                raw = self._socket.recv()
            except zmq.Again:
                continue
            notice = decoder.decode(raw)
            with self._lock:
                self.notices[notice.req_id] += 1
                self.arrived.setdefault(notice.req_id, time.monotonic())

    def close(self) -> None:
        self._stop.set()
        self._reader.join(5)
        self._socket.close()
        self._context.term()

    def new_id(self) -> str:
        return str(next(self._ids))  # as theirs names requests: a counter

    def prefill(self, url: str, tokens: list[int], spec: dict[str, Any] | None) -> tuple[dict, int]:
        """Prefill's answer (one token, not streamed) and its ``first_tok``."""
        params: dict[str, Any] = {"ret_first_tok": True}
        if spec is not None:
            params["disagg_spec"] = spec
        request = body(self.model, tokens, 1, params) | {"stream": False}
        response = httpx.post(f"{url}/v1/completions", json=request, timeout=120)
        response.raise_for_status()
        answer = response.json()
        return answer, answer["kv_transfer_params"]["first_tok"]

    def wait_notices(self, req_id: str, ranks: int) -> None:
        wait_for(
            lambda: self.notices[req_id] >= ranks,
            NOTICE_WAIT_S,
            f"{ranks} ProxyNotif for request {req_id}",
        )

    def decode(self, url: str, tokens: list[int], first_tok: int) -> tuple[list[str], list[float]]:
        """Decode's streamed answer to the prompt plus ``first_tok``, with no transfer
        parameters: its tokens and their logprobs."""
        request = body(self.model, [*tokens, first_tok], OUTPUT_TOKENS - 1) | {"stream": True}
        texts: list[str] = []
        logprobs: list[float] = []
        with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=120) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = msgspec.json.decode(line.removeprefix("data: "))
                for choice in chunk["choices"]:
                    if choice.get("logprobs"):
                        texts += choice["logprobs"]["tokens"]
                        logprobs += choice["logprobs"]["token_logprobs"]
        return texts, logprobs


def head(answer: dict) -> tuple[list[str], list[float]]:
    logprobs = answer["choices"][0]["logprobs"]
    return logprobs["tokens"], logprobs["token_logprobs"]


class LMCachePair:
    """A prefill and a decode vLLM started as LMCache's launchers start them, with our module
    path, and their proxy's side: decode's receive ports and the notices' port."""

    def __init__(self, model: Path, workdir: Path) -> None:
        self.model = model
        self.init_port, self.alloc_port, self.proxy_port = free_port(), free_port(), free_port()
        self.proxy = TheirProxy(self.proxy_port, model)
        common = {
            "local_cpu": False,
            "max_local_cpu_size": 0,
            "enable_pd": True,
            "transfer_channel": "nixl",
            "pd_buffer_size": 1 << 28,
            "pd_buffer_device": "cpu",
            "nixl_backends": ["UCX"],
        }
        peer = {
            "pd_peer_host": "127.0.0.1",
            "pd_peer_init_port": [self.init_port],
            "pd_peer_alloc_port": [self.alloc_port],
        }
        prefiller = common | {
            "pd_role": "sender",
            "pd_proxy_host": "127.0.0.1",
            "pd_proxy_port": self.proxy_port,
            "save_unfull_chunk": True,
            **peer,  # the 1p1d shape's: where a request without a disagg_spec goes
        }
        decoder = common | {"pd_role": "receiver", **peer}
        self.prefill = self._start(workdir, "prefiller", prefiller, "kv_producer", cpu=0)
        self.decode = self._start(workdir, "decoder", decoder, "kv_consumer", cpu=1)
        try:  # both start at once
            self.prefill.wait_until_healthy()
            self.decode.wait_until_healthy()
        except BaseException:
            self.stop()
            raise

    def _start(self, workdir: Path, name: str, keys: dict, role: str, cpu: int) -> VLLMServer:
        path = workdir / f"lmcache-{name}-config.yaml"
        path.write_text(yaml.safe_dump(keys))
        extras = PREFILL_EXTRAS if role == "kv_producer" else DECODE_EXTRAS
        return VLLMServer(
            self.model,
            free_port(),
            workdir / f"{name}.log",
            kv_transfer_config={
                "kv_connector": "LMCacheConnectorV1",
                "kv_connector_module_path": "lmcache_pd.connector",
                "kv_role": role,
                "kv_connector_extra_config": extras,
            },
            cpu=cpu,
            # Their launchers' variables: a key by variable (LMCache reads LMCACHE_<KEY>).
            env={"LMCACHE_CONFIG_FILE": str(path), "LMCACHE_CHUNK_SIZE": "256"},
            extra_args=[*SERVER_ARGS, "--no-enable-prefix-caching"],
            log_stats=True,
            wait=False,
        )

    def spec(self, req_id: str) -> dict[str, Any]:
        """Their proxy's ``disagg_spec``: ports as lists, one per decode rank."""
        return {
            "req_id": req_id,
            "receiver_host": "127.0.0.1",
            "receiver_init_port": [self.init_port],
            "receiver_alloc_port": [self.alloc_port],
        }

    def xpyd(self, tokens: list[int]) -> tuple[tuple[list[str], list[float]], str]:
        """Their xpyd proxy's request: prefill, every notice, then decode; the answer and the
        request's id."""
        req_id = self.proxy.new_id()
        first, first_tok = self.proxy.prefill(self.prefill.url, tokens, self.spec(req_id))
        self.proxy.wait_notices(req_id, ranks=1)
        rest = self.proxy.decode(self.decode.url, tokens, first_tok)
        return (head(first)[0] + rest[0], head(first)[1] + rest[1]), req_id

    def one_p_one_d(self, tokens: list[int]) -> tuple[list[str], list[float]]:
        """Their 1p1d proxy's request: no disagg_spec, and decode asked on prefill's answer."""
        first, first_tok = self.proxy.prefill(self.prefill.url, tokens, None)
        rest = self.proxy.decode(self.decode.url, tokens, first_tok)
        return head(first)[0] + rest[0], head(first)[1] + rest[1]

    def sources(self) -> defaultdict[str, float]:
        """vLLM's own record of where decode's prompt tokens came from."""
        return defaultdict(float, prompt_tokens_by_source(self.decode.url))

    def counters(self, server: VLLMServer) -> defaultdict[str, float]:
        return defaultdict(float, scrape(server.url))

    def stop(self) -> None:
        self.decode.stop()
        self.prefill.stop()
        self.proxy.close()


@pytest.fixture(scope="module")
def reference(plain_vllm: PlainVLLM) -> dict[str, tuple]:
    return plain_vllm.answers(PROMPTS, OUTPUT_TOKENS)


@pytest.fixture(scope="module")
def pair(
    model: Path, reference: dict, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LMCachePair]:
    pair = LMCachePair(model, tmp_path_factory.mktemp("lmcache-pd"))
    try:
        yield pair
    finally:
        pair.stop()


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after.get(name, 0.0) - before.get(name, 0.0) for name in after}


def test_their_proxys_requests_are_answered_as_one_vllm_from_kv_decode_loaded(
    pair: LMCachePair, reference: dict
) -> None:
    """Each prompt: one notice (one decode rank), then decode's answer; the whole answer equals
    the plain vLLM's, and decode loaded all of the prompt (the partial last chunk too) and
    computed only prefill's token."""
    for n in LENGTHS:
        name = f"len-{n}"
        before = pair.sources()
        got, req_id = pair.xpyd(PROMPTS[name])
        assert_close_answer(got, reference[name], name)
        sources = moved(before, pair.sources())
        assert sources["external_kv_transfer"] == n, name
        assert sources["local_compute"] == 1, name
        assert pair.proxy.notices[req_id] == 1, name
    time.sleep(0.3)  # a second notice of any of them would have come by now
    assert set(pair.proxy.notices.values()) == {1}
    wait_for(
        lambda: pair.counters(pair.prefill)["proxy_notices"] == len(pair.proxy.notices),
        what="prefill's count of its notices",
    )


def test_requests_at_once_each_get_their_notice_and_their_kv(
    pair: LMCachePair, reference: dict
) -> None:
    names = [f"together-{i}" for i in range(AT_ONCE)]
    before = pair.sources()
    with ThreadPoolExecutor(AT_ONCE) as pool:
        answers = list(pool.map(lambda name: pair.xpyd(PROMPTS[name]), names))
    for name, (got, req_id) in zip(names, answers, strict=True):
        assert_close_answer(got, reference[name], name)
        assert pair.proxy.notices[req_id] == 1, name
    sources = moved(before, pair.sources())
    assert sources["external_kv_transfer"] == sum(len(PROMPTS[name]) for name in names)
    assert sources["local_compute"] == AT_ONCE


def test_a_proxy_that_asks_decode_before_the_notice_gets_the_answer_by_recompute(
    pair: LMCachePair, plain_vllm: PlainVLLM, reference: dict
) -> None:
    """The negative control: decode asked for the prompt plus its first token before prefill
    was (so before any notice): nothing has landed, decode waits its short while for it, then
    computes the whole prompt, and its answer is still one vLLM's; the counters say so. Prefill
    asked after still sends its notice."""
    tokens = PROMPTS["early"]
    first = plain_vllm.server.complete(body(pair.model, tokens, 1) | {"return_token_ids": True})
    first_tok = first["choices"][0]["token_ids"][0]
    before, counted = pair.sources(), pair.counters(pair.decode)
    rest = pair.proxy.decode(pair.decode.url, tokens, first_tok)
    assert_close_answer((head(first)[0] + rest[0], head(first)[1] + rest[1]), reference["early"])
    sources = moved(before, pair.sources())
    assert sources["external_kv_transfer"] == 0
    assert sources["local_compute"] == len(tokens) + 1
    wait_for(
        lambda: pair.counters(pair.decode)["landed_waits"] == counted["landed_waits"] + 1,
        what="decode's count of its wait",
    )
    assert pair.counters(pair.decode)["loads_local"] == counted["loads_local"]
    req_id = pair.proxy.new_id()
    pair.proxy.prefill(pair.prefill.url, tokens, pair.spec(req_id))
    pair.proxy.wait_notices(req_id, ranks=1)


@pytest.mark.skipif(not FULL, reason="the whole list: PD_LMCACHE_PROXY_FULL=1")
def test_their_1p1d_proxy_sends_no_spec_and_waits_for_no_notice(
    pair: LMCachePair, reference: dict
) -> None:
    """Prefill pushes to its configured peer; decode, asked on prefill's answer, loads the
    prompt once it shows landed."""
    for n in (1, 257, 1000):
        name = f"1p1d-{n}"
        before = pair.sources()
        assert_close_answer(pair.one_p_one_d(PROMPTS[name]), reference[name], name)
        sources = moved(before, pair.sources())
        assert sources["external_kv_transfer"] == n, name
        assert sources["local_compute"] == 1, name
