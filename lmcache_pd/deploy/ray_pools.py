"""``engine: ray``: prefill and decode pools as actors on a Ray cluster, looked after by one
controller actor, and the proxy told who serves now.

``serve`` (the driver) connects to the cluster and starts a ``PoolsController`` actor, named
``controller`` in the deployment's Ray namespace, which owns every ``InstanceActor``: Ray places
each on a node by its resources and labels (``pools.py``), restarts it when it dies
(``max_restarts``), and ends them all with the controller, which ends with the driver (Ray's
ownership), so a ``serve`` that dies leaves nothing running. The controller asks its instances
how they are every ``discovery_interval_s``; the proxy asks the controller (``RayPools`` is its
``MemberSource``) and routes only to instances that are ready and not draining, so a restarted
instance on new ports takes requests again without the proxy restarting. ``lmcache-pd scale``
finds the controller by name: growing a pool starts instances and returns when they are ready;
shrinking one drains first (no new requests; stopped once neither the proxy nor vLLM has any of
its requests left, or at ``drain_timeout_s``).

The deployment secret (``lmcache_pd/auth.py``: ``$LMCACHE_PD_SECRET``, else a fresh one) stays
in the driver: the controller gets the producer's and the consumer's shares of it, each instance
actor its own role's as an argument, and each vLLM that share in its environment; the proxy,
beside the driver, reads its own share from ``WORKDIR/kv.proxy.key``. Ray carries the shares in
its own calls, so the cluster should ask for Ray's token: ``connect`` warns when it does not
(``ray_cluster.py``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import ray
from ray.actor import ActorHandle
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lmcache_pd.auth import SECRET_ENV, Role, generate_secret, role_shares
from lmcache_pd.deploy.launcher import (
    LaunchError,
    new_instance_key,
    peer_text,
    proxy_config_for,
    share_file,
    write_key,
)
from lmcache_pd.deploy.pools import InstanceSpec, PoolsConfig
from lmcache_pd.deploy.ray_cluster import connect
from lmcache_pd.deploy.ray_instance import InstanceActor, InstanceState, quiet_actor_logging
from lmcache_pd.deploy.vllm_server import START_TIMEOUT_S, WARM_UP_TIMEOUT_S
from lmcache_pd.errors import ConfigError
from lmcache_pd.proxy.config import DecodeInstance, PrefillInstance, ProxyConfig
from lmcache_pd.proxy.membership import Member, Outstanding

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "controller"
PoolName = Literal["prefill", "decode"]
# An instance that does not answer this fast is taken as restarting (its calls wait for the
# new incarnation's start).
DESCRIBE_TIMEOUT_S = 2.0
READY_TIMEOUT_S = START_TIMEOUT_S + WARM_UP_TIMEOUT_S
# An instance actor's stop (its vLLM server's), and the controller's stop of every instance.
ACTOR_STOP_TIMEOUT_S = 60.0
# Without a word from any proxy for this many discovery intervals, a drain goes by vLLM's own
# count of requests alone.
SILENT_PROXY_INTERVALS = 5
CONNECT_TIMEOUT_S = 60.0


@dataclass
class _Instance:
    """The controller's record of one instance actor."""

    name: str
    role: PoolName
    spec: InstanceSpec
    handle: ActorHandle
    state: InstanceState | None = None
    condition: str = "starting"  # starting, ready, restarting, failed, dead, draining
    draining: bool = False


@dataclass
class _Reports:
    """What the proxy said last about its requests per instance, and when."""

    count: int = 0
    at: float = field(default_factory=time.monotonic)
    outstanding: Outstanding = field(default_factory=dict)


