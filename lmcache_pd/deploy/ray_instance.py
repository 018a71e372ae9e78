"""One prefill or decode vLLM as a Ray actor: Ray picks its node, starts it, and starts it again
when it dies.

The actor owns a vLLM server process on its node (``launcher.start_instance``, as the embedded
launcher starts one), on ports picked free there and bound to the node's address, so that the
other nodes reach its HTTP API and, for decode, its KV receive ports. Its life is the server's:
a watcher thread ends the actor's process the moment the server dies (``os._exit``), which Ray
sees as the actor failing and answers with a restart (``max_restarts``) on fresh ports; the
actor's own death takes the server with it (the child's parent-death signal). Only a first start
that fails is reported instead (``describe``: ``failed`` and the end of the server's log), so a
bad configuration ends ``serve`` with a reason rather than a restart loop.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Literal

import httpx
import msgspec
import ray
from prometheus_client.parser import text_string_to_metric_families

from lmcache_pd.deploy.launcher import Ports, receive_ports, start_instance
from lmcache_pd.deploy.pools import InstanceSpec, PoolsConfig
from lmcache_pd.proxy.config import KVEventsAddress
from lmcache_pd.proxy.membership import Member

logger = logging.getLogger(__name__)

WATCH_EVERY_S = 0.2
# vLLM's gauges of the requests it has: a draining instance stops when both are zero.
IN_FLIGHT_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
METRICS_TIMEOUT_S = 5.0
KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}

State = Literal["starting", "ready", "failed"]


def quiet_actor_logging() -> None:
    """Our INFO lines in an actor's log (Ray streams them to ``serve``'s terminal); not every
    HTTP request of httpx's."""
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)


class InstanceState(msgspec.Struct, frozen=True):
    """What an instance actor says about itself."""

    member: Member
    state: State
    pid: int  # the vLLM server's (its process group's) id, on the actor's node
    node: str
    log: str
    failure: str | None = None


class InstanceActor:
    """A vLLM server of one pool on the node Ray placed this actor on."""

    def __init__(
        self,
        pools: PoolsConfig,
        workdir: str,
        name: str,
        role: Literal["prefill", "decode"],
        spec: InstanceSpec,
        settings_of_role: dict[str, Any],
        instance_key: str,
        kv_keys: str,
    ) -> None:
        """Start instance ``name``'s server, answering without ``instance_key`` only /health and
        /metrics, its KV channel authenticated by ``kv_keys``, its role's share of the deployment
        secret (in the server's environment: no file of it is on this node); a restart by Ray
        starts it again with the same arguments, key and share too."""
        quiet_actor_logging()
        self._host = ray.util.get_node_ip_address()
        with warnings.catch_warnings():  # Ray's own use of a deprecated property inside
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        folder = Path(workdir)
        folder.mkdir(parents=True, exist_ok=True)
        ports = Ports([spec.port] if spec.port else [])
        port = ports.take(spec.port)
        receive: dict[str, Any] = {}
        if role == "decode":
            receive = receive_ports(ports, spec.tensor_parallel_size)
            settings_of_role = settings_of_role | receive | {"receiver_host": self._host}
        # Its KV events, on this node's address too, for the proxy's KV routing: a restart
        # publishes on fresh ports, and the proxy follows it there (``proxy/kv_index.py``).
        events = (
            KVEventsAddress(self._host, ports.take(), ports.take())
            if pools.proxy.routing == "kv"
            else None
        )
        self._server = start_instance(
            pools,
            folder,
            name,
            spec,
            KV_ROLE[role],
            port,
            settings_of_role,
            # A restart's log beside the first one's, never over it.
            log_name=f"{name}.{os.getpid()}" if restarted else None,
            host=self._host,
            api_key=instance_key,
            kv_keys=kv_keys,
            kv_events=events,
        )
        if role == "decode":
            member = Member(
                name,
                role,
                self._server.url,
                self._host,
                receive["init_port"],
                receive["alloc_port"],
                kv_events=events,
            )
        else:
            member = Member(name, role, self._server.url, kv_events=events)
        self._member = member
        self._restarted = restarted
        self._state: State = "starting"
        self._failure: str | None = None
        self._stopping = threading.Event()
        threading.Thread(target=self._become_ready, name="ready", daemon=True).start()
        threading.Thread(target=self._watch, name="watch", daemon=True).start()
        logger.info(
            "%s %s on node %s (%s)",
            name,
            "restarted" if restarted else "starting",
            self._host,
            self._server.url,
        )

    def _become_ready(self) -> None:
        try:
            self._server.wait_until_healthy()
            seconds = self._server.warm_up()
        except Exception as exc:  # reported by describe; the watcher restarts a restart
            self._failure = f"{self._member.name} did not start: {exc}"
            self._state = "failed"
            logger.error("%s", self._failure)
            return
        self._state = "ready"
        logger.info("%s ready at %s (warm-up %.1f s)", self._member.name, self._member.url, seconds)

    def _watch(self) -> None:
        """End this actor's process when its server dies unasked, so that Ray restarts it; a
        first start that failed stays to be reported instead."""
        while not self._stopping.wait(WATCH_EVERY_S):
            if self._server.running:
                continue
            if self._stopping.is_set():
                return
            if self._state == "starting" and not self._restarted:
                return  # _become_ready reports it as failed
            logger.error(
                "%s: its vLLM server exited; ending the actor so that Ray restarts it. Log end:"
                "\n%s",
                self._member.name,
                self._server.tail(20),
            )
            self._server.stop()  # whatever of its group lives on, and what it left behind
            os._exit(1)

    def describe(self) -> InstanceState:
        return InstanceState(
            self._member,
            self._state,
            self._server.pid,
            self._host,
            str(self._server.log_path),
            self._failure,
        )

    def in_flight(self) -> int:
        """Requests the server has running or waiting, from its own ``/metrics``."""
        text = httpx.get(f"{self._server.url}/metrics", timeout=METRICS_TIMEOUT_S).text
        return int(
            sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name in IN_FLIGHT_GAUGES
            )
        )

    def stop(self) -> float:
        """Stop the server (its whole process group); returns the seconds it took."""
        started = time.monotonic()
        self._stopping.set()
        self._server.stop()
        logger.info("%s stopped", self._member.name)
        return time.monotonic() - started
