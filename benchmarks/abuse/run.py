"""One run of the suite: each door attacked in turn under the normal stream, and its record
(cases and answers, instances that died, normal answers that changed or failed, memory growth,
counters moved, log lines, the positive control); an instance that died is started again before
the next door."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from rich.console import Console

from benchmarks.abuse import intruder
from benchmarks.abuse.deployment import ADMISSION_LIMIT, PROXY, Deployment
from benchmarks.abuse.doors import (
    CALL_TIMEOUT_S,
    CaseOutcome,
    HttpDoor,
    intrude,
    knock_outcome,
    listener_outcome,
    positive_control,
    run_http_case,
)
from benchmarks.abuse.http_cases import Context, HttpCase, instance_cases, proxy_cases
from benchmarks.abuse.normal import NormalPrompt, NormalStream
from benchmarks.chaos.report import LogWatch, log_findings

DOORS = (
    "proxy_http",
    "prefill_http",
    "decode_http",
    "decode_init_zmq",
    "decode_alloc_zmq",
    "proxy_notice_zmq",
    "nixl",
)
ZMQ_CASES = (
    "garbage",
    "oversized_frame",
    "multi_frame",
    "guessed_messages",
    "wrong_secret",
    "raw_tcp",
    "connection_flood",
)
SHORT_ZMQ_CASES = (
    "garbage",
    "multi_frame",
    "guessed_messages",
    "wrong_secret",
    "raw_tcp",
    "connection_flood",
)
# Normal requests sent after a door's last case that must end before the door is judged: damage
# that shows late (an engine dying on its next step) is charged to the door that did it.
NORMAL_AFTER = 2
NORMAL_WAIT_S = 240.0
MIB = 1 << 20
INSTANCE_AT_ONCE = 8
HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")
HANDSHAKE = "nixl_handshake"
LISTENER = "listener:"
# Finding the case that killed an instance: each case alone, its answer awaited this long, then
# this long for the instance to show it died.
REPLAY_WAIT_S = 10.0
REPLAY_SETTLE_S = 1.0

DoorResult = tuple[list[CaseOutcome], dict[str, Any]]
Only = frozenset[str] | None  # the case names to run (None: every case of this run)
Door = Callable[[Only, float], DoorResult]


class Suite:
    """Attacks the doors of ``deployment`` while ``stream`` sends normal requests. Each door is a
    function of the case names to run (None: every case of this run) and the longest wait for
    one HTTP answer."""

    def __init__(
        self,
        deployment: Deployment,
        stream: NormalStream,
        normal: list[NormalPrompt],
        short: bool,
        console: Console,
    ) -> None:
        self.deployment, self.stream, self.short, self.console = deployment, stream, short, console
        proxy = deployment.proxy
        assert proxy is not None
        decode = proxy.decode[0]
        assert isinstance(decode.init_port, int) and isinstance(decode.alloc_port, int)
        self.model = proxy.model
        self.decode = decode
        self.context = Context(
            proxy.model, decode.receiver_host, decode.init_port, decode.alloc_port
        )
        self.short_prompt = next(p.tokens for p in normal if p.tokens and len(p.tokens) < 256)
        self.long_prompt = max((p.tokens for p in normal), key=len)
        self.doors: dict[str, Door] = {
            "proxy_http": self.proxy_http,
            "prefill_http": lambda only, wait_s: self.instance_http("prefill-0", only, wait_s),
            "decode_http": lambda only, wait_s: self.instance_http("decode-0", only, wait_s),
            "decode_init_zmq": lambda only, _: self.consumer_port("init", only),
            "decode_alloc_zmq": lambda only, _: self.consumer_port("alloc", only),
            "proxy_notice_zmq": lambda only, _: self.notice_port(only),
            "nixl": lambda only, _: self.nixl(only),
        }

    def _chosen(self, names: list[str], only: Only) -> list[str]:
        return [name for name in names if only is None or name in only]

    # ---- the doors ----

    def _http(
        self, door: HttpDoor, cases: list[HttpCase], only: Only, at_once: int = 1
    ) -> DoorResult:
        """The cases of this run (or ``only`` those), ``at_once`` at a time (in their order)."""
        chosen = [case for case in cases if case.short or not self.short]
        chosen = [case for case in chosen if only is None or case.name in only]
        with ThreadPoolExecutor(at_once) as pool:
            outcomes = list(pool.map(lambda case: run_http_case(door, case), chosen))
        return outcomes, {"planned": len(chosen)}

    def proxy_http(self, only: Only, wait_s: float) -> DoorResult:
        door = HttpDoor(
            self.deployment.proxy_url,
            self.deployment.client_key,
            self.model,
            wait_s,
            ADMISSION_LIMIT,
            self.short_prompt,
        )
        # One at a time: a case in flight takes one of the few admission slots from the next.
        return self._http(door, proxy_cases(self.context), only)

    def instance_http(self, name: str, only: Only, wait_s: float) -> DoorResult:
        url = self.deployment.urls()[name]
        door = HttpDoor(url, self.deployment.instance_key, self.model, wait_s)
        cases = instance_cases(self.context, name.split("-")[0])
        # Several at once: decode waits load_timeout_s (30 s) for each spec's KV, which never
        # comes, before it computes the prompt.
        return self._http(door, cases, only, INSTANCE_AT_ONCE)

    def _target(self, kind: intruder.Kind, port: int) -> intruder.Target:
        host = self.decode.receiver_host if kind != "notice" else "127.0.0.1"
        return intruder.Target(host, port, kind, self.model, self.long_prompt)

    def _zmq(self, target: intruder.Target, only: Only) -> DoorResult:
        cases = self._chosen(list(SHORT_ZMQ_CASES if self.short else ZMQ_CASES), only)
        knocks = intrude(target, cases, [])
        outcomes = [knock_outcome(knock) for knock in knocks]
        control = positive_control(target, self.deployment.keys)
        return outcomes, {"planned": len(cases), "port": target.port, "control": control}

    def consumer_port(self, kind: intruder.Kind, only: Only) -> DoorResult:
        port = self.decode.init_port if kind == "init" else self.decode.alloc_port
        assert isinstance(port, int)
        return self._zmq(self._target(kind, port), only)

    def notice_port(self, only: Only) -> DoorResult:
        """The proxy's first-token notice port: the one it listens on besides its HTTP port."""
        assert self.deployment.proxy is not None
        http_port = self.deployment.proxy.port
        ports = [item.port for item in self.deployment.listening(PROXY) if item.port != http_port]
        if not ports:
            cases = len(self._chosen(list(SHORT_ZMQ_CASES if self.short else ZMQ_CASES), only))
            return [], {"planned": cases, "port": None, "note": "no notice port found"}
        return self._zmq(self._target("notice", ports[0]), only)

    def nixl(self, only: Only) -> DoorResult:
        """The handshake that hands out NIXL metadata, from a process without the secret; then
        bytes of no protocol into the ports NIXL's transport (UCX) listens on: the consumer's
        (short run), or every port of both instances not otherwise attacked (full run)."""
        assert isinstance(self.decode.init_port, int)
        target = self._target("init", self.decode.init_port)
        listeners = [item for item in self._other_listeners() if only is None or item[2] in only]
        handshake = self._chosen([HANDSHAKE], only)
        knocks = intrude(target, handshake, [(host, port) for host, port, _, _ in listeners])
        owners = {case: owner for _, _, case, owner in listeners}
        outcomes = [
            listener_outcome(k, owners[k["case"]]) if k["case"] in owners else knock_outcome(k)
            for k in knocks
        ]
        control = positive_control(target, self.deployment.keys)
        planned = len(handshake) + len(listeners)
        return outcomes, {"planned": planned, "control": control, "listeners": listeners}

    def _other_listeners(self) -> list[tuple[str, int, str, str]]:
        """Listening ports of the instances other than HTTP and the consumer's init and alloc
        ports: (host, port, case name, owner "decode-0/VLLM::Worker:PID"); in the short run
        only those of the consumer's own process (its NIXL agent's)."""
        known = {self.decode.init_port, self.decode.alloc_port}
        found = []
        urls = self.deployment.urls()
        for name in (n for n in urls if n != PROXY):
            http_port = int(urls[name].rsplit(":", 1)[1])
            listeners = self.deployment.listening(name)
            consumer = {item.pid for item in listeners if item.port in known}
            for item in listeners:
                if item.port in known or item.port == http_port:
                    continue
                if self.short and item.pid not in consumer:
                    continue
                owner = f"{name}/{item.process}:{item.pid}"
                found.append((item.host, item.port, f"{LISTENER}{item.port}", owner))
        return found

    # ---- one door, judged ----

    def run(self, name: str) -> dict[str, Any]:
        deployment, stream = self.deployment, self.stream
        before = deployment.conditions()
        counters_before = deployment.counters()
        logs = LogWatch([deployment.workdir])
        began = time.monotonic()
        stream.resume(name)
        stream.wait_started(since=began, timeout_s=NORMAL_WAIT_S)
        outcomes, extra = self.doors[name](None, CALL_TIMEOUT_S)
        ended = time.monotonic()
        stream.wait_done(NORMAL_AFTER, since=ended, timeout_s=NORMAL_WAIT_S)
        stream.pause()
        after = deployment.conditions()
        counters_after = deployment.counters()
        record = _record(name, outcomes, extra, self.stream, before, after)
        record["counters_moved"] = _moved(counters_before, counters_after)
        findings = log_findings(logs.lines())
        record["threads_dead_in_logs"] = findings["threads_dead_in_logs"]
        record["log_excerpts"] = findings["log_excerpts"]
        record["killed_by"], record["replayed"] = {}, {}
        if record["died"]:
            for dead in record["died"]:
                self.console.print(f"    [bold red]{dead} died[/bold red]: starting it again")
                deployment.heal(dead)
            record["killed_by"], record["replayed"] = self.killers(name, [o.case for o in outcomes])
        record["wall_s"] = round(time.monotonic() - began, 1)
        return record

    def killers(
        self, name: str, cases: list[str]
    ) -> tuple[dict[str, list[str]], dict[str, dict[str, Any]]]:
        """Which cases kill an instance, after a door where one died (beside it, every case
        got a dying instance's answers): each case sent again alone, its answer awaited at most
        ``REPLAY_WAIT_S`` (a kill shows at once), then every process checked, and what died
        started again before the next case. The processes each killer killed, and each case's
        outcome sent alone."""
        killed_by: dict[str, list[str]] = {}
        replayed: dict[str, dict[str, Any]] = {}
        for case in cases:
            outcomes, _ = self.doors[name](frozenset({case}), REPLAY_WAIT_S)
            replayed.update({o.case: asdict(o) for o in outcomes})
            time.sleep(REPLAY_SETTLE_S)
            dead = [n for n, c in self.deployment.conditions().items() if not c.up]
            if dead:
                killed_by[case] = dead
                for instance in dead:
                    self.deployment.heal(instance)
        return killed_by, replayed


