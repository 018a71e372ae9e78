"""What the suite prints: a table of every door, and one of each door's cases."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from benchmarks.abuse.deployment import PROXY


def _mark(text: str, met: bool) -> str:
    return f"[green]{text}[/green]" if met else f"[bold red]{text}[/bold red]"


def summary_table(records: list[dict[str, Any]]) -> Table:
    """One row per door: cases, what answered unexpectedly, the goals, memory growth."""
    table = Table(title="abuse: every door under a steady stream of normal requests")
    for column in (
        "door",
        "cases tried",
        "unexpected",
        "admitted w/o key",
        "died",
        "normal ok/sent",
        "changed",
        "failed",
        "deferred (503)",
        "RSS growth MiB prefill/decode/proxy",
        "control",
    ):
        table.add_column(column, justify="right")
    for r in records:
        g = r["goals"]
        growth = r["rss_growth_mib"]
        control = r.get("control")
        table.add_row(
            r["door"],
            _mark(f"{r['cases_tried']}/{r['cases_planned']}", g["every case tried"]),
            _mark(str(r["unexpected"]), r["unexpected"] == 0),
            _mark(str(r["admitted_without_key"]), r["admitted_without_key"] == 0),
            _mark(str(len(r["died"])), g["died == 0"]),
            f"{r['normal_ok']}/{r['normal_sent']}",
            _mark(str(r["normal_changed"]), g["normal_changed == 0"]),
            _mark(str(r["normal_failed"]), g["normal_failed == 0"]),
            str(r["normal_deferred"]),
            " / ".join(_growth(growth.get(n, "-")) for n in ("prefill-0", "decode-0", PROXY)),
            "-"
            if control is None
            else _mark("seen" if control["seen"] else "blind", control["seen"]),
        )
    return table


def _growth(mib: float | str | None) -> str:
    return "died" if mib is None else str(mib)


def cases_table(record: dict[str, Any]) -> Table:
    """One door's cases: what each got and whether that is its door's right answer."""
    table = Table(title=f"{record['door']}: cases", title_justify="left")
    for column in ("case", "answers", "as expected", "detail"):
        table.add_column(column, overflow="fold")
    killed_by, replayed = record.get("killed_by", {}), record.get("replayed", {})
    if replayed:
        table.add_column("sent alone (after a death)", overflow="fold")
    for case in record["cases"]:
        answers = ", ".join(str(a) for a in case["answers"])
        detail = case["detail"] or case["what"]
        verdict = "yes" if case["expected"] else "NO"
        if case["case"] in killed_by:
            verdict = f"NO: KILLS {', '.join(killed_by[case['case']])}"
        met = case["expected"] and case["case"] not in killed_by
        row = [case["case"], answers, _mark(verdict, met), detail[:160]]
        if replayed:
            alone = replayed.get(case["case"])
            row.append("-" if alone is None else ", ".join(str(a) for a in alone["answers"]))
        table.add_row(*row)
    return table
