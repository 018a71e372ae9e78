"""The multi-turn benchmark's client side (``benchmarks/multi_turn.py``): conversations made of
random words, an asyncio client that streams every turn through the chat endpoint and times its
chunks, and the pure accounting on top (new tokens per turn, per-turn statistics).

Kept apart from the pools and proxies so that the fast lane can test what decides the numbers
(which messages a turn sends, what counts as a turn's new tokens, the percentiles) without
starting anything.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai

# Beyond the proxy's own read deadlines (120 s): a request that hangs shows as a timeout.
REQUEST_TIMEOUT_S = 180.0
# A turn sent this long after its place in a schedule counts as late (``TurnResult.late_s``).
LATE_S = 0.05
# Words of the tiny model's vocabulary that are one token each with their leading space (the
# byte-level BPE writes that space as "Ġ"): N of them make a text of about N tokens.
WORD_TOKEN = re.compile(r"\u0120([a-z]{3,})")


@dataclass(frozen=True, slots=True)
class Shape:
    """What one run sends: ``conversations`` chats of ``turns`` turns each, all opening with the
    same system prompt of ``system_tokens`` words; each turn adds a user message of
    ``user_tokens`` words (the first turn's carries a document of ``document_tokens`` more, as
    a chat about a file does) and asks for ``answer_tokens`` tokens (forced: ``ignore_eos``)."""

    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    answer_tokens: int
    document_tokens: int = 0

    def longest_prompt(self, per_message: int = 8) -> int:
        """Tokens of the last turn's prompt plus its answer, roughly: every word a token, and
        ``per_message`` tokens of chat template around each message."""
        messages = 1 + 2 * self.turns
        words = self.system_tokens + self.document_tokens
        words += self.turns * (self.user_tokens + self.answer_tokens)
        return words + per_message * messages


@dataclass(frozen=True, slots=True)
class Conversation:
    """A chat's fixed parts: the system prompt and the user message of every turn."""

    name: str
    system: str
    users: tuple[str, ...]


@dataclass(slots=True)
class TurnResult:
    """One turn as the client saw it (seconds relative to its own start, except
    ``started_at``: since the run's start)."""

    conversation: str
    turn: int  # 1-based
    started_at: float = 0.0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # The tokens this turn added to its conversation (``account_new_tokens``).
    new_tokens: int | None = None
    # The response's id (the proxy's request id for a disaggregated turn) and the KV bytes
    # prefill pushed for it, from the producers' traces (``attribute_pushed_bytes``).
    response_id: str | None = None
    pushed_bytes: float | None = None
    answer: str = ""
    error: str | None = None
    # Seconds this turn was sent after its place in the run's schedule (``schedule_pace``): its
    # previous answer ended later than that; 0 without a schedule.
    late_s: float = 0.0

    def as_record(self) -> dict[str, Any]:
        """What the JSON keeps of it: no answer text and no single gaps."""
        return {
            "conversation": self.conversation,
            "turn": self.turn,
            "started_at_s": round(self.started_at, 4),
            "ttft_ms": None if self.ttft_s is None else self.ttft_s * 1e3,
            "itl_ms_p50": percentile_ms(self.gaps_s, 50),
            "e2e_ms": None if self.e2e_s is None else self.e2e_s * 1e3,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "new_tokens": self.new_tokens,
            "pushed_bytes": self.pushed_bytes,
            "late_s": round(self.late_s, 4),
            "error": self.error,
        }


def vocabulary_words(tokenizer_json: Path) -> dict[str, int]:
    """The words a tokenizer holds as single tokens after a space, each with its token id, in a
    fixed order."""
    vocab = json.loads(tokenizer_json.read_text())["model"]["vocab"]
    words = {m[1]: vocab[token] for token in vocab if (m := WORD_TOKEN.fullmatch(token))}
    if len(words) < 100:
        raise ValueError(f"{tokenizer_json}: only {len(words)} single-token words")
    return dict(sorted(words.items()))