def _record(
    name: str,
    outcomes: list[CaseOutcome],
    extra: dict[str, Any],
    stream: NormalStream,
    before: dict[str, Any],
    after: dict[str, Any],
) -> dict[str, Any]:
    normal = stream.of(name)
    outcomes_count = Counter(r.outcome for r in normal)
    record = {
        "door": name,
        "cases_planned": extra.pop("planned"),
        "cases_tried": len(outcomes),
        "unexpected": sum(not o.expected for o in outcomes),
        "admitted_without_key": sum(o.admitted_without_key for o in outcomes),
        "died": sorted(n for n, c in after.items() if not c.up),
        "normal_sent": len(normal),
        "normal_ok": outcomes_count["ok"],
        "normal_changed": outcomes_count["changed"],
        # A request still pending here outlived the client's timeout and the pause's wait.
        "normal_failed": outcomes_count["failed"] + outcomes_count["pending"],
        "normal_deferred": sum(r.deferred for r in normal),
        "normal_problems": [
            f"{r.prompt}: {r.outcome}: {r.detail}" for r in normal if r.outcome != "ok"
        ][:8],
        # None for a process that died: what it held is gone, not given back.
        "rss_growth_mib": {
            n: round((c.rss_bytes - before[n].rss_bytes) / MIB, 1) if c.up else None
            for n, c in after.items()
        },
        "rss_after_mib": {n: round(c.rss_bytes / MIB) for n, c in after.items()},
        "conditions_after": {n: asdict(c) for n, c in after.items()},
        "cases": [asdict(o) for o in outcomes],
        **extra,
    }
    record["goals"] = goals(record)
    return record


def goals(record: dict[str, Any]) -> dict[str, bool]:
    """The suite's goals for one door: nothing died, no normal answer changed or failed, and
    every case planned was tried."""
    return {
        "died == 0": not record["died"],
        "normal_changed == 0": record["normal_changed"] == 0,
        "normal_failed == 0": record["normal_failed"] == 0,
        "every case tried": record["cases_planned"] > 0
        and record["cases_tried"] >= record["cases_planned"],
    }


def _moved(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """Per process, the counters that moved (gauges too, not histograms), by how much."""
    moved = {}
    for name, counters in after.items():
        changed = {
            counter: round(value - before.get(name, {}).get(counter, 0.0), 3)
            for counter, value in counters.items()
            if value != before.get(name, {}).get(counter, 0.0)
            and not counter.endswith(HISTOGRAM_PARTS)
        }
        if changed:
            moved[name] = changed
    return moved
