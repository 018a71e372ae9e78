"""The fleet benchmark's events: what each does to a serving deployment, when (which requests it
catches), and how long until what it took down serves again.

Each event runs on its own thread of the benchmark while the load streams through the proxy,
and returns once the deployment is whole again (every instance it touched answers its /health
with 200 from a new process, and the proxy lists it up), or ``BACK_TIMEOUT_S`` passed.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from benchmarks.chaos.load import Stream
from benchmarks.fleet.serve import Serve

VICTIM_WAIT_S = 20.0  # how long an event waits for the requests it should catch
MID_STREAM_CHUNKS = 4  # a stream "mid-answer" has had this many chunks with tokens
# The supervisor starts a dead instance again after 1 s, and a start on two busy cores takes
# ~20-60 s; a drain adds the running requests' time.
BACK_TIMEOUT_S = 300.0
# Per instance rolled: drain (its running requests, here seconds), start, warm-up.
ROLL_TIMEOUT_PER_INSTANCE_S = 300.0
POLL_S = 0.25


@dataclass
class Phase:
    """What an event works with, and what it found: when it struck and when the deployment
    was whole again (stream seconds), and notes."""

    serve: Serve
    stream: Stream
    injected: float | None = None
    back: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def strike(self) -> None:
        self.injected = self.stream.now()
        self.notes["injected_at_s"] = round(self.injected, 2)
        flying = [r for r in self.stream.in_flight() if r.role == "stream"]
        self.notes["in_flight_at_event"] = len(flying)
        self.notes["in_flight_with_tokens"] = sum(r.first_token is not None for r in flying)

    def wait_for_victims(
        self, with_tokens: bool, role: str | None = None, among: Sequence[str] = ()
    ) -> str | None:
        """Until a request is in flight mid-answer (``with_tokens``: ``MID_STREAM_CHUNKS``
        chunks in) or still waiting for its first token, and, with ``role``, an instance of
        that role (of ``among``, if named) runs a request (vLLM's gauge): the first such
        instance, the one to strike. After ``VICTIM_WAIT_S``: the first of ``among``, else
        ``ROLE-0`` (or None), noted."""
        deadline = time.monotonic() + VICTIM_WAIT_S
        while time.monotonic() < deadline:
            if any(
                len(r.gaps) + 1 >= MID_STREAM_CHUNKS if with_tokens else r.first_token is None
                for r in self.stream.in_flight()
                if r.role == "stream"
            ):
                if role is None:
                    return None
                for name in among or list(self.serve.servers):
                    if name.startswith(f"{role}-") and self.serve.running(name) > 0:
                        return name
            time.sleep(0.02)
        self.notes["victim"] = "none found in time: struck anyway"
        return None if role is None else (among[0] if among else f"{role}-0")

    def wait_back(self, name: str, old_pid: int) -> None:
        """Until ``name`` serves again from a new process: its own /health 200 (``serves_again_s``
        from the event), then the proxy listing it up (``proxy_up_again_s``)."""
        assert self.injected is not None
        deadline = time.monotonic() + BACK_TIMEOUT_S
        own = None
        while time.monotonic() < deadline:
            pid = self.serve.instance_pid(name)  # on Ray, the instance's URL changes with it
            if own is None and pid not in (None, old_pid) and self.serve.healthy(name):
                own = self.stream.now() - self.injected
                self.notes["serves_again_s"] = round(own, 1)
            if own is not None and self.serve.servers[name].url in self.serve.up():
                self.back = self.stream.now()
                self.notes["proxy_up_again_s"] = round(self.back - self.injected, 1)
                return
            time.sleep(POLL_S)
        self.notes["back"] = f"{name} not serving again within {BACK_TIMEOUT_S:.0f} s"
        self.back = self.stream.now()


def _signal(phase: Phase, role: str, signum: signal.Signals, *, group: bool, mid: bool) -> None:
    """``signum`` to the instance of ``role`` that runs a request once the load has one
    mid-answer (``mid``) or waiting for its first token; then wait until it serves again."""
    name = phase.wait_for_victims(with_tokens=mid, role=role)
    assert name is not None
    phase.strike()
    pid = phase.serve.signal(name, signum, group=group)
    phase.notes |= {"instance": name, "signal": signum.name, "pid": pid}
    phase.wait_back(name, pid)


def control(phase: Phase) -> None:
    """No event: the same load, to compare against."""
    phase.back = phase.stream.now()


def sigkill_decode_mid_stream(phase: Phase) -> None:
    """A node lost under answers: the whole group of a decode that runs requests killed once a
    stream is mid-answer."""
    _signal(phase, "decode", signal.SIGKILL, group=True, mid=True)


def sigkill_decode_before_first_token(phase: Phase) -> None:
    """A decode that runs requests killed while another request waits for its first token (at
    prefill, or just handed to decode)."""
    _signal(phase, "decode", signal.SIGKILL, group=True, mid=False)


def sigkill_prefill_mid_push(phase: Phase) -> None:
    """A prefill killed while it runs a request (computing it, pushing its KV)."""
    _signal(phase, "prefill", signal.SIGKILL, group=True, mid=False)


def sigterm_decode(phase: Phase) -> None:
    """The API server of a decode that streams told to stop: it drains, exits, and serve's
    supervisor starts it again."""
    _signal(phase, "decode", signal.SIGTERM, group=False, mid=True)


def sigterm_prefill(phase: Phase) -> None:
    """The API server of a prefill that runs a request told to stop: it drains too."""
    _signal(phase, "prefill", signal.SIGTERM, group=False, mid=False)


def rolling_restart(phase: Phase) -> None:
    """``lmcache-pd restart`` (every instance, one at a time: drain, restart, healthy, next)."""
    phase.wait_for_victims(with_tokens=True)
    phase.strike()
    assert phase.injected is not None
    timeout_s = ROLL_TIMEOUT_PER_INSTANCE_S * len(phase.serve.servers)
    try:
        lines = phase.serve.restart_all(timeout_s)
    except RuntimeError as exc:
        phase.notes["roll_error"] = str(exc)[:2000]
        lines = []
    now, seconds = time.monotonic(), phase.stream.now()
    phase.notes["roll_lines"] = [
        f"+{seconds - (now - at) - phase.injected:.1f} s {text}" for at, text in lines
    ]
    phase.notes["roll_s"] = round(seconds - phase.injected, 1)
    deadline = time.monotonic() + BACK_TIMEOUT_S
    while not phase.serve.all_up() and time.monotonic() < deadline:
        time.sleep(POLL_S)
    phase.back = phase.stream.now()
    phase.notes["proxy_up_again_s"] = round(phase.back - phase.injected, 1)


Event = Callable[[Phase], None]
EVENTS: dict[str, Event] = {
    "control": control,
    "sigkill_decode_mid_stream": sigkill_decode_mid_stream,
    "sigkill_prefill_mid_push": sigkill_prefill_mid_push,
    "sigterm_decode": sigterm_decode,
    "sigterm_prefill": sigterm_prefill,
    "sigkill_decode_before_first_token": sigkill_decode_before_first_token,
    "rolling_restart": rolling_restart,
}
# The suite's short form: a kill under streams (migration, the supervisor's restart). A drain
# under streams is the suite's too, cheaper, in tests/test_drain_vllm.py.
SHORT_EVENTS = "sigkill_decode_mid_stream"
