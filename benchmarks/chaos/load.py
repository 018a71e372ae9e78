"""The steady load through the proxy: each phase's prompts, and the stream that sends them and
records every request's outcome."""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import openai

from benchmarks.chaos.judge import Answer, Prompt, judge, random_tokens
from benchmarks.chaos.pools import CLIENT_TIMEOUT_S

LENGTHS = (1, 31, 255, 256, 257, 700, 1000, 1500, 2200, 3000)
SHARED_PREFIX_TOKENS = 1024  # whole chunks (256) and whole vLLM blocks (128)
OUTPUT_TOKENS = (4, 8, 12, 16)
PREEMPT_BURST = 8  # the preemption fault's concurrent requests


def stream_prompts(phase: int, count: int) -> list[Prompt]:
    """The stream's prompts of one phase: mixed lengths, every fourth on a shared prefix."""
    rng = random.Random(1000 + phase)
    prefix = random_tokens(rng, SHARED_PREFIX_TOKENS)
    prompts = []
    for index in range(count):
        tokens = (
            prefix + random_tokens(rng, rng.randrange(1, 800))
            if index % 4 == 3
            else random_tokens(rng, rng.choice(LENGTHS))
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
            Prompt(f"f{phase}-{i}", random_tokens(rng, rng.randrange(1140, 1150)), 160, i % 2 == 0)
            for i in range(PREEMPT_BURST)
        ]
    if fault == "client_disconnect":
        return [
            Prompt(f"f{phase}-{i}", random_tokens(rng, rng.randrange(1500, 3000)), 32, True)
            for i in range(3)
        ]
    return []


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
    # Seconds between successive chunks that carried tokens (streamed requests): the pauses a
    # client saw, from which ITL percentiles and a migrated stream's longest pause are read.
    gaps: list[float] = field(default_factory=list)

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
        if prompt.ignore_eos:
            request["extra_body"] = {"ignore_eos": True}
        if not prompt.stream:
            response = self.client.completions.create(**request)
            record.first_token, record.response_id = self.now(), response.id
            choice = response.choices[0]
            assert choice.logprobs is not None
            return list(choice.logprobs.tokens or []), list(choice.logprobs.token_logprobs or [])
        tokens: list[str] = []
        logprobs: list[float] = []
        last_chunk: float | None = None
        with self.client.completions.create(**request, stream=True) as events:
            for event in events:  # tokens, not events: one event may carry several
                record.response_id = event.id
                had = len(tokens)
                for choice in event.choices:
                    if choice.logprobs is not None:
                        tokens += choice.logprobs.tokens or []
                        logprobs += choice.logprobs.token_logprobs or []
                if len(tokens) > had:
                    now = self.now()
                    if last_chunk is not None:
                        record.gaps.append(round(now - last_chunk, 4))
                    last_chunk = now
                if tokens and record.first_token is None:
                    record.first_token = self.now()
                    if disconnect:
                        return None  # leaving the block closes the connection
        return tokens, logprobs
