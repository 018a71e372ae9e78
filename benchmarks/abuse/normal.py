"""The normal requests: a small fixed set of prompts, their baseline answers (greedy, with
logprobs) taken through the proxy before any attack, and the steady stream that sends them one
at a time while a door is attacked and checks every answer against its baseline."""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import openai

from benchmarks.chaos.judge import Answer, judge, random_tokens
from benchmarks.chaos.pools import CLIENT_TIMEOUT_S

# A request refused by the proxy's admission limit (503 with Retry-After) is sent again, as
# OpenAI's clients do, until this long after it was first sent; only then has it failed.
DEFERRAL_DEADLINE_S = 30.0
MAX_RETRY_AFTER_S = 5.0
OUTPUT_TOKENS = 8
FAILURE_PAUSE_S = 0.5


@dataclass(frozen=True, slots=True)
class NormalPrompt:
    """One normal request: token ids (completions) or a text (chat), streamed or not."""

    name: str
    tokens: tuple[int, ...] = ()
    text: str = ""
    stream: bool = False

    @property
    def chat(self) -> bool:
        return bool(self.text)


def prompts() -> list[NormalPrompt]:
    """Short prompts (decode serves them alone) and long ones (prefill pushes their KV to
    decode), completions and chat, streamed and not. Fixed: every run sends the same."""
    rng = random.Random(31)
    return [
        NormalPrompt("short-40", tuple(random_tokens(rng, 40))),
        NormalPrompt("long-600-stream", tuple(random_tokens(rng, 600)), stream=True),
        NormalPrompt("chat-text", text="The door holds because every byte is checked."),
        NormalPrompt("long-300", tuple(random_tokens(rng, 300))),
    ]


def compare(got: Answer, want: Answer) -> tuple[bool, str]:
    """(True, "") when ``got`` is ``want``: the same tokens, logprobs within
    ``LOGPROB_TOLERANCE``; else (False, how it differs)."""
    verdict, why = judge(got, want)
    return verdict == "ok", why


class Client:
    """The official ``openai`` client with the deployment's client key; no retries of its own."""

    def __init__(self, proxy_url: str, key: str, model: str) -> None:
        self._client = openai.OpenAI(
            base_url=f"{proxy_url}/v1", api_key=key, max_retries=0, timeout=CLIENT_TIMEOUT_S
        )
        self.model = model

    def ask(self, prompt: NormalPrompt) -> Answer:
        """The prompt's greedy answer: its tokens and their logprobs."""
        common = {"model": self.model, "max_tokens": OUTPUT_TOKENS, "temperature": 0}
        if prompt.chat:
            messages = [{"role": "user", "content": prompt.text}]
            chat = self._client.chat.completions.create(messages=messages, logprobs=True, **common)
            assert chat.choices[0].logprobs is not None
            content = chat.choices[0].logprobs.content or []
            return [t.token for t in content], [t.logprob for t in content]
        request = {"prompt": list(prompt.tokens), "logprobs": 1, **common}
        if not prompt.stream:
            choice = self._client.completions.create(**request).choices[0]
            assert choice.logprobs is not None
            return list(choice.logprobs.tokens or []), list(choice.logprobs.token_logprobs or [])
        tokens: list[str] = []
        logprobs: list[float] = []
        with self._client.completions.create(**request, stream=True) as events:
            for event in events:
                for part in event.choices:
                    if part.logprobs is not None:
                        tokens += part.logprobs.tokens or []
                        logprobs += part.logprobs.token_logprobs or []
        return tokens, logprobs

    def close(self) -> None:
        self._client.close()


def answer_check_control(baselines: dict[str, Answer]) -> dict[str, Any]:
    """The answer check's negative control: each baseline, judged as the answer of every other
    prompt, must read as changed (and as its own, unchanged)."""
    missed = [
        f"{a} as {b}"
        for a, b in itertools.permutations(baselines, 2)
        if compare(baselines[a], baselines[b])[0]
    ]
    unchanged = all(compare(answer, answer)[0] for answer in baselines.values())
    pairs = len(baselines) * (len(baselines) - 1)
    return {"pairs": pairs, "missed": missed, "ok": unchanged and not missed}


def baseline(client: Client, normal: list[NormalPrompt]) -> dict[str, Answer]:
    """Every prompt's answer before any attack."""
    return {prompt.name: client.ask(prompt) for prompt in normal}


