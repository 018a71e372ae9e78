"""Which instance gets the next request: least outstanding requests, round-robin among equals,
never one that is marked down. Health checks and failed requests mark instances down and up.

Everything here runs on the proxy's one event loop, so counters need no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import aiohttp

logger = logging.getLogger(__name__)


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(eq=False)
class Upstream:
    """One vLLM instance as the proxy sees it."""

    url: str
    role: Role
    # Only decode instances: where their connector receives KV (host, init and alloc ports;
    # the ports are lists indexed by rank for a tensor-parallel instance).
    receiver: tuple[str, int | list[int], int | list[int]] | None = None
    outstanding: int = 0
    healthy: bool = True

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Counts one outstanding request for as long as the block runs."""
        self.outstanding += 1
        try:
            yield
        finally:
            self.outstanding -= 1

    def mark(self, healthy: bool, why: str) -> None:
        """Record a health change, logging only transitions so a dead instance is one line."""
        if healthy != self.healthy:
            self.healthy = healthy
            if healthy:
                logger.info("%s instance %s is back up (%s)", self.role.value, self.url, why)
            else:
                logger.warning("%s instance %s marked down: %s", self.role.value, self.url, why)


class NoHealthyInstance(Exception):
    """Every instance of a pool is down (or excluded): the request cannot be served now."""


@dataclass
class Pool:
    """Instances of one role and the round-robin cursor that breaks ties between them."""

    role: Role
    members: list[Upstream]
    _cursor: int = field(default=0, repr=False)

    def replace(self, members: list[Upstream]) -> None:
        """Serve from ``members`` from now on (a cluster engine changed the pool); the
        round-robin goes on where it was."""
        self.members = members
        self._cursor %= max(len(members), 1)

    def pick(self, exclude: Upstream | None = None) -> Upstream:
        """The healthy instance with the fewest outstanding requests; ties go round-robin."""
        count = len(self.members)
        rotated = self.members[self._cursor :] + self.members[: self._cursor]
        healthy = [member for member in rotated if member.healthy and member is not exclude]
        if not healthy:
            raise NoHealthyInstance(f"no healthy {self.role.value} instance")
        chosen = min(healthy, key=lambda member: member.outstanding)  # first of equals wins
        self._cursor = (self.members.index(chosen) + 1) % count
        return chosen


class Periodic:
    """``step`` awaited every ``interval_s`` on a task of the running loop, from ``start`` until
    ``stop`` (health checks, the pools' members)."""

    def __init__(self, name: str, step: Callable[[], Awaitable[object]], interval_s: float) -> None:
        self._name, self._step, self._interval_s = name, step, interval_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self._name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await self._step()
            await asyncio.sleep(self._interval_s)


class HealthChecker:
    """Asks every instance's ``/health`` every ``interval_s``, marking each up or down;
    ``upstreams`` says which instances there are now."""

    def __init__(
        self,
        upstreams: Callable[[], list[Upstream]],
        session_factory: Callable[[], aiohttp.ClientSession],
        *,
        interval_s: float,
        timeout_s: float,
    ) -> None:
        self._upstreams = upstreams
        self._session_factory = session_factory
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.periodic = Periodic("health-checks", self.check_all, interval_s)

    async def check_all(self) -> None:
        """One round: every instance, concurrently."""
        session = self._session_factory()
        await asyncio.gather(*(self._check(session, member) for member in self._upstreams()))

    async def _check(self, session: aiohttp.ClientSession, member: Upstream) -> None:
        try:
            async with session.get(f"{member.url}/health", timeout=self._timeout) as response:
                healthy, why = response.status == 200, f"/health answered {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            healthy, why = False, f"/health failed: {exc!r}"
        member.mark(healthy, why)
