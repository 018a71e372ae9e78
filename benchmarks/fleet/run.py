"""One phase of the fleet benchmark: the load streamed through serve's proxy, one event struck
under it, the stream kept going until the deployment is whole again, then what it left read."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.chaos.counters import CounterTrack, refresh_gauges
from benchmarks.chaos.judge import Answer, Prompt, random_tokens
from benchmarks.chaos.load import Stream
from benchmarks.chaos.report import LogWatch
from benchmarks.fleet.events import EVENTS, Event, Phase
from benchmarks.fleet.report import phase_record
from benchmarks.fleet.serve import Serve

LEAD_S = 3.0  # the load runs this long before the event
SETTLE_S = 5.0  # decode's used pages are read this long after the load stops
RECOVERY_WAIT_S = 60.0  # after the event, the load goes on at most this long for a success
# Over the proxy's min_disagg_tokens (256) so every prompt is disaggregated, under the tiny
# model's 4096-token context.
PROMPT_TOKENS = (300, 1200)
PROXY_FAMILIES = (
    "requests",
    "upstream_errors",
    "prefill_retries",
    "decode_migrations",
    "migrations_refused",
    "served_alone",
    "kv_drops",
)
# How long each event keeps the load going past its lead, to size its prompts (the stream
# goes round them again past that, answered from prefix caches).
EXPECTED_S = {"control": 0.0, "rolling_restart": 240.0}
EXPECTED_DEFAULT_S = 45.0


@dataclass(frozen=True, slots=True)
class Load:
    """The steady load of every phase: at most ``concurrency`` streams in flight, a new one
    every ``gap_s``, each ``answer_tokens`` long (greedy, ``ignore_eos``); a phase sends at
    least ``requests``, and ``tail`` after the deployment is whole again."""

    requests: int
    gap_s: float
    concurrency: int
    answer_tokens: int
    tail: int
    max_phase_s: float


def phase_prompts(index: int, event: str, load: Load) -> list[Prompt]:
    """Prompts of their own per phase (no phase's prompt is in another's prefix caches), each
    long enough to be disaggregated."""
    rng = random.Random(5000 + index)
    expected = EXPECTED_S.get(event, EXPECTED_DEFAULT_S)
    count = load.requests + load.tail + int((LEAD_S + expected) / load.gap_s)
    return [
        Prompt(
            f"p{index}-{i}",
            random_tokens(rng, rng.randrange(*PROMPT_TOKENS)),
            load.answer_tokens,
            True,
            ignore_eos=True,
        )
        for i in range(count)
    ]


def proxy_counters(url: str) -> dict[str, float]:
    """The proxy's counters of ``PROXY_FAMILIES``, one key per label set
    (``decode_migrations{cause=broken}``); empty if it does not answer."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=5.0).text
    except httpx.HTTPError:
        return {}
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("lmcache_pd_proxy_")
        if name not in PROXY_FAMILIES:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                found[f"{name}{{{labels}}}" if labels else name] = sample.value
    return found


def run_phase(
    index: int,
    event: str,
    serve: Serve,
    prompts: list[Prompt],
    references: dict[str, Answer],
    load: Load,
    events: Mapping[str, Event] = EVENTS,
) -> dict[str, Any]:
    """``event`` (of ``events``) under the load, and its record."""
    assert serve.proxy is not None
    before = proxy_counters(serve.url)
    counters = CounterTrack(serve, "metrics")  # type: ignore[arg-type]  # reads .servers[*].url
    logs = LogWatch([serve.workdir])
    stream = Stream(serve.url, serve.proxy.model, prompts, references, load.gap_s, load.concurrency)
    phase = Phase(serve, stream)
    began = time.monotonic()
    try:
        _stream_through(events[event], phase, load)
    finally:
        stream.close()
    stopped = stream.now()
    time.sleep(SETTLE_S)
    refresh_gauges(serve, serve.proxy.model)  # type: ignore[arg-type]
    counters.snapshot()
    after = proxy_counters(serve.url)
    moved = {key: value - before.get(key, 0.0) for key, value in after.items()}
    record = phase_record(event, phase, counters, moved, logs.lines(), stopped)
    record["phase_wall_s"] = round(time.monotonic() - began, 1)
    return record


def _stream_through(event: Event, phase: Phase, load: Load) -> None:
    """Start the load, strike the event after ``LEAD_S``, and stop the load once it sent its
    ``requests``, ``tail`` of them after the deployment was whole again, and one of those
    succeeded (or ``RECOVERY_WAIT_S`` passed); at most ``max_phase_s``."""
    stream = phase.stream
    stream.start()
    try:
        while stream.now() < LEAD_S or len(stream.sent()) < 2:
            time.sleep(0.05)
        event(phase)
        assert phase.back is not None
        while stream.now() < load.max_phase_s:
            after = stream.sent(since=phase.back)
            recovered = any(r.outcome == "ok" for r in after)
            if (
                len(stream.sent()) >= load.requests
                and len(after) >= load.tail
                and (recovered or stream.now() - phase.back > RECOVERY_WAIT_S)
            ):
                return
            time.sleep(0.1)
        phase.notes["cut_short"] = f"the phase reached max_phase_s ({load.max_phase_s:.0f} s)"
    finally:
        stream.stop()
