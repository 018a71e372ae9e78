"""The multi-turn routing benchmark's pure parts (``benchmarks/multi_turn.py`` and
``multi_turn_load.py``), with no process started: which messages each turn sends, what counts
as a turn's new tokens, the per-turn statistics, the counters' deltas and the policy guard."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import typer

from benchmarks.multi_turn import (
    FLUSH_PROMPT,
    counter_deltas,
    instance_counters,
    max_model_len,
    parse_policies,
    policy_ratios,
    run_record,
)
from benchmarks.multi_turn_load import (
    Conversation,
    Shape,
    TurnResult,
    account_new_tokens,
    attribute_pushed_bytes,
    converse,
    itl_streaming_alone_ms,
    make_conversations,
    pushed_bytes_by_request,
    schedule_pace,
    streams_at_once,
    think_pace,
    turn_messages,
    turn_statistics,
    vocabulary_words,
)
from lmcache_pd.deploy.pools import load_pools

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
WORDS = [f"w{i:03d}" for i in range(200)]
SHAPE = Shape(conversations=3, turns=4, system_tokens=20, user_tokens=5, answer_tokens=4)


def test_conversations_share_the_system_prompt_and_differ_per_run() -> None:
    first = make_conversations(WORDS, SHAPE, seed=1, run_id="run0-kv")
    assert first == make_conversations(WORDS, SHAPE, seed=1, run_id="run0-kv")
    assert len({c.system for c in first}) == 1
    assert len(first[0].system.split()) == SHAPE.system_tokens
    assert all(len(c.users) == SHAPE.turns for c in first)
    assert all(len(u.split()) == SHAPE.user_tokens for c in first for u in c.users)
    assert len({u for c in first for u in c.users}) == SHAPE.conversations * SHAPE.turns
    other = make_conversations(WORDS, SHAPE, seed=1, run_id="run0-load")
    assert other[0].system != first[0].system  # no run's cache serves another run


def test_each_turn_resends_the_conversation_with_the_previous_answer() -> None:
    chat = Conversation("c", "sys", ("u1", "u2", "u3"))
    assert turn_messages(chat, []) == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "u1"},
    ]
    third = turn_messages(chat, ["a1", "a2"])
    assert [m["content"] for m in third] == ["sys", "u1", "a1", "u2", "a2", "u3"]
    assert [m["role"] for m in third] == [
        "system",
        "user",
        "assistant",
        "user",
        "assistant",
        "user",
    ]
    assert third[:4] == turn_messages(chat, ["a1"])[:4]  # turn 2's prompt is a prefix of turn 3's
    with pytest.raises(ValueError, match="3 turns"):
        turn_messages(chat, ["a1", "a2", "a3"])


class FakeChat:
    """Stands in for ``openai.AsyncOpenAI``: records each turn's messages and streams an answer
    that names the turn, then usage that grows as the conversation does."""

    def __init__(self, fail_turn: int | None = None, answer_s: float = 0.0) -> None:
        self.answer_s = answer_s
        self.sent: list[list[dict[str, str]]] = []
        self.extra: list[dict[str, Any]] = []
        self.fail_turn = fail_turn
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))

    async def create(self, **body: Any) -> FakeStream:
        self.sent.append(body["messages"])
        self.extra.append(body["extra_body"])
        turn = len(self.sent)
        if turn == self.fail_turn:
            raise TimeoutError("upstream gone")
        await asyncio.sleep(self.answer_s)
        prompt = sum(len(m["content"].split()) for m in body["messages"])
        return FakeStream([f"a{turn}-x ", f"a{turn}-y"], prompt, body["max_tokens"])


class FakeStream:
    def __init__(self, pieces: list[str], prompt: int, completion: int) -> None:
        self.chunks = [
            SimpleNamespace(
                id="chatcmpl-pd-1",
                usage=None,
                choices=[SimpleNamespace(delta=SimpleNamespace(content=p))],
            )
            for p in pieces
        ]
        usage = SimpleNamespace(prompt_tokens=prompt, completion_tokens=completion)
        self.chunks.append(SimpleNamespace(id="chatcmpl-pd-1", usage=usage, choices=[]))

    async def __aenter__(self) -> FakeStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def __aiter__(self) -> Any:
        return self._iterate()

    async def _iterate(self) -> Any:
        for chunk in self.chunks:
            yield chunk


def test_a_conversation_sends_each_answer_back_in_the_next_turn() -> None:
    chat = Conversation("c", "s s s", ("u1 u1", "u2 u2", "u3 u3"))
    fake = FakeChat()
    results = asyncio.run(converse(fake, "m", chat, 2, 0.0, [7, 9]))  # type: ignore[arg-type]
    assert [r.error for r in results] == [None, None, None]
    # Answers are made of the given tokens only, and sent back whole.
    assert fake.extra == [{"ignore_eos": True, "allowed_token_ids": [7, 9]}] * 3
    assert [r.answer for r in results] == ["a1-x a1-y", "a2-x a2-y", "a3-x a3-y"]
    for turn in (2, 3):
        assert fake.sent[turn - 1][-2] == {
            "role": "assistant",
            "content": f"a{turn - 1}-x a{turn - 1}-y",
        }
    assert all(r.ttft_s is not None and len(r.gaps_s) == 1 for r in results)
    # Words stand for tokens: a later turn adds its user message (2); the answer before it (2)
    # is that turn's completion.
    assert [r.new_tokens for r in results] == [5, 2, 2]


def test_a_failed_turn_ends_its_conversation() -> None:
    fake = FakeChat(fail_turn=2)
    chat = Conversation("c", "s", ("u1", "u2", "u3"))
    results = asyncio.run(converse(fake, "m", chat, 2, 0.0))  # type: ignore[arg-type]
    assert results[0].error is None
    assert "upstream gone" in (results[1].error or "")
    assert results[2].error == "not sent: an earlier turn failed"
    assert len(fake.sent) == 2
    assert [r.new_tokens for r in results] == [results[0].prompt_tokens, None, None]


def test_scheduled_turns_are_sent_on_time_or_counted_late() -> None:
    chat = Conversation("c", "s", ("u1", "u2", "u3"))
    # Never before its time; late only by the loop's own delay (bounded loosely for busy hosts).
    on_time = asyncio.run(
        converse(FakeChat(), "m", chat, 2, 0.0, pace=schedule_pace(0.2))  # type: ignore[arg-type]
    )
    starts = [r.started_at - on_time[0].started_at for r in on_time]
    for start, due in zip(starts, [0.0, 0.2, 0.4], strict=True):
        assert due - 0.005 <= start < due + 0.15
    assert [r.late_s for r in on_time] == [0.0, 0.0, 0.0]
    # Answers slower than the schedule: each turn goes as its answer ends, and says how late.
    slow_chat = FakeChat(answer_s=0.3)
    slow = asyncio.run(
        converse(slow_chat, "m", chat, 2, 0.0, pace=schedule_pace(0.2))  # type: ignore[arg-type]
    )
    starts = [r.started_at - slow[0].started_at for r in slow]
    for start, after in zip(starts, [0.0, 0.3, 0.6], strict=True):
        assert after - 0.005 <= start < after + 0.15
    assert slow[0].late_s == 0.0
    for result, late in zip(slow[1:], [0.1, 0.2], strict=True):
        assert late - 0.005 <= result.late_s < late + 0.15


def test_think_pauses_repeat_per_seed_and_ignore_the_schedule() -> None:
    first, again = think_pace("think:0:1", 2.0), think_pace("think:0:1", 2.0)
    pauses = [first(turn, 0.0) for turn in (2, 3, 4)]
    assert pauses == [again(turn, 99.0) for turn in (2, 3, 4)]
    assert all(p > 0 for p in pauses)
    assert pauses != [think_pace("think:0:2", 2.0)(turn, 0.0) for turn in (2, 3, 4)]


def _turn(turn: int, prompt: int | None, completion: int | None, **more: Any) -> TurnResult:
    return TurnResult("c", turn, prompt_tokens=prompt, completion_tokens=completion, **more)


def test_new_tokens_are_what_a_turn_adds_to_the_one_before() -> None:
    turns = [_turn(1, 700, 48), _turn(2, 1400, 48), _turn(3, 2105, 48)]
    account_new_tokens(list(reversed(turns)))  # order of the list does not matter
    assert [t.new_tokens for t in turns] == [700, 1400 - 748, 2105 - 1448]
    broken = [_turn(1, 700, 48), _turn(2, None, None, error="x"), _turn(3, 2105, 48)]
    account_new_tokens(broken)
    assert [t.new_tokens for t in broken] == [700, None, None]


def test_per_turn_statistics() -> None:
    results = [
        _turn(1, 100, 4, ttft_s=0.010, gaps_s=[0.001, 0.003], new_tokens=100),
        _turn(1, 120, 4, ttft_s=0.030, gaps_s=[0.002], new_tokens=120),
        _turn(2, 300, 4, ttft_s=0.050, gaps_s=[0.004], new_tokens=180),
        _turn(2, None, None, error="HTTP 503"),
    ]
    table = turn_statistics(results)
    assert table[1]["requests"] == 2 and table[1]["failures"] == 0
    assert table[1]["ttft_ms_p50"] == pytest.approx(20.0)
    assert table[1]["ttft_ms_p90"] == pytest.approx(28.0)
    assert table[1]["itl_ms_p50"] == pytest.approx(2.0)
    assert table[1]["prompt_tokens_mean"] == 110 and table[1]["new_tokens_mean"] == 110
    assert table[2]["requests"] == 2 and table[2]["failures"] == 1
    assert table[2]["ttft_ms_p50"] == pytest.approx(50.0)
    record = run_record("load", 0, results, {}, 1.0)
    assert record["ttft_ms_p50_turns_2plus"] == pytest.approx(50.0)
    assert record["new_tokens"] == 400 and record["failures"] == 1
    assert record["computed_over_new"] == 0.0
    assert record["decode_model_thread_share"] is None  # no instance counted


def test_each_instances_connector_share_of_vllms_threads_over_the_run() -> None:
    held = {"requests": 4.0, "model_thread_microseconds": 500_000.0}
    held["scheduler_thread_microseconds"] = 20_000.0
    deltas = {"prefill-0": held, "decode-0": held | {"model_thread_microseconds": 100_000.0}}
    deltas["decode-1"] = held | {"model_thread_microseconds": 300_000.0}
    record = run_record("kv", 0, [], deltas, 10.0)
    assert record["connector_thread_share"]["prefill-0"] == {
        "model_thread": pytest.approx(0.05),
        "scheduler_thread": pytest.approx(0.002),
    }
    # the busiest decode's, not prefill's
    assert record["decode_model_thread_share"] == pytest.approx(0.03)


def test_streams_at_once_counts_the_answers_streaming_at_each_token() -> None:
    # a streams over [1, 4], b over [2, 3]: a's tokens at 2 and 3 see b, at 4 not; b's see a.
    a = _turn(1, 10, 4, started_at=0.0, ttft_s=1.0, gaps_s=[1.0, 1.0, 1.0], e2e_s=4.0)
    b = _turn(1, 10, 2, started_at=1.0, ttft_s=1.0, gaps_s=[0.5, 0.5], e2e_s=2.0)
    failed = _turn(2, None, None, started_at=0.0, ttft_s=0.5, e2e_s=9.0, error="HTTP 503")
    assert streams_at_once([a, b, failed]) == 2.0  # counts 2, 2, 1, 2, 2
    assert streams_at_once([a]) == 1.0
    assert streams_at_once([failed]) is None
    # the one token received while its answer streamed alone: a's at 4, after a gap of 1 s
    assert itl_streaming_alone_ms([a, b, failed]) == 1000.0
    assert itl_streaming_alone_ms([failed]) is None


EXPOSITION = """\
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 7.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 2.0
# HELP vllm:prompt_tokens_by_source_total Prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source_total counter
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"} 900.0
vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_cache_hit"} 256.0
# HELP lmcache_pd_bytes_pushed_total Bytes pushed.
# TYPE lmcache_pd_bytes_pushed_total counter
lmcache_pd_bytes_pushed_total{engine="0",model_name="m"} 1048576.0
"""


def test_instance_counters_and_their_deltas_leave_the_flush_out() -> None:
    now = instance_counters(EXPOSITION)
    assert now["requests"] == 9
    assert now["local_compute"] == 900 and now["local_cache_hit"] == 256
    assert now["external_kv_transfer"] == 0 and now["bytes_pushed"] == 1 << 20
    before = {"prefill-0": {k: 0.0 for k in now} | {"flushed": 1.0}, "decode-0": None}
    after = {"prefill-0": now | {"flushed": 1.0}, "decode-0": now | {"flushed": 1.0}}
    deltas = counter_deltas(before, after)
    assert list(deltas) == ["prefill-0"]  # decode-0 did not answer the first snapshot
    assert deltas["prefill-0"]["requests"] == 8
    assert deltas["prefill-0"]["local_compute"] == 900 - len(FLUSH_PROMPT)
    assert "flushed" not in deltas["prefill-0"]
    unflushed = counter_deltas(before, {"prefill-0": now | {"flushed": 0.0}})
    assert unflushed["prefill-0"]["requests"] == 9


def test_ratios_of_medians_and_a_zero_denominator() -> None:
    runs = [("kv", 50.0, 10.0), ("load", 100.0, 0.0), ("kv", 60.0, 12.0), ("load", 110.0, 0.0)]
    records = [
        {"policy": p, "ttft_ms_p50_turns_2plus": t, "itl_ms_p50": 5.0, "kv_bytes_pushed": b}
        | {"computed_over_new": None if p == "kv" else 1.2, "kv_bytes_pushed_turns_2plus": b}
        | {"streams_at_once_p50": 2.0, "itl_ms_p50_streaming_alone": 10.0}
        | {"decode_model_thread_share": 0.01}
        for p, t, b in runs
    ]
    found = {r["metric"]: r for r in policy_ratios(records, "kv", "load", 200, 0.9, 0)}
    assert found["ttft_ms_p50_turns_2plus"]["ratio"] == pytest.approx(55.0 / 105.0)
    assert found["ttft_ms_p50_turns_2plus"]["runs"] == [2, 2]
    assert found["itl_ms_p50"]["ratio"] == 1.0
    assert found["kv_bytes_pushed"]["ratio"] is None
    assert "zero" in found["kv_bytes_pushed"]["why_none"]
    assert found["computed_over_new"]["ratio"] is None


def test_kv_routing_is_refused_by_name_where_the_proxy_has_no_routing_field() -> None:
    assert parse_policies("kv,load", supported=True) == ["kv", "load"]
    assert parse_policies("kv,cache_aware", supported=True) == ["kv", "cache_aware"]
    assert parse_policies("load", supported=False) == ["load"]
    with pytest.raises(typer.BadParameter, match="no `routing` field"):
        parse_policies("kv,load", supported=False)
    for bad in ("", "load,load", "kv,random"):
        with pytest.raises(typer.BadParameter):
            parse_policies(bad, supported=True)


@pytest.mark.parametrize(("name", "prefill", "decode"), [("1p2d", 1, 2), ("2p2d", 2, 2)])
def test_the_pools_files_fit_the_default_conversations(
    name: str, prefill: int, decode: int
) -> None:
    pools = load_pools(CONFIGS / f"pools-{name}.yaml")
    assert (len(pools.prefill), len(pools.decode)) == (prefill, decode)
    default = Shape(conversations=8, turns=4, system_tokens=600, user_tokens=600, answer_tokens=48)
    assert 2000 <= default.longest_prompt() <= max_model_len(pools) == 4096


def test_vocabulary_words_are_the_single_token_words(tmp_path: Path) -> None:
    vocab = {"\u0120word": 1, "\u0120ab": 2, "plain": 3, "\u0120Caps": 4, "\u0120x1y": 5}
    vocab |= {f"\u0120w{chr(97 + i // 26)}{chr(97 + i % 26)}": 10 + i for i in range(120)}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"model": {"vocab": vocab}}))
    words = vocabulary_words(path)
    assert words["word"] == 1 and len(words) == 121
    assert list(words) == sorted(words)
    assert not {"ab", "plain", "Caps", "x1y"} & set(words)
    path.write_text(json.dumps({"model": {"vocab": {"\u0120word": 1}}}))
    with pytest.raises(ValueError, match="single-token words"):
        vocabulary_words(path)


def test_pushed_bytes_go_to_the_turns_whose_request_prefill_pushed(tmp_path: Path) -> None:
    trace = tmp_path / "prefill-0.trace.jsonl"
    lines = [
        {"event": "push", "req_id": "pd-a", "bytes": 100},
        {"event": "push", "req_id": "pd-a", "bytes": 50},  # a second decode rank
        {"event": "push", "req_id": "pd-b", "error": "consumer down"},
        {"event": "other", "req_id": "pd-c", "bytes": 7},
    ]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    turns = [TurnResult("c", 1), TurnResult("c", 2), TurnResult("c", 3)]
    turns[0].response_id, turns[1].response_id = "chatcmpl-pd-a", "chatcmpl-0123"  # 2: alone
    attribute_pushed_bytes(turns, pushed_bytes_by_request([trace]))
    assert [t.pushed_bytes for t in turns] == [150.0, 0.0, None]