@dataclass(slots=True)
class NormalRecord:
    prompt: str
    door: str  # the door under attack when it was sent
    started: float
    ended: float | None = None
    outcome: str = "pending"  # ok | changed | failed
    deferred: int = 0  # times the admission limit refused it before it was served
    detail: str = ""


class NormalStream:
    """Sends the normal prompts in turn, one at a time, from a thread of its own, each answer
    judged against its baseline and charged to ``door``, the door under attack when it was sent.
    Paused between doors, so that no request straddles two."""

    def __init__(
        self, client: Client, normal: list[NormalPrompt], baselines: dict[str, Answer]
    ) -> None:
        self.client, self.normal, self.baselines = client, normal, baselines
        self.records: list[NormalRecord] = []
        self._door = ""
        self._lock = threading.Lock()
        self._go = threading.Event()  # set: send; clear: paused
        self._idle = threading.Event()  # set while no request is in flight
        self._idle.set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="abuse-normal", daemon=True)
        self._thread.start()

    def resume(self, door: str) -> None:
        """Send again, each request charged to ``door``."""
        self._door = door
        self._go.set()

    def pause(self, timeout_s: float = CLIENT_TIMEOUT_S + DEFERRAL_DEADLINE_S) -> None:
        """Send no more until ``resume``, and wait until the request in flight ended."""
        self._go.clear()
        self._idle.wait(timeout_s)

    def stop(self) -> None:
        """Send no more; the request in flight ends by the client's timeout at the latest."""
        self._stop.set()
        self._go.set()
        self._thread.join(CLIENT_TIMEOUT_S + DEFERRAL_DEADLINE_S)

    def of(self, door: str) -> list[NormalRecord]:
        with self._lock:
            return [r for r in self.records if r.door == door]

    def wait_started(self, since: float, timeout_s: float) -> bool:
        """Until a request was sent after ``since`` (``time.monotonic``)."""
        return self._wait(lambda r: r.started >= since, 1, timeout_s)

    def wait_done(self, count: int, since: float, timeout_s: float) -> bool:
        """Until ``count`` requests sent after ``since`` (``time.monotonic``) have ended."""
        return self._wait(lambda r: r.started >= since and r.ended is not None, count, timeout_s)

    def _wait(self, counts: Callable[[NormalRecord], bool], count: int, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if sum(1 for r in self.records if counts(r)) >= count:
                    return True
            time.sleep(0.02)
        return False

    def _run(self) -> None:
        for index in itertools.count():
            self._go.wait()
            if self._stop.is_set():
                return
            prompt = self.normal[index % len(self.normal)]
            self._idle.clear()
            record = NormalRecord(prompt.name, self._door, time.monotonic())
            with self._lock:
                self.records.append(record)
            try:
                self._send(prompt, record)
            except Exception as exc:  # an answer of another shape: this request failed
                record.outcome, record.detail = "failed", f"{type(exc).__name__}: {exc}"[:300]
            finally:
                record.ended = time.monotonic()
                self._idle.set()
            if record.outcome == "failed":  # a dead instance fails at once: no busy loop
                self._stop.wait(FAILURE_PAUSE_S)

    def _send(self, prompt: NormalPrompt, record: NormalRecord) -> None:
        while True:
            try:
                got = self.client.ask(prompt)
            except openai.APIStatusError as exc:
                retry_after = _seconds(exc.response.headers.get("Retry-After"))
                waited = time.monotonic() - record.started
                if (
                    exc.status_code == 503
                    and retry_after is not None
                    and (waited < DEFERRAL_DEADLINE_S)
                ):
                    record.deferred += 1
                    time.sleep(min(retry_after, MAX_RETRY_AFTER_S))
                    continue
                record.outcome = "failed"
                record.detail = f"HTTP {exc.status_code}: {exc.message[:300]}"
            except openai.APIError as exc:
                record.outcome, record.detail = "failed", f"{type(exc).__name__}: {exc}"[:300]
            else:
                same, why = compare(got, self.baselines[prompt.name])
                record.outcome, record.detail = ("ok", "") if same else ("changed", why)
            return


def _seconds(header: str | None) -> float | None:
    """A Retry-After header's delay in seconds (None: absent or not a number)."""
    try:
        return None if header is None else max(0.0, float(header))
    except ValueError:
        return None
