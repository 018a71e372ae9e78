"""Keeps the instances of a one-host launch (``PoolLauncher``) up: starts again an instance that
died unasked, with bounded backoff, and rolls instances on request (``lmcache-pd restart``), one
at a time: drain, restart, healthy, next.

One thread does both, and it is the only one that starts instances after the launch: each
instance is started with ``PR_SET_PDEATHSIG`` (``vllm_server._prepare_child``), which fires when
the *thread* that started it ends, so instances are started by a thread that lives as long as the
pools. A restarted instance keeps its ports: the proxy's health checker marks it up again on its
first 200 from /health, with no change to the proxy's config.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lmcache_pd.deploy.vllm_server import VLLMServer
from lmcache_pd.errors import PDError

logger = logging.getLogger(__name__)

POOLS = ("prefill", "decode")
# How long ``close`` waits for the thread: ``PoolLauncher.stop`` has stopped every instance
# first, so a restart in progress fails at once (its server exited).
JOIN_TIMEOUT_S = 30.0
LOG_LINES_WHEN_GIVEN_UP = 20

Report = Callable[[str], None]


class Instances(Protocol):
    """What the supervisor looks after: ``PoolLauncher``."""

    servers: dict[str, VLLMServer]

    def restart(self, name: str, *, drain: bool = False) -> float:
        """Start ``name`` again (drained first with ``drain``) and wait until it serves."""
        ...


class RollError(PDError):
    """A roll could not be done: an unknown name, the pools stopping, an instance that did not
    come back (the roll stops there, leaving the rest as they were)."""


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How an instance that died is started again: after ``first_backoff_s``, doubling per
    restart in the last ``window_s`` up to ``max_backoff_s``; one that died ``max_restarts``
    times in ``window_s`` is left down."""

    first_backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    max_restarts: int = 5
    window_s: float = 600.0
    # How often the thread looks for dead instances.
    watch_interval_s: float = 1.0

    def backoff_s(self, recent_restarts: int) -> float:
        return min(self.max_backoff_s, self.first_backoff_s * 2**recent_restarts)


@dataclass
class _Roll:
    """A roll asked for from another thread; ``done`` is set when it ended."""

    names: list[str]
    report: Report
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None