class PoolsController:
    """Owns one deployment's instance actors (a Ray async actor; one event loop, so its state
    needs no locks)."""

    def __init__(
        self, pools: PoolsConfig, workdir: str, instance_key: str, shares: dict[PoolName, str]
    ) -> None:
        """``instance_key``: what every instance it starts wants from its callers; ``shares``:
        by pool, its instances' share of the deployment secret (``auth.share_text``), which
        authenticates their KV channel."""
        quiet_actor_logging()
        self._pools = pools
        self._workdir = workdir
        self._instance_key = instance_key
        self._shares = shares
        self._instances: dict[str, _Instance] = {}
        self._indexes = {"prefill": itertools.count(), "decode": itertools.count()}
        self._reports = _Reports()
        self._watcher: asyncio.Task[None] | None = None

    async def start(self) -> list[Member]:
        """Start every instance of the pools file and return them once all are ready; raises
        ``LaunchError`` naming the one that did not start. Decode first: prefill is told
        every decode rank to shake hands with ahead of its first request."""
        decode = [self._create("decode", spec, {}) for spec in self._pools.decode]
        await self._wait_ready(decode, described_only=True)
        peers = [
            peer_text(_decode_instance(state.member))
            for name in decode
            if (state := self._instances[name].state) is not None
        ]
        prefill = [
            self._create("prefill", spec, {"warm_peers": peers}) for spec in self._pools.prefill
        ]
        await self._wait_ready([*decode, *prefill])
        self._watcher = asyncio.create_task(self._watch())
        return self.serving()

    async def members(self, outstanding: Outstanding) -> list[Member]:
        """The proxy's question: who serves now. ``outstanding`` is its requests per instance."""
        self._reports = _Reports(self._reports.count + 1, time.monotonic(), outstanding)
        return self.serving()

    def serving(self) -> list[Member]:
        return [
            i.state.member
            for i in self._instances.values()
            if i.condition == "ready" and not i.draining and i.state is not None
        ]

    async def describe(self) -> dict[str, dict[str, Any]]:
        """Every instance: its condition, node, URL, server pid and log (``lmcache-pd scale``
        prints it)."""
        return {
            i.name: {"role": i.role, "condition": i.condition}
            | (msgspec.to_builtins(i.state) if i.state is not None else {})
            for i in self._instances.values()
        }

    async def scale(self, role: PoolName, count: int) -> dict[str, Any]:
        """Grow or shrink pool ``role`` to ``count`` instances; returns what changed and how long
        it took. New instances are started from the pool's last spec in the pools file."""
        if count < 1:
            raise ConfigError(f"a {role} pool needs at least one instance, not {count}")
        started = time.monotonic()
        current = [i for i in self._instances.values() if i.role == role and not i.draining]
        specs = self._pools.prefill if role == "prefill" else self._pools.decode
        added, removed = [], []
        if count > len(current):
            added = [self._create(role, specs[-1], {}) for _ in range(count - len(current))]
            await self._wait_ready(added)
        else:
            leaving = current[count:]  # the newest go first
            removed = [i.name for i in leaving]
            await asyncio.gather(*(self._drain(i) for i in leaving))
        return {"added": added, "removed": removed, "seconds": time.monotonic() - started}

    async def shutdown(self) -> None:
        """Stop every instance's server, then the actors (no restart)."""
        if self._watcher is not None:
            self._watcher.cancel()
        await asyncio.gather(*(self._stop(i) for i in list(self._instances.values())))

    # ---- inside ----

    def _create(self, role: PoolName, spec: InstanceSpec, settings: dict[str, Any]) -> str:
        name = f"{role}-{next(self._indexes[role])}"
        ray_settings = self._pools.ray
        options: dict[str, Any] = {
            "name": name,
            "num_cpus": spec.cores,
            "max_restarts": ray_settings.max_restarts,
            "resources": dict(spec.ray_resources),
        }
        if spec.memory_gib is not None:
            options["memory"] = int(spec.memory_gib * 2**30)
        if spec.ray_labels:
            options["label_selector"] = dict(spec.ray_labels)
        handle = (
            ray.remote(InstanceActor)
            .options(**options)
            .remote(
                self._pools,
                self._workdir,
                name,
                role,
                spec,
                settings,
                self._instance_key,
                self._shares[role],
            )
        )
        self._instances[name] = _Instance(name, role, spec, handle)
        return name

    async def _describe(self, instance: _Instance) -> None:
        """Ask one instance how it is and record its condition, logging changes."""
        try:
            state = await asyncio.wait_for(instance.handle.describe.remote(), DESCRIBE_TIMEOUT_S)
        except (TimeoutError, ActorUnavailableError):  # Ray is starting it again
            condition = "restarting"
        except ActorDiedError as exc:
            condition = "dead"
            if instance.condition != "dead":
                logger.error("%s is dead and will not be restarted: %s", instance.name, exc)
        else:
            instance.state = state
            condition = state.state
            if state.failure and instance.condition != "failed":
                logger.error("%s", state.failure)
        if condition != instance.condition:
            where = instance.state.member.url if instance.state else "?"
            logger.info("%s (%s): %s -> %s", instance.name, where, instance.condition, condition)
        instance.condition = condition

    async def _wait_ready(self, names: list[str], *, described_only: bool = False) -> None:
        """Until every named instance is ready (or, with ``described_only``, has answered
        once: its ports are known); ``LaunchError`` for one that failed, died or is late."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        waiting = [self._instances[name] for name in names]
        while True:
            await asyncio.gather(*(self._describe(i) for i in waiting))
            for instance in waiting:
                if instance.condition in ("failed", "dead"):
                    raise LaunchError(
                        instance.state.failure
                        if instance.state and instance.state.failure
                        else f"{instance.name} died while starting (see the Ray worker's log)"
                    )
            if described_only:
                waiting = [i for i in waiting if i.state is None]
            else:
                waiting = [i for i in waiting if i.condition != "ready"]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise LaunchError(
                    f"not ready after {READY_TIMEOUT_S:.0f} s: {[i.name for i in waiting]}"
                )
            await asyncio.sleep(0.5)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._pools.ray.discovery_interval_s)
            watched = [i for i in self._instances.values() if i.condition != "dead"]
            await asyncio.gather(*(self._describe(i) for i in watched))

    async def _drain(self, instance: _Instance) -> None:
        """Take ``instance`` out of what the proxy is told, wait until neither the proxy nor
        vLLM has a request of it left (at most ``drain_timeout_s``), then stop it."""
        instance.draining = True
        marked, since = self._reports.count, time.monotonic()
        interval = self._pools.ray.discovery_interval_s
        url = instance.state.member.url if instance.state else None
        deadline = since + self._pools.ray_drain_timeout_s
        logger.info("%s draining", instance.name)
        while time.monotonic() < deadline:
            # Two reports after the mark: the second was made after the proxy stopped routing.
            heard = self._reports.count >= marked + 2
            silent = time.monotonic() - self._reports.at > SILENT_PROXY_INTERVALS * interval
            proxy_idle = silent or (heard and not self._reports.outstanding.get(url or "", 0))
            if proxy_idle and await self._in_flight(instance) == 0:
                break
            await asyncio.sleep(interval / 2)
        else:
            logger.warning(
                "%s: requests still running after drain_timeout_s %.0f s; stopping it anyway",
                instance.name,
                self._pools.ray_drain_timeout_s,
            )
        await self._stop(instance)
        logger.info("%s drained and stopped after %.1f s", instance.name, time.monotonic() - since)

    async def _in_flight(self, instance: _Instance) -> int:
        try:
            return await asyncio.wait_for(instance.handle.in_flight.remote(), DESCRIBE_TIMEOUT_S)
        except Exception as exc:  # an instance that cannot say has nothing to wait for
            logger.warning("%s: cannot count its requests: %r", instance.name, exc)
            return 0

    async def _stop(self, instance: _Instance) -> None:
        try:
            await asyncio.wait_for(instance.handle.stop.remote(), ACTOR_STOP_TIMEOUT_S)
        except Exception as exc:  # dead already, or stuck: the kill below ends it either way
            logger.warning("%s: stopping its server failed: %r", instance.name, exc)
        ray.kill(instance.handle, no_restart=True)
        del self._instances[instance.name]


def controller(namespace: str) -> ActorHandle:
    """The running deployment's controller (``lmcache-pd scale``)."""
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=namespace)
    except ValueError:
        raise ConfigError(
            f"no lmcache-pd deployment in Ray namespace {namespace!r} (is `serve` running?)"
        ) from None


