"""How each door's cases are sent and what their answers mean: HTTP calls (JSON, raw bytes on a
socket, a burst, slow headers) from this process, ZMQ and NIXL knocks from the intruder process,
and the positive controls that show a knock would have seen an open door."""

from __future__ import annotations

import base64
import contextlib
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from benchmarks.abuse import intruder
from benchmarks.abuse.http_cases import CLOSED, Call, HttpCase
from lmcache_pd.auth import DeploymentKeys

# Decode called with a spec waits its load_timeout_s (30 s) for KV before it computes the prompt.
CALL_TIMEOUT_S = 120.0
RAW_TIMEOUT_S = 10.0
NO_ANSWER = -1  # a call that got no HTTP answer at all (refused, reset)
TIMED_OUT = -2  # a call whose answer did not come within the door's wait
BURST_FACTOR = 3
BURST_OUTPUT_TOKENS = 24
SLOW_CONNECTIONS = 64
SLOW_HOLD_S = 3.0
INTRUDER_TIMEOUT_S = 300.0


@dataclass(slots=True)
class CaseOutcome:
    """What one case got, and whether that is what its door should answer."""

    case: str
    answers: list[Any]  # HTTP statuses (0: closed without an answer), or per-knock summaries
    expected: bool
    detail: str = ""
    seconds: float = 0.0
    # Calls or knocks without the door's secret or key that were served or admitted anyway.
    admitted_without_key: int = 0
    what: str = ""


@dataclass(frozen=True, slots=True)
class HttpDoor:
    """An HTTP door: its base URL and the key it wants (the proxy's client key, or the
    instances' key); for the proxy, its admission limit and the short prompt a burst sends."""

    url: str
    key: str
    model: str
    wait_s: float = 120.0  # the longest wait for one answer
    admission_limit: int = 0
    short_prompt: tuple[int, ...] = field(default=())

    def headers(self, call: Call) -> dict[str, str]:
        if call.auth == "key":
            return {"Authorization": f"Bearer {self.key}"}
        if call.auth == "wrong":
            return {"Authorization": "Bearer not-the-key-" + "x" * 30}
        if call.auth == "basic":
            return {"Authorization": "Basic " + base64.b64encode(f"u:{self.key}".encode()).decode()}
        return {}


def run_http_case(door: HttpDoor, case: HttpCase) -> CaseOutcome:
    started = time.monotonic()
    if case.action == "burst":
        outcome = _burst(door, case)
    elif case.action == "slow_headers":
        outcome = _slow_headers(door, case)
    elif case.raw:
        status, excerpt = _raw(door.url, case.raw)
        outcome = CaseOutcome(case.name, [status], status in case.expect, excerpt)
    else:
        outcome = _calls(door, case)
    outcome.seconds = round(time.monotonic() - started, 2)
    outcome.what = case.what
    return outcome


def _calls(door: HttpDoor, case: HttpCase) -> CaseOutcome:
    statuses: list[int] = []
    detail, admitted = "", 0
    with httpx.Client(timeout=door.wait_s) as client:
        for call in case.calls:
            status, excerpt = _call(client, door, call)
            statuses.append(status)
            if call.auth != "key" and 200 <= status < 300:
                admitted += 1
            if status not in case.expect and not detail:
                detail = f"{call.method} {call.path}: {excerpt}"
    expected = all(status in case.expect for status in statuses)
    return CaseOutcome(case.name, statuses, expected, detail, admitted_without_key=admitted)


def _call(client: httpx.Client, door: HttpDoor, call: Call) -> tuple[int, str]:
    headers = door.headers(call)
    try:
        if isinstance(call.body, dict):
            response = client.request(
                call.method, door.url + call.path, json=call.body, headers=headers
            )
        else:
            headers["Content-Type"] = "application/json"
            content = call.body if call.method == "POST" else None
            response = client.request(
                call.method, door.url + call.path, content=content, headers=headers
            )
    except httpx.TimeoutException:
        return TIMED_OUT, f"no answer within {door.wait_s} s"
    except httpx.HTTPError as exc:
        return NO_ANSWER, f"no answer: {exc!r}"[:300]
    return response.status_code, response.text[:300]


def _raw(url: str, data: bytes) -> tuple[int, str]:
    """Send ``data`` as it is on a fresh connection; the status of what comes back (0: the
    connection closed with no answer)."""
    parts = urlsplit(url)
    answer = b""
    try:
        sock = socket.create_connection((parts.hostname, parts.port), timeout=RAW_TIMEOUT_S)
    except OSError as exc:
        return NO_ANSWER, f"no connection: {exc!r}"
    with sock:
        with contextlib.suppress(OSError):
            sock.sendall(data)
        with contextlib.suppress(OSError):
            while b"\r\n" not in answer and len(answer) < 4096:
                more = sock.recv(4096)
                if not more:
                    break
                answer += more
    line = answer.split(b"\r\n", 1)[0].decode("latin-1")
    fields = line.split()
    status = int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else CLOSED
    return status, line[:200]


