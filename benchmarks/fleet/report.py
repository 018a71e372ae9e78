"""What a fleet phase reports (requests, failures, wrong answers, pages left, pauses of the
streams that went on elsewhere, migrations, time to serve again), its goals, and the run's
Markdown and terminal tables."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import asdict
from typing import Any

from rich.table import Table

from benchmarks.chaos.counters import CounterTrack
from benchmarks.chaos.report import log_findings
from benchmarks.fleet.events import Phase

# The proxy's line for each answer that went on on another decode (proxy/migration.py).
MIGRATED_LINE = re.compile(r"req (pd-[0-9a-f]+): going on on (\S+),")
REFUSED_LINE = re.compile(r"req (pd-[0-9a-f]+): its answer cannot go on on another decode")
# Notes of an event that the Markdown lists under the table, in this order.
NOTED = (
    "instance",
    "signal",
    "in_flight_at_event",
    "in_flight_with_tokens",
    "running_at_scale",
    "routing_stopped_s",
    "scale_s",
    "scale_exit",
    "decode_after",
    "old_server_left",
    "victim",
    "back",
    "cut_short",
)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)], 3)


def migrated_ids(lines: dict[str, list[str]]) -> dict[str, int]:
    """Response ids (``cmpl-pd-...``) of the answers serve's proxy sent elsewhere, and how many
    times each went."""
    found: Counter[str] = Counter()
    for line in lines.get("serve", []):
        if hit := MIGRATED_LINE.search(line):
            found[f"cmpl-{hit[1]}"] += 1
    return dict(found)


def phase_record(
    event: str,
    phase: Phase,
    counters: CounterTrack,
    proxy_moved: dict[str, float],
    lines: dict[str, list[str]],
    stopped: float,
) -> dict[str, Any]:
    records = phase.stream.records
    outcomes = Counter(r.outcome for r in records)
    migrated = migrated_ids(lines)
    gaps = [gap for r in records for gap in r.gaps]
    max_gaps = [max(r.gaps) for r in records if r.gaps]
    moved_gaps = [max(r.gaps) for r in records if r.gaps and r.response_id in migrated]
    ttft = [r.first_token - r.started for r in records if r.first_token is not None]
    used = {
        name: int(gauges.get("consumer_used_pages", 0))
        for name, gauges in counters.gauges.items()
        if name.startswith("decode")
    }
    decode = counters.role("decode")
    findings = log_findings(lines)
    record = {
        "event": event,
        "requests": len(records),
        "ok": outcomes["ok"],
        "failed": outcomes["error"],
        "wrong": outcomes["wrong"],
        "pages_left": sum(used.values()) if used else None,
        "pages_left_per_decode": used,
        "migrated_streams": len(migrated),
        "migrated_streams_judged_ok": sum(
            r.outcome == "ok" for r in records if r.response_id in migrated
        ),
        "migrated_max_gap_p50_s": percentile(moved_gaps, 50),
        "migrated_max_gap_p99_s": percentile(moved_gaps, 99),
        "stream_max_gap_p50_s": percentile(max_gaps, 50),
        "stream_max_gap_p99_s": percentile(max_gaps, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "migrations": _labelled(proxy_moved, "decode_migrations"),
        "migrations_refused": _labelled(proxy_moved, "migrations_refused"),
        "prefill_retries": int(proxy_moved.get("prefill_retries", 0)),
        "proxy_requests": _labelled(proxy_moved, "requests"),
        "upstream_errors": _labelled(proxy_moved, "upstream_errors"),
        "serves_again_s": phase.notes.get("serves_again_s"),
        "proxy_up_again_s": phase.notes.get("proxy_up_again_s"),
        "decode_prompt_tokens": {
            source: decode.get(f"prompt_tokens_{source}", 0)
            for source in ("external_kv_transfer", "local_compute", "local_cache_hit")
        },
        "load_stopped_at_s": round(stopped, 1),
        "notes": phase.notes,
        "threads_dead": findings["threads_dead_in_logs"],
        "log_excerpts": findings["log_excerpts"],
        "failures": [
            f"{r.prompt} ({r.prompt_tokens} tok, sent {r.started:.1f} s, ended "
            f"{(r.ended or 0):.1f} s, first token {'yes' if r.first_token else 'no'}"
            f"{', migrated' if r.response_id in migrated else ''}): {r.outcome}: {r.detail} "
            f"[{r.response_id}]"
            for r in records
            if r.outcome in ("wrong", "error")
        ][:12],
        "request_log": [asdict(r) for r in records],
    }
    record["goals"] = {
        "failed == 0": record["failed"] == 0,
        "wrong == 0": record["wrong"] == 0,
        "pages_left == 0": record["pages_left"] == 0,
    }
    return record


def _labelled(moved: dict[str, float], family: str) -> dict[str, int]:
    """``family``'s samples that moved, by their labels (``cause=broken``)."""
    prefix = f"{family}{{"
    return {
        key.removeprefix(prefix).removesuffix("}"): int(value)
        for key, value in moved.items()
        if key.startswith(prefix) and value
    }