class RayPools:
    """``serve``'s side of ``engine: ray``: connects, starts the controller and the pools,
    serves as the proxy's ``MemberSource``, and stops it all on exit."""

    def __init__(self, pools: PoolsConfig, workdir: Path) -> None:
        self.pools = pools
        self.workdir = workdir
        self.interval_s = pools.ray.discovery_interval_s
        self.instance_key = new_instance_key()
        # A secret too short fails here, not in every vLLM.
        self._shares = role_shares(os.environ.get(SECRET_ENV) or generate_secret())
        self._controller: ActorHandle | None = None

    def start(self) -> ProxyConfig:
        """Connect, start every instance (placed by Ray) and return the proxy's config."""
        settings = self.pools.ray
        connect(settings.address, settings.namespace)
        try:
            ray.get_actor(CONTROLLER_NAME, namespace=settings.namespace)
        except ValueError:
            pass
        else:
            raise ConfigError(
                f"an lmcache-pd deployment already runs in Ray namespace {settings.namespace!r}; "
                "name another (ray.namespace in the pools file)"
            )
        self.workdir.mkdir(parents=True, exist_ok=True)
        secret_file = share_file(self.workdir, Role.PROXY)
        write_key(secret_file, self._shares[Role.PROXY])
        shares: dict[PoolName, str] = {
            "prefill": self._shares[Role.PRODUCER],
            "decode": self._shares[Role.CONSUMER],
        }
        pools = _absolute(self.pools)
        self._controller = (
            ray.remote(PoolsController)
            .options(
                name=CONTROLLER_NAME,
                num_cpus=0,
                max_restarts=0,
                # Beside the driver it shares its fate with, not on a node that may go away.
                scheduling_strategy=NodeAffinitySchedulingStrategy(
                    ray.get_runtime_context().get_node_id(), soft=False
                ),
            )
            .remote(pools, str(self.workdir.resolve()), self.instance_key, shares)
        )
        members = ray.get(self._controller.start.remote(), timeout=READY_TIMEOUT_S * 2)
        prefill = [PrefillInstance(m.url, m.kv_events) for m in members if m.role == "prefill"]
        decode = [_decode_instance(m) for m in members if m.role == "decode"]
        return proxy_config_for(
            pools, prefill, decode, self.workdir, self.instance_key, secret_file
        )

    async def members(self, outstanding: Outstanding) -> list[Member]:
        assert self._controller is not None
        reference = self._controller.members.remote(outstanding)
        return await asyncio.wrap_future(reference.future())

    def stop(self) -> None:
        """Stop every instance, then the controller; leave the cluster."""
        if self._controller is not None:
            try:
                ray.get(self._controller.shutdown.remote(), timeout=ACTOR_STOP_TIMEOUT_S)
            except (GetTimeoutError, RayActorError) as exc:
                logger.warning("the controller did not stop the instances: %r", exc)
            ray.kill(self._controller, no_restart=True)
            self._controller = None
        ray.shutdown()

    def __enter__(self) -> RayPools:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _absolute(pools: PoolsConfig) -> PoolsConfig:
    """Paths in the pools file resolved here: actors run in other folders (and on other nodes,
    where the model and configs must be at the same paths)."""

    def resolved(spec: InstanceSpec) -> InstanceSpec:
        return msgspec.structs.replace(spec, config=str(Path(spec.config).resolve()))

    return msgspec.structs.replace(
        pools,
        model=str(Path(pools.model).resolve()),
        prefill=[resolved(s) for s in pools.prefill],
        decode=[resolved(s) for s in pools.decode],
    )


def _decode_instance(member: Member) -> DecodeInstance:
    receiver = member.receiver
    assert receiver is not None, f"decode member {member.name} without KV ports"
    return DecodeInstance(member.url, *receiver, kv_events=member.kv_events)
