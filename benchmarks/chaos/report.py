"""What a phase reports: its record (outcomes, latencies, recovery, leaks, counters, log
findings), the goals it met, and the run's Markdown and terminal tables."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.table import Table

from benchmarks.chaos.faults import FAULTS, Phase
from benchmarks.chaos.load import RequestRecord

RECOVERY_GOAL_S = 10.0
LATENCY_SLACK_S = 1.0
# The consumer's log line for each finished load of pushed KV (loaded, timed out or unusable;
# not a load from its own cache, which a request preempted after its load makes again).
LOAD_LINE = (
    r"req (\S+)(?: \(\S+\))?: (?:rank \d+ loaded \d+ prompt tokens(?! from its consumer)"
    r"|KV not landed|received KV unusable)"
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


def log_findings(lines: dict[str, list[str]]) -> dict[str, Any]:
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


def phase_record(
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
    findings = log_findings(lines)
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


def phase_summary(r: dict[str, Any]) -> str:
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


def results_table(records: list[dict[str, Any]]) -> Table:
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