def _burst(door: HttpDoor, case: HttpCase) -> CaseOutcome:
    """Three times the admission limit at once (``door.key`` is the client key): every answer
    is 200 or a 503 with Retry-After, and at least one is a 503."""
    body = {
        "model": door.model,
        "prompt": list(door.short_prompt),
        "max_tokens": BURST_OUTPUT_TOKENS,
        "ignore_eos": True,
    }
    count = BURST_FACTOR * door.admission_limit
    with (
        httpx.Client(timeout=door.wait_s, limits=httpx.Limits(max_connections=count)) as client,
        ThreadPoolExecutor(count) as pool,
    ):

        def one(_: int) -> tuple[int, bool]:
            try:
                response = client.post(
                    f"{door.url}/v1/completions", json=body, headers=door.headers(Call())
                )
            except httpx.HTTPError:
                return NO_ANSWER, False
            return response.status_code, "retry-after" in response.headers

        answers = list(pool.map(one, range(count)))
    statuses = [status for status, _ in answers]
    refused = [has_retry for status, has_retry in answers if status == 503]
    expected = set(statuses) <= case.expect and bool(refused) and all(refused)
    detail = f"{statuses.count(200)} served, {len(refused)} refused with 503"
    if refused and not all(refused):
        detail += " (some without Retry-After)"
    return CaseOutcome(case.name, sorted(statuses), expected, detail)


def _slow_headers(door: HttpDoor, case: HttpCase) -> CaseOutcome:
    """Connections that send half a request and wait, while the door is asked for /health."""
    parts = urlsplit(door.url)
    half = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le"
    with contextlib.ExitStack() as stack:
        held = 0
        for _ in range(SLOW_CONNECTIONS):
            with contextlib.suppress(OSError):
                sock = socket.create_connection((parts.hostname, parts.port), timeout=5)
                stack.callback(sock.close)
                sock.sendall(half)
                held += 1
        try:
            status = httpx.get(f"{door.url}/health", timeout=door.wait_s).status_code
        except httpx.HTTPError:
            status = NO_ANSWER
        time.sleep(SLOW_HOLD_S)
    detail = f"{held} connections held {SLOW_HOLD_S} s; /health meanwhile: {status}"
    return CaseOutcome(case.name, [status], status in case.expect, detail)


def knock_summary(knock: dict[str, Any]) -> str:
    if knock["failed"]:
        return f"case failed: {knock['errors'][0][:120]}"
    parts = ["admitted" if knock["admitted"] else "not admitted", f"{knock['replies']} replies"]
    if knock["metadata"]:
        parts.append("NIXL METADATA")
    if knock["mechanism"]:
        parts.append(f"greeting asks {knock['mechanism']}")
    return ", ".join(parts)


def knock_outcome(knock: dict[str, Any], what: str = "") -> CaseOutcome:
    """A knock without the secret is as expected when it was never admitted and got no reply
    and no metadata (a send the port refused is a refusal too); one whose case raised tells
    nothing and is not."""
    shut = not knock["admitted"] and not knock["replies"] and not knock["metadata"]
    detail = "; ".join(knock["errors"])[:300] or knock["detail"]
    return CaseOutcome(
        knock["case"],
        [knock_summary(knock)],
        shut and not knock["failed"],
        detail,
        seconds=knock["seconds"],
        admitted_without_key=int(knock["admitted"] or knock["replies"] > 0),
        what=what,
    )


def listener_outcome(knock: dict[str, Any], owner: str) -> CaseOutcome:
    """Bytes of another protocol into a listening port: any answer will do; what is judged is
    whether its instance lives on."""
    return CaseOutcome(
        knock["case"], [knock["detail"] or knock_summary(knock)], True, "; ".join(knock["errors"]),
        what=owner,
    )  # fmt: skip


def intrude(
    target: intruder.Target | None, cases: list[str], listeners: list[tuple[str, int]]
) -> list[dict[str, Any]]:
    """Run ``cases`` against ``target`` and garbage into ``listeners`` from a process without
    the secret."""
    request: dict[str, Any] = {"cases": cases, "listeners": listeners, "target": None}
    if target is not None:
        request["target"] = asdict(target)
    return intruder.run_in_child(request, INTRUDER_TIMEOUT_S)


def positive_control(target: intruder.Target, keys: DeploymentKeys) -> dict[str, Any]:
    """The knock made with the secret: what an open door would have shown."""
    knock = intruder.control(target, keys)
    return {
        "case": knock.case,
        "answer": knock_summary(asdict(knock)),
        "seen": knock.admitted or knock.replies > 0,
        "metadata": knock.metadata,
    }