class Supervisor:
    """Owns the thread that restarts ``launcher``'s dead instances and rolls them."""

    def __init__(self, launcher: Instances, policy: RestartPolicy) -> None:
        self._launcher = launcher
        self._policy = policy
        self._stop = threading.Event()
        self._rolls: queue.Queue[_Roll] = queue.Queue()
        self._restarted_at: dict[str, deque[float]] = {}
        self._due: dict[str, float] = {}  # a dead instance -> when to start it again
        self.left_down: set[str] = set()
        # Restarts after a death, per instance (not those asked for), and rolls asked for.
        self.restarts: dict[str, int] = {}
        self.rolled: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="pool-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def collector(self) -> Collector:
        """The supervisor's counts for a Prometheus registry (the proxy's ``/metrics`` in
        ``serve``): restarts by instance and cause, and instances left down."""
        return _Counts(self)

    def stop_soon(self) -> None:
        """Start no more restarts; the one in progress ends when its instance is stopped."""
        self._stop.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.error("the supervisor did not stop within %.0f s", JOIN_TIMEOUT_S)

    def names(self, target: str | None) -> list[str]:
        """The instances ``target`` names: all (None), a pool's, or one; ``RollError`` if none."""
        every = list(self._launcher.servers)
        if target is None:
            return every
        if target in POOLS:
            return [name for name in every if name.startswith(f"{target}-")]
        if target in every:
            return [target]
        raise RollError(f"no pool or instance named {target!r} (instances: {', '.join(every)})")

    def roll(self, names: list[str], report: Report, timeout_s: float) -> None:
        """Drain and restart ``names`` one at a time on the supervisor's thread, calling
        ``report`` with a line per step; block until done. ``RollError`` if one did not come
        back (the rest are left alone), the pools are stopping, or ``timeout_s`` passed."""
        job = _Roll(names, report)
        self._rolls.put(job)
        if not job.done.wait(timeout_s):
            raise RollError(f"the roll did not end within {timeout_s:.0f} s; it goes on in serve")
        if job.error is not None:
            raise RollError(job.error)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                job = self._rolls.get(timeout=self._policy.watch_interval_s)
            except queue.Empty:
                job = None
            if job is not None:
                self._do_roll(job)
            self._watch()
        while not self._rolls.empty():
            job = self._rolls.get_nowait()
            job.error = "serve is stopping"
            job.done.set()

    def _do_roll(self, job: _Roll) -> None:
        try:
            for name in job.names:
                if self._stop.is_set():
                    raise RollError("serve is stopping")
                job.report(f"{name}: draining")
                seconds = self._launcher.restart(name, drain=True)
                self.rolled[name] = self.rolled.get(name, 0) + 1
                self.left_down.discard(name)
                self._due.pop(name, None)
                job.report(f"{name}: serving again after {seconds:.1f} s")
        except PDError as exc:  # LaunchError or RollError
            job.error = str(exc)
        finally:
            job.done.set()

    def _watch(self) -> None:
        """Schedule a restart for each instance that died unasked; do those that are due."""
        now = time.monotonic()
        for name, server in list(self._launcher.servers.items()):
            if self._stop.is_set():
                return  # everything is being stopped: an exit now was asked for
            if server.running or name in self._due or name in self.left_down:
                continue
            times = self._restarted_at.setdefault(name, deque())
            while times and now - times[0] > self._policy.window_s:
                times.popleft()
            if len(times) >= self._policy.max_restarts:
                self.left_down.add(name)
                logger.error(
                    "%s died (exit %s) after %d restarts in %.0f s; left down. Its log (%s) "
                    "ends:\n%s",
                    name,
                    server.returncode,
                    len(times),
                    self._policy.window_s,
                    server.log_path,
                    server.tail(LOG_LINES_WHEN_GIVEN_UP),
                )
                continue
            delay = self._policy.backoff_s(len(times))
            logger.warning(
                "%s died unasked (exit %s); starting it again in %.1f s",
                name,
                server.returncode,
                delay,
            )
            self._due[name] = now + delay
        for name, due in list(self._due.items()):
            if self._stop.is_set() or time.monotonic() < due:
                continue
            del self._due[name]
            self._restarted_at[name].append(time.monotonic())
            self.restarts[name] = self.restarts.get(name, 0) + 1
            try:
                seconds = self._launcher.restart(name)
            except PDError as exc:  # it is dead again: the next watch counts it
                logger.error("%s: restart %d failed: %s", name, self.restarts[name], exc)
                continue
            logger.info(
                "%s restarted after dying, in %.1f s (restart %d)",
                name,
                seconds,
                self.restarts[name],
            )


class _Counts(Collector):
    """``lmcache_pd_instance_restarts_total{instance, cause}`` (cause ``died``: started again
    after dying unasked; ``rolled``: drained and restarted by ``lmcache-pd restart``) and
    ``lmcache_pd_instances_left_down`` (dead past the restart limit), read at each scrape."""

    def __init__(self, supervisor: Supervisor) -> None:
        self._supervisor = supervisor

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        supervisor = self._supervisor
        restarts = CounterMetricFamily(
            "lmcache_pd_instance_restarts",
            "Instances started again by serve: after dying unasked (died), or drained and "
            "restarted by `lmcache-pd restart` (rolled)",
            labels=["instance", "cause"],
        )
        for cause, counts in (("died", supervisor.restarts), ("rolled", supervisor.rolled)):
            for name, count in dict(counts).items():  # a copy: the supervisor's thread adds
                restarts.add_metric([name, cause], count)
        yield restarts
        yield GaugeMetricFamily(
            "lmcache_pd_instances_left_down",
            "Instances that died more often than the restart limit allows and are left down",
            value=len(supervisor.left_down),
        )
