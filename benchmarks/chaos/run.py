"""One run of the suite: per pools layout, each fault as a phase under the stream, with what it
left broken restarted before the next."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from benchmarks.chaos.counters import CounterTrack, refresh_gauges
from benchmarks.chaos.faults import FAULTS, Fault, Phase, preempting_spec
from benchmarks.chaos.judge import Answer, Prompt
from benchmarks.chaos.load import Stream
from benchmarks.chaos.pools import (
    pools_file,
    proxy_url,
    restart,
    wait_until_proxy_sees_all,
    warm_up,
)
from benchmarks.chaos.report import LogWatch, phase_record, phase_summary
from lmcache_pd.config import load_config
from lmcache_pd.deploy.launcher import PoolLauncher
from lmcache_pd.harness.app_thread import proxy_thread
from lmcache_pd.proxy.config import ProxyConfig

LEAD_S = 3.0  # the stream runs this long before the fault
SETTLE_S = 5.0  # used pages are read this long after the stream stops
RECOVERY_WAIT_S = 60.0  # the stream goes on at most this long after the mark for a success


@dataclass
class Options:
    """The run's settings from the command line, and each phase's prompts (by phase index)."""

    requests: int
    gap_s: float
    concurrency: int
    counters: str
    max_phase_s: float
    prompts: list[list[Prompt]] = field(default_factory=list)
    fault_prompts: list[list[Prompt]] = field(default_factory=list)


def run_phase(
    index: int,
    fault_name: str,
    launcher: PoolLauncher,
    proxy: ProxyConfig,
    references: dict[str, Answer],
    options: Options,
    groups: list[int],
    console: Console,
    last: bool,
) -> dict[str, Any]:
    """One fault under the stream, and its record; unless this is the ``last`` phase, what the
    fault left broken is restarted afterwards."""
    if fault_name == "preemption":
        restart(launcher, "decode-0", groups, preempting_spec(launcher))
        wait_until_proxy_sees_all(proxy)
    workdir = launcher.workdir
    stream = Stream(
        proxy_url(proxy),
        proxy.model,
        options.prompts[index],
        references,
        options.gap_s,
        options.concurrency,
    )
    phase = Phase(
        launcher,
        proxy,
        stream,
        CounterTrack(launcher, options.counters),
        load_config(workdir / "decode-0.yaml"),
        load_config(workdir / "prefill-0.yaml"),
        options.fault_prompts[index],
        groups,
    )
    logs = LogWatch([workdir, workdir.parent])
    try:
        _stream_through(FAULTS[fault_name], phase, options)
    finally:
        stream.close()
    stopped = stream.now()
    time.sleep(SETTLE_S)
    refresh_gauges(launcher, proxy.model)
    phase.counters.snapshot()
    used = phase.counters.gauges.get("decode-0", {}).get("consumer_used_pages")
    record = phase_record(fault_name, phase, stream.records, stopped, used, logs.lines())
    if not last:
        _heal(launcher, proxy, record, groups, console)
    return record


def _stream_through(fault: Fault, phase: Phase, options: Options) -> None:
    """Start the stream, inject the fault after ``LEAD_S``, and stop the stream once it sent
    its requests, ``tail`` of them after the fault's end, and one of those succeeded (or
    ``RECOVERY_WAIT_S`` passed)."""
    stream, tail = phase.stream, max(3, options.requests // 3)
    stream.start()
    try:
        while stream.now() < LEAD_S or len(stream.sent()) < 2:
            time.sleep(0.05)
        fault.inject(phase)
        while stream.now() < options.max_phase_s:
            after = stream.sent(since=phase.mark)
            recovered = any(r.outcome == "ok" for r in after)
            if (
                len(stream.sent()) >= options.requests
                and len(after) >= tail
                and (recovered or stream.now() - phase.mark > RECOVERY_WAIT_S)
            ):
                return
            time.sleep(0.1)
    finally:
        stream.stop()
        for close in phase.cleanup:
            close()


def _heal(
    launcher: PoolLauncher,
    proxy: ProxyConfig,
    record: dict[str, Any],
    groups: list[int],
    console: Console,
) -> None:
    """Restart what the fault left broken, so that the next fault is measured on its own:
    decode after ``preemption`` (its own KV cache back), and any instance whose threads died."""
    broken = set(record["threads_dead_in"])
    if record["fault"] == "preemption":
        broken.add("decode-0")
    for name in sorted(broken):
        console.print(f"    restarting {name} before the next fault")
        record["notes"][f"healed_{name}_s"] = restart(launcher, name, groups)
    if broken:
        wait_until_proxy_sees_all(proxy)


def run_layout(
    pools_path: str,
    faults: list[str],
    references: dict[str, Answer],
    options: Options,
    workdir: Path,
    console: Console,
    groups: list[int],
) -> list[dict[str, Any]]:
    """Start the pools of ``pools_path`` and run every fault on them in turn; their records."""
    pools = pools_file(pools_path)
    layout = f"{len(pools.prefill)}P{len(pools.decode)}D"
    console.print(f"[bold]{layout}[/bold] ({pools_path}): starting the pools (logs in {workdir})")
    records = []
    with PoolLauncher(pools, workdir, console) as launcher:
        began = time.monotonic()
        proxy = launcher.start()
        groups += [server.pid for server in launcher.servers.values()]
        console.print(f"  healthy after {time.monotonic() - began:.0f} s")
        with proxy_thread(proxy):
            warm_up(proxy)
            for index, name in enumerate(faults):
                console.print(f"  {layout} {name} ...")
                last = index == len(faults) - 1
                began = time.monotonic()
                phase = run_phase(
                    index, name, launcher, proxy, references, options, groups, console, last
                )
                record = {"pools": layout, "pools_file": pools_path, **phase}
                record["phase_wall_s"] = round(time.monotonic() - began, 1)
                records.append(record)
                console.print(f"    {phase_summary(record)}")
    return records
