"""Instances' counters, one reader for lmcache-pd's and vLLM's: read from /metrics (or the
launcher), tracked over a phase across restarts, and gauges refreshed by a plain request."""

from __future__ import annotations

import contextlib
import re
from collections import Counter, defaultdict

import httpx

from lmcache_pd.deploy.launcher import PoolLauncher

GAUGES = ("consumer_used_pages", "consumer_held_requests", "used_pages")


def _scrape(text: str) -> dict[str, float]:
    """Prometheus text -> ours (``lmcache_pd_X[_total]`` as ``X``, summed over labels) and vLLM's
    prompt-token sources (``prompt_tokens_<source>``) and preemptions."""
    found: defaultdict[str, float] = defaultdict(float)
    pattern = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{([^}]*)\})?\s+(\S+)")
    for line in text.splitlines():
        match = pattern.match(line)
        if match is None or match[1].endswith("_created"):
            continue
        name, value = match[1], match[3]
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match[2] or ""))
        if name.startswith("lmcache_pd_"):
            found[name.removeprefix("lmcache_pd_").removesuffix("_total")] += float(value)
        elif name == "vllm:prompt_tokens_by_source_total":
            found[f"prompt_tokens_{labels.get('source', 'unknown')}"] += float(value)
        elif name == "vllm:num_preemptions_total":
            found["preemptions"] += float(value)
    return found


def read_counters(launcher: PoolLauncher, name: str, source: str) -> dict[str, float] | None:
    """One instance's counters, every name missing from the source reading 0: lmcache-pd's own
    from its ``/metrics`` (``source="metrics"``: ``lmcache_pd_<name>[_total]``) or from
    ``PoolLauncher.counters()`` (``"launcher"``: whatever it reads, a stats file in older trees),
    plus vLLM's own prompt-token sources and preemptions from /metrics. None if the instance does
    not answer (dead or stopped)."""
    try:
        response = httpx.get(f"{launcher.servers[name].url}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    found = _scrape(response.text)
    if source == "launcher":
        found = {k: v for k, v in found.items() if k.startswith(("prompt_tokens_", "preempt"))}
        found |= launcher.counters().get(name, {})
    return defaultdict(float, found)


class CounterTrack:
    """Every instance's counter changes over one phase, across restarts (a restarted process
    counts from zero); gauges keep their last value."""

    def __init__(self, launcher: PoolLauncher, source: str) -> None:
        self.launcher, self.source = launcher, source
        self._last: dict[str, dict[str, float]] = {}
        self.moved: dict[str, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.gauges: dict[str, dict[str, float]] = {}
        self.snapshot()

    def snapshot(self) -> None:
        # An instance no longer served (a pool scaled down) has no gauges to read.
        for name in set(self.gauges) - set(self.launcher.servers):
            del self.gauges[name]
        for name in self.launcher.servers:
            now = read_counters(self.launcher, name, self.source)
            if now is None:
                continue
            before = self._last.get(name)
            if before is not None:
                for key, value in now.items():
                    if key not in GAUGES:
                        old = before.get(key, 0.0)
                        self.moved[name][key] += value - old if value >= old else value
            self._last[name] = now
            self.gauges[name] = {key: now[key] for key in GAUGES if key in now}

    def restarted(self, name: str) -> None:
        self._last[name] = {}

    def role(self, prefix: str) -> dict[str, int]:
        total: Counter[str] = Counter()
        for name, moved in self.moved.items():
            if name.startswith(prefix):
                total.update({key: int(value) for key, value in moved.items()})
        return dict(total)


def refresh_gauges(launcher: PoolLauncher, model: str) -> None:
    """One plain request straight to each decode instance: its connector reports its gauges to
    /metrics after an engine step (the stats file is written at each load only)."""
    for name, server in launcher.servers.items():
        if name.startswith("decode"):
            with contextlib.suppress(httpx.HTTPError):
                body = {"model": model, "prompt": [11, 12, 13], "max_tokens": 1}
                httpx.post(
                    f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=30.0
                )