def make_conversations(
    words: Sequence[str], shape: Shape, seed: int, run_id: str
) -> list[Conversation]:
    """The run's conversations: random words from an RNG seeded by ``seed`` and ``run_id``, so
    that every run sends text no other run sent and no run's cache serves another's prompts
    (the runs share the same instances). One system prompt for all of them, as a deployment's
    system prompt is."""
    rng = random.Random(f"multi-turn:{seed}:{run_id}")

    def text(count: int) -> str:
        return " ".join(rng.choice(words) for _ in range(count))

    system = text(shape.system_tokens)
    return [
        Conversation(
            f"{run_id}/c{index}",
            system,
            tuple(
                text(shape.user_tokens + (shape.document_tokens if turn == 0 else 0))
                for turn in range(shape.turns)
            ),
        )
        for index in range(shape.conversations)
    ]


def turn_messages(conversation: Conversation, answers: Sequence[str]) -> list[dict[str, str]]:
    """The chat messages of the turn after ``answers``: the system prompt, every earlier user
    message followed by its answer, then this turn's user message (turn ``len(answers) + 1``)."""
    turn = len(answers)
    if turn >= len(conversation.users):
        raise ValueError(f"{conversation.name} has {len(conversation.users)} turns, not {turn + 1}")
    messages = [{"role": "system", "content": conversation.system}]
    for user, answer in zip(conversation.users, answers, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": conversation.users[turn]})
    return messages


def account_new_tokens(turns: Sequence[TurnResult]) -> None:
    """Set each turn's ``new_tokens``: what it adds beyond all that the turn before it sent or
    produced, from the token counts usage reports: turn t's prompt tokens minus turn t-1's
    prompt and completion tokens (its user message and the chat template around it, plus any
    difference of the previous answer tokenized again as text); turn 1: its whole prompt. The
    previous answer is counted as that turn's completion, not as new. None where a count is
    missing (a failed turn, or the turn after one)."""
    before: TurnResult | None = None
    for result in sorted(turns, key=lambda r: r.turn):
        if result.prompt_tokens is None:
            result.new_tokens = None
        elif result.turn == 1:
            result.new_tokens = result.prompt_tokens
        elif (
            before is not None
            and before.turn == result.turn - 1
            and before.prompt_tokens is not None
            and before.completion_tokens is not None
        ):
            result.new_tokens = (
                result.prompt_tokens - before.prompt_tokens - before.completion_tokens
            )
        else:
            result.new_tokens = None
        before = result


def percentile_ms(seconds: Sequence[float], q: float) -> float | None:
    """The ``q``th percentile (numpy's linear interpolation, as ``serving_load`` takes it) in
    milliseconds; None for no values."""
    return float(np.percentile(seconds, q)) * 1e3 if seconds else None


def streams_at_each_token(results: Sequence[TurnResult]) -> list[tuple[int, float]]:
    """For every token the client received after a turn's first: how many answers (that one
    included) were streaming then, and the gap before it."""
    streamed = [
        r for r in results if r.error is None and r.ttft_s is not None and r.e2e_s is not None
    ]
    starts = np.sort([r.started_at + r.ttft_s for r in streamed])
    ends = np.sort([r.started_at + r.e2e_s for r in streamed])
    found: list[tuple[int, float]] = []
    for r in streamed:
        at = r.started_at + r.ttft_s + np.cumsum(r.gaps_s)
        began = np.searchsorted(starts, at, side="right")
        over = np.searchsorted(ends, at, side="left")
        found.extend(zip((began - over).tolist(), r.gaps_s, strict=True))
    return found


def streams_at_once(results: Sequence[TurnResult]) -> float | None:
    """Median over every token the client received after a turn's first: how many answers
    (that one included) were streaming then. ITL p50 is over the same tokens, and with the
    decode instances sharing cores it grows with this: a policy that brings answers out of
    prefill's queue sooner streams more of them at once. None without such tokens."""
    counts = [count for count, _ in streams_at_each_token(results)]
    return float(np.median(counts)) if counts else None


def itl_streaming_alone_ms(results: Sequence[TurnResult]) -> float | None:
    """ITL p50 over the tokens received while their answer was the only one streaming: what a
    decode step costs a stream apart from how many answers a policy has streaming at once
    (``streams_at_once``). None without such tokens."""
    return percentile_ms([gap for count, gap in streams_at_each_token(results) if count == 1], 50)


def turn_statistics(results: Sequence[TurnResult]) -> dict[int, dict[str, Any]]:
    """Per turn index: requests, failures, TTFT p50/p90 and ITL p50 (ms, over the successful
    requests of that turn), mean prompt and new tokens. Later turns carry longer histories, so
    their TTFT tells whether that history was computed again or found cached."""
    table: dict[int, dict[str, Any]] = {}
    for turn in sorted({r.turn for r in results}):
        rows = [r for r in results if r.turn == turn]
        done = [r for r in rows if r.error is None and r.ttft_s is not None]
        prompts = [r.prompt_tokens for r in done if r.prompt_tokens is not None]
        new = [r.new_tokens for r in done if r.new_tokens is not None]
        table[turn] = {
            "requests": len(rows),
            "failures": len(rows) - len(done),
            "ttft_ms_p50": percentile_ms([r.ttft_s for r in done if r.ttft_s is not None], 50),
            "ttft_ms_p90": percentile_ms([r.ttft_s for r in done if r.ttft_s is not None], 90),
            "itl_ms_p50": percentile_ms([g for r in done for g in r.gaps_s], 50),
            "prompt_tokens_mean": statistics.fmean(prompts) if prompts else None,
            "new_tokens_mean": statistics.fmean(new) if new else None,
        }
    return table


async def ask(
    client: openai.AsyncOpenAI,
    model: str,
    messages: list[dict[str, str]],
    result: TurnResult,
    answer_tokens: int,
    answer_token_ids: Sequence[int] | None = None,
) -> None:
    """One streamed chat turn at temperature 0, its answer forced to ``answer_tokens`` (of
    ``answer_token_ids`` only, where given: vLLM's ``allowed_token_ids``): fills
    ``result`` with the time to the first chunk, the gaps between chunks, the answer and the
    usage, or the error. Bounded by ``REQUEST_TIMEOUT_S`` as a whole."""
    started = last = time.perf_counter()
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            stream = await client.chat.completions.create(
                model=model,
                messages=messages,  # type: ignore[arg-type]
                max_tokens=answer_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True}
                | ({} if answer_token_ids is None else {"allowed_token_ids": answer_token_ids}),
            )
            async with stream:
                async for chunk in stream:
                    if chunk.usage is not None:
                        result.prompt_tokens = chunk.usage.prompt_tokens
                        result.completion_tokens = chunk.usage.completion_tokens
                    result.response_id = result.response_id or chunk.id
                    if not chunk.choices:
                        continue
                    now = time.perf_counter()
                    if result.ttft_s is None:
                        result.ttft_s = now - started
                    else:
                        result.gaps_s.append(now - last)
                    last = now
                    result.answer += chunk.choices[0].delta.content or ""
    # A stream cut mid-read surfaces as httpx's own error, not wrapped by openai.
    except (openai.OpenAIError, httpx.HTTPError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
        return
    result.e2e_s = time.perf_counter() - started
    if result.ttft_s is None:
        result.error = "no token"
    elif result.prompt_tokens is None:
        result.error = "no usage"


# How long a conversation waits before its turn ``turn`` (>= 2), given the seconds since its first
# turn was sent. A negative wait is a turn already late for its place in a schedule.
Pace = Callable[[int, float], float]


def think_pace(seed: str, mean_s: float) -> Pace:
    """Users who pause after each answer, exponentially with mean ``mean_s`` (as vLLM's
    multi-turn client pauses between a client's requests); the pauses come from ``seed``, so
    that two policies' runs of one index pause alike. The next turn's time then depends on
    when the answer ended: a policy that answers sooner is sent its turns sooner."""
    pauses = random.Random(seed)
    return lambda turn, elapsed: pauses.expovariate(1 / mean_s)


def schedule_pace(interval_s: float) -> Pace:
    """Turns at fixed times: a conversation's turn k is sent ``(k - 1) * interval_s`` after its
    first, or the moment the answer before it ends where that is later (the turn is then late).
    While no turn is late, every policy is offered the same requests at the same times (an open
    loop), so what it does to ITL is not mixed with how soon it lets the users send more."""
    return lambda turn, elapsed: (turn - 1) * interval_s - elapsed


async def converse(
    client: openai.AsyncOpenAI,
    model: str,
    conversation: Conversation,
    answer_tokens: int,
    run_started: float,
    answer_token_ids: Sequence[int] | None = None,
    pace: Pace | None = None,
) -> list[TurnResult]:
    """A conversation's turns one after the other, each resending the whole conversation with
    the previous answer as its text; a failed turn ends it (its later turns are counted as
    failed). ``pace``: when each turn after the first is sent (None: as its answer ends)."""
    results: list[TurnResult] = []
    answers: list[str] = []
    first_sent = time.perf_counter()
    for turn in range(1, len(conversation.users) + 1):
        late_s = 0.0
        if turn > 1 and pace is not None and len(answers) == turn - 1:
            wait_s = pace(turn, time.perf_counter() - first_sent)
            late_s = max(0.0, -wait_s)
            await asyncio.sleep(max(0.0, wait_s))
        result = TurnResult(
            conversation.name, turn, time.perf_counter() - run_started, late_s=late_s
        )
        results.append(result)
        if len(answers) < turn - 1:
            result.error = "not sent: an earlier turn failed"
            continue
        messages = turn_messages(conversation, answers)
        await ask(client, model, messages, result, answer_tokens, answer_token_ids)
        if result.error is None:
            answers.append(result.answer)
    account_new_tokens(results)
    return results


async def drive(
    base_url: str,
    model: str,
    conversations: Sequence[Conversation],
    answer_tokens: int,
    *,
    answer_token_ids: Sequence[int],
    concurrency: int | None,
    rate: float | None,
    arrivals_seed: int,
    think_s: float | None = None,
    turn_interval_s: float | None = None,
) -> list[TurnResult]:
    """Every conversation, ``concurrency`` at a time (each one's turns in sequence) or started
    at Poisson arrivals of ``rate`` per second (exactly one of the two; the arrival times come
    from ``arrivals_seed``, so that two policies' runs of one index see the same ones). Answers
    are made of ``answer_token_ids`` only: the tiny model's free answers are arbitrary tokens
    whose text tokenizes otherwise (often many times longer) when sent back, which a real
    model's prose does not; single-token words sent back tokenize exactly as generated, so the
    next turn's prompt extends the tokens the instance that answered holds, as it would.
    ``think_s``: the mean of a user's pause between an answer and the next turn (exponential,
    as vLLM's multi-turn client pauses between a client's requests; drawn from ``arrivals_seed``
    and the conversation, so that two policies' runs of one index pause alike); None: none.
    ``turn_interval_s`` instead: each conversation's turns at that fixed interval
    (``schedule_pace``)."""
    if (concurrency is None) == (rate is None):
        raise ValueError("give either a concurrency or a rate")
    if think_s is not None and turn_interval_s is not None:
        raise ValueError("give a think time or a turn interval, not both")
    run_started = time.perf_counter()
    async with openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=REQUEST_TIMEOUT_S
    ) as client:

        async def one(index: int, conversation: Conversation) -> list[TurnResult]:
            pace = None
            if think_s is not None:
                pace = think_pace(f"think:{arrivals_seed}:{index}", think_s)
            elif turn_interval_s is not None:
                pace = schedule_pace(turn_interval_s)
            return await converse(
                client, model, conversation, answer_tokens, run_started, answer_token_ids, pace
            )

        if concurrency is not None:
            slots = asyncio.Semaphore(concurrency)

            async def bounded(index: int, conversation: Conversation) -> list[TurnResult]:
                async with slots:
                    return await one(index, conversation)

            done = await asyncio.gather(*(bounded(*c) for c in enumerate(conversations)))
        else:
            assert rate is not None
            arrivals = random.Random(arrivals_seed)
            tasks = []
            for index, conversation in enumerate(conversations):
                tasks.append(asyncio.create_task(one(index, conversation)))
                await asyncio.sleep(arrivals.expovariate(rate))
            done = await asyncio.gather(*tasks)
    return [result for results in done for result in results]


def pushed_bytes_by_request(traces: Iterable[Path]) -> dict[str, float]:
    """KV bytes pushed per disaggregated request id, from producers' trace files (one
    ``{"event": "push", "req_id", "bytes"}`` line per push to a decode rank)."""
    pushed: dict[str, float] = {}
    for trace in traces:
        for line in trace.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "push" and "bytes" in record:
                pushed[record["req_id"]] = pushed.get(record["req_id"], 0.0) + record["bytes"]
    return pushed


def attribute_pushed_bytes(results: Iterable[TurnResult], pushed: dict[str, float]) -> None:
    """Each turn's pushed bytes: its response id is the proxy's request id (``chatcmpl-pd-...``)
    when prefill ran; a turn decode served alone has vLLM's own id, and pushed nothing."""
    for result in results:
        if result.response_id is not None:
            result.pushed_bytes = pushed.get(result.response_id.removeprefix("chatcmpl-"), 0.0)
