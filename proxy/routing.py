"""Which instance gets the next request, never one that is marked down. Health checks and failed
requests mark instances down and up.

Without a measure of the work (``routing: load``, or nothing known of the prompt): least
outstanding requests, round-robin among equals. With one (``placement.py``: the prompt tokens an
instance would have to compute, given what its cache holds), the instance of least cost (that
work, plus the prompt tokens queued on it until their first token, plus a weight per outstanding
request) among those whose load stays within a bound of the least loaded one, so that a hot
prefix spreads once its instance is busy; ties go as without one. This is llm-d's precise-prefix
and load scorers in one sum, in tokens.

A prompt stops weighing as queued when it is computed: at its answer's first token where the
proxy sees one (prefill's answer, a stream's first event). A whole answer decode serves alone
shows nothing until it ends (vLLM sends even its headers then), seconds of decoding after its
prompt was computed; a time bound would be a guess. So it weighs until decode's own KV events
show the prompt's last full block stored (``KVIndex.holds_last_block``: vLLM stores a block as
it schedules the step that computes it and publishes that step's events when it is done), read
whenever routing reads the queue; where they cannot tell (a decode that publishes none, a prompt
under a block, a last block held already), until its answer ends.

Everything here runs on the proxy's one event loop, so counters need no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Awaitable, Callable, Collection, Iterator
from dataclasses import dataclass, field

import aiohttp

from lmcache_pd.proxy.config import KVEventsAddress
from lmcache_pd.proxy.task_stop import stop_task

logger = logging.getLogger(__name__)

# The load bound of a costed pick: an instance with more than IMBALANCE times the outstanding
# requests of the least loaded one (and IMBALANCE_SLACK more) is not chosen, however much of the
# prompt it holds: requests per instance stay within ~2x under load.
IMBALANCE = 2
IMBALANCE_SLACK = 2
# What one outstanding request weighs against prompt tokens to compute: a running decode stream
# takes a share of every step, about what a few dozen prompt tokens cost on these machines.
TOKENS_PER_OUTSTANDING = 64


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
    # Where it publishes its KV events (None: it does not).
    kv_events: KVEventsAddress | None = None
    outstanding: int = 0
    # Prompt tokens it computes for the requests outstanding on it (as the proxy estimated).
    queued_tokens: int = 0
    healthy: bool = True
    # Of those, the prompts only a probe can tell computed (a whole answer served alone): each
    # request's "takes its tokens off" and its probe.
    _probes: dict[Callable[[], None], Callable[[], bool]] = field(
        default_factory=dict, init=False, repr=False
    )

    @contextlib.contextmanager
    def busy(
        self, tokens: int = 0, computed_when: Callable[[], bool] | None = None
    ) -> Iterator[Callable[[], None]]:
        """Counts one outstanding request for as long as the block runs, and ``tokens`` prompt
        tokens it computes here until the callable it yields is called (its first token came:
        the prompt is computed, and a streaming answer must not keep weighing as a queued
        prompt), ``computed_when()`` says so where given (read when routing reads the queue,
        ``queued``), or the block ends."""
        self.outstanding += 1
        self.queued_tokens += tokens
        queued = tokens

        def computed() -> None:
            nonlocal queued
            self.queued_tokens -= queued
            queued = 0
            self._probes.pop(computed, None)

        if tokens and computed_when is not None:
            self._probes[computed] = computed_when
        try:
            yield computed
        finally:
            self.outstanding -= 1
            computed()

    def queued(self) -> int:
        """Prompt tokens queued here now, those its probes say are computed taken off first."""
        for computed, probe in list(self._probes.items()):
            if probe():
                computed()
        return self.queued_tokens

    def mark(self, healthy: bool, why: str) -> None:
        """Record a health change, logging only transitions so a dead instance is one line."""
        if healthy != self.healthy:
            self.healthy = healthy
            if healthy:
                logger.info("%s instance %s is back up (%s)", self.role.value, self.url, why)
            else:
                logger.warning("%s instance %s marked down: %s", self.role.value, self.url, why)


def cost(member: Upstream, work: Callable[[Upstream], int]) -> int:
    """What sending a request of ``work`` to ``member`` costs, in prompt tokens."""
    return work(member) + member.queued() + TOKENS_PER_OUTSTANDING * member.outstanding


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

    def pick(
        self, exclude: Collection[Upstream] = (), work: Callable[[Upstream], int] | None = None
    ) -> Upstream:
        """The healthy instance of least cost, but those in ``exclude`` (they failed this
        request), among those within the load bound, ``work`` being
        the prompt tokens each would compute (without it: of fewest outstanding requests); costs
        within ``TOKENS_PER_OUTSTANDING`` of the least are equal, and equals go least
        outstanding, then round-robin."""
        count = len(self.members)
        rotated = self.members[self._cursor :] + self.members[: self._cursor]
        healthy = [member for member in rotated if member.healthy and member not in exclude]
        if not healthy:
            raise NoHealthyInstance(f"no healthy {self.role.value} instance")
        if work is None:
            chosen = min(healthy, key=lambda member: member.outstanding)  # first of equals wins
        else:
            least = min(member.outstanding for member in healthy)
            bound = max(IMBALANCE * least, least + IMBALANCE_SLACK)
            costs = {m: cost(m, work) for m in healthy if m.outstanding <= bound}
            best = min(costs.values())
            # Costs apart by less than one outstanding request weighs are equal: what one
            # instance holds more would spare less than a request's share of a step.
            equal = [m for m, c in costs.items() if c < best + TOKENS_PER_OUTSTANDING]
            chosen = min(equal, key=lambda member: member.outstanding)  # first of equals wins
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
            await stop_task(self._task, self._name)
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
        on_up: Callable[[Upstream], Awaitable[bool]] | None = None,
    ) -> None:
        """``on_up``: asked before an instance that was down is marked up again, which it
        is only if that says True (``adapter_loads.py``: it is given what it lacks)."""
        self._upstreams = upstreams
        self._on_up = on_up
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
        if healthy and not member.healthy and self._on_up and not await self._on_up(member):
            healthy, why = False, "what it must serve could not be given it"
        member.mark(healthy, why)