def summary(r: dict[str, Any]) -> str:
    return (
        f"{r['requests']} requests: {r['failed']} failed, {r['wrong']} wrong, pages left "
        f"{r['pages_left']}, migrated {r['migrated_streams']} {r['migrations'] or ''} (max gap "
        f"p50/p99 {r['migrated_max_gap_p50_s']}/{r['migrated_max_gap_p99_s']} s; ITL p99 "
        f"{r['itl_p99_s']} s), serves again {r['serves_again_s']} s, proxy up "
        f"{r['proxy_up_again_s']} s ({r['phase_wall_s']} s)"
    )


def markdown(records: list[dict[str, Any]], layout: str) -> str:
    control = next((r for r in records if r["event"] == "control"), None)
    lines = [
        f"Fleet benchmark, {layout} through `lmcache-pd serve`; each event against the control "
        "(the same load, no event"
        + (f": ITL p99 {control['itl_p99_s']} s" if control else "")
        + "). Pauses: per stream, its longest gap between chunks with tokens.",
        "",
        "| event | requests | failed | wrong | pages left | migrated (by cause) | refused | "
        "prefill retries | migrated max gap p50 / p99 s | all streams max gap p50 / p99 s | "
        "ITL p50 / p99 s | TTFT p50 / p99 s | serves again s | proxy up s | goals |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        missed = [name for name, met in r["goals"].items() if not met]
        lines.append(
            f"| {r['event']} | {r['requests']} | {r['failed']} | {r['wrong']} | "
            f"{r['pages_left']} | {r['migrated_streams']} {_labels(r['migrations'])} | "
            f"{_labels(r['migrations_refused']) or 0} | {r['prefill_retries']} | "
            f"{r['migrated_max_gap_p50_s']} / {r['migrated_max_gap_p99_s']} | "
            f"{r['stream_max_gap_p50_s']} / {r['stream_max_gap_p99_s']} | "
            f"{r['itl_p50_s']} / {r['itl_p99_s']} | {r['ttft_p50_s']} / {r['ttft_p99_s']} | "
            f"{r['serves_again_s']} | {r['proxy_up_again_s']} | "
            f"{'all' if not missed else 'missed: ' + ', '.join(missed)} |"
        )
    lines += [
        "",
        "Goals: failed 0, wrong 0 (tokens equal to one plain vLLM's, logprobs within "
        "1e-4), pages left on decode 0.",
    ]
    noted = [(r["event"], _noted(r["notes"])) for r in records]
    if any(text for _, text in noted):
        lines += ["", "What each event struck and saw:"]
        lines += [f"- {event}: {text}" for event, text in noted if text]
    for r in records:
        if r["failures"]:
            lines += ["", f"{r['event']} failures:", *(f"- {f}" for f in r["failures"])]
    return "\n".join(lines) + "\n"


def _noted(notes: dict[str, Any]) -> str:
    """The notes worth a line under the table (what was struck, when, what came of it)."""
    return ", ".join(f"{key} {notes[key]}" for key in NOTED if notes.get(key) not in (None, ""))


def _labels(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items())


def results_table(records: list[dict[str, Any]]) -> Table:
    table = Table(title="fleet: events under a steady load, through lmcache-pd serve")
    columns = ("event", "req", "failed", "wrong", "pages left", "migrated", "moved gap p99 s")
    for column in (*columns, "ITL p99 s", "serves again s", "proxy up s"):
        table.add_column(column, justify="right")
    for r in records:
        g = r["goals"]
        table.add_row(
            r["event"],
            str(r["requests"]),
            _mark(str(r["failed"]), g["failed == 0"]),
            _mark(str(r["wrong"]), g["wrong == 0"]),
            _mark(str(r["pages_left"]), g["pages_left == 0"]),
            f"{r['migrated_streams']} {_labels(r['migrations'])}",
            str(r["migrated_max_gap_p99_s"]),
            str(r["itl_p99_s"]),
            str(r["serves_again_s"]),
            str(r["proxy_up_again_s"]),
        )
    return table


def _mark(text: str, met: bool) -> str:
    return f"[green]{text}[/green]" if met else f"[bold red]{text}[/bold red]"
