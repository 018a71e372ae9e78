"""The fleet benchmark's events on the Ray engine (``--engine ray``): what Ray's deployment must
live through under the same load, each struck at a decode that streams.

  sigkill_decode_actor  a decode instance's actor process and its vLLM's process group SIGKILLed
                        together once a stream is mid-answer on it (its node or container lost):
                        Ray starts the actor again, on new ports, and the proxy takes it back
  scale_decode_1        ``lmcache-pd scale decode 1`` from two while the leaving one (the newest)
                        streams: it drains (no new requests, its running ones finish, at most
                        ``drain_timeout_s``) and stops

As on one host (``events.py``), an event returns once the deployment is whole again: the killed
instance serves from a new process and the proxy lists it up; the scaled pool is one instance,
the other stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

from benchmarks.chaos.pools import alive_groups
from benchmarks.fleet.events import POLL_S, Event, Phase, control
from benchmarks.fleet.ray_serve import RayServe

# Drain (its streams: seconds here, at most drain_timeout_s) and stop.
SCALE_TIMEOUT_S = 300.0
SCALE_OUTPUT_LINES = 12


def _ray(phase: Phase) -> RayServe:
    assert isinstance(phase.serve, RayServe), "a Ray event needs --engine ray"
    return phase.serve


def sigkill_decode_actor(phase: Phase) -> None:
    """The actor of a decode that streams, and its vLLM, SIGKILLed at once; back when Ray's new
    actor serves and the proxy lists it up."""
    serve = _ray(phase)
    name = phase.wait_for_victims(with_tokens=True, role="decode")
    assert name is not None
    server = serve.instance_pid(name)
    assert server is not None, f"{name} has no vLLM server now"
    actor = serve.actor_pid(server)
    phase.strike()
    os.kill(actor, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):  # its parent-death signal may be first
        os.killpg(server, signal.SIGKILL)
    phase.notes |= {"instance": name, "signal": "SIGKILL", "actor_pid": actor, "pid": server}
    phase.wait_back(name, server)
    phase.notes["old_server_left"] = alive_groups([server])


def scale_decode_1(phase: Phase) -> None:
    """``lmcache-pd scale decode 1`` while the decode it removes (the newest) streams; back
    when the command returns. Noted: when the proxy stopped routing to it, the command's
    seconds and output, and whether its vLLM outlived it."""
    serve = _ray(phase)
    decode = [name for name in serve.refresh() if name.startswith("decode-")]
    assert len(decode) == 2, f"scale_decode_1 wants two decode instances, not {decode}"
    leaving = decode[-1]  # the controller removes the newest first
    phase.wait_for_victims(with_tokens=True, role="decode", among=[leaving])
    server = serve.instance_pid(leaving)
    url = serve.servers[leaving].url
    running = serve.running(leaving)
    phase.strike()
    assert phase.injected is not None
    phase.notes |= {"instance": leaving, "pid": server, "running_at_scale": running}
    with ThreadPoolExecutor(1) as executor:
        done = executor.submit(serve.scale, "decode", 1, SCALE_TIMEOUT_S)
        while not done.done():
            if "routing_stopped_s" not in phase.notes and url not in serve.up():
                phase.notes["routing_stopped_s"] = round(phase.stream.now() - phase.injected, 1)
            time.sleep(POLL_S)
        result = done.result()
    phase.back = phase.stream.now()
    phase.notes["scale_s"] = round(phase.back - phase.injected, 1)
    phase.notes["scale_exit"] = result.returncode
    phase.notes["scale_output"] = (result.stdout + result.stderr).splitlines()[-SCALE_OUTPUT_LINES:]
    described = serve.refresh()
    phase.notes["decode_after"] = sorted(n for n in described if n.startswith("decode-"))
    phase.notes["old_server_left"] = alive_groups([server]) if server is not None else []


RAY_EVENTS: dict[str, Event] = {
    "control": control,
    "sigkill_decode_actor": sigkill_decode_actor,
    "scale_decode_1": scale_decode_1,
}
