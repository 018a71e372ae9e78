"""The faults: what each injects into running pools, when it ends, and the deadline that should
bound the requests it does not cut."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from concurrent.futures import wait
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import zmq

from benchmarks.chaos.counters import CounterTrack
from benchmarks.chaos.judge import Prompt, random_tokens
from benchmarks.chaos.load import RequestRecord, Stream
from benchmarks.chaos.pools import restart, wait_until_proxy_sees_all
from lmcache_pd import protocol
from lmcache_pd.config import PDConfig
from lmcache_pd.deploy.launcher import PoolLauncher
from lmcache_pd.proxy.config import ProxyConfig

SHORT_FAULTS = "sigkill_decode,client_disconnect,malformed_spec"  # the --short run's
STOP_S = 10.0
DOWN_S = 2.0  # a killed instance stays dead this long before its restart begins
VICTIM_WAIT_S = 10.0
PREEMPT_BLOCKS = 40  # 5120 tokens: above one 4096-token request, below the burst's needs


class ReceiveBuffer:
    """Talks to one consumer rank's init and alloc ports as a producer would."""

    TIMEOUT_MS = 5000

    def __init__(self, host: str, init_port: int, alloc_port: int) -> None:
        self._context = zmq.Context()
        self._init = self._dealer(f"tcp://{host}:{init_port}")
        self._alloc = self._dealer(f"tcp://{host}:{alloc_port}")
        layout = self._ask(self._init, protocol.BufferRequest(version=protocol.PROTOCOL_VERSION))
        if not isinstance(layout, protocol.BufferDescriptors):
            raise RuntimeError(f"the consumer answered BufferRequest with {layout}")
        self.num_pages, self.page_bytes = layout.num_pages, layout.page_bytes

    def _dealer(self, address: str) -> zmq.Socket:
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(address)
        return socket

    def _ask(self, socket: zmq.Socket, message: protocol.Message) -> object:
        socket.send(protocol.encode(message))
        if not socket.poll(self.TIMEOUT_MS):
            raise TimeoutError(f"no answer to {type(message).__name__}")
        codec = protocol.INIT_REPLIES if socket is self._init else protocol.ALLOC_REPLIES
        return codec.decode(socket.recv())

    def allocate(self, req_id: str, pages: int) -> protocol.AllocResponse | protocol.ErrorReply:
        chunks = [protocol.ChunkSpec(os.urandom(32), self.page_bytes) for _ in range(pages)]
        request = protocol.AllocRequest(
            version=protocol.PROTOCOL_VERSION, req_id=req_id, chunks=chunks
        )
        reply = self._ask(self._alloc, request)
        assert isinstance(reply, protocol.AllocResponse | protocol.ErrorReply)
        return reply

    def fill(self) -> int:
        """Take every free page, in ever smaller requests, and never write them; returns how
        many were taken."""
        taken, ask = 0, self.num_pages
        while ask >= 1:
            if isinstance(self.allocate(f"chaos-fill-{taken}", ask), protocol.AllocResponse):
                taken += ask
            else:
                ask //= 2
        return taken

    def close(self) -> None:
        self._context.destroy(linger=0)


@dataclass
class Phase:
    """What a fault works with, and what it reports: when it began, when recovery is measured
    from (``mark``), which requests it cut, and notes."""

    launcher: PoolLauncher
    proxy: ProxyConfig
    stream: Stream
    counters: CounterTrack
    decode_config: PDConfig
    producer_config: PDConfig
    fault_prompts: list[Prompt]
    groups: list[int]
    injected: float = 0.0
    mark: float = 0.0
    cut_until: float = 0.0
    cuts_in_flight: bool = False
    notes: dict[str, Any] = field(default_factory=dict)
    cleanup: list[Callable[[], None]] = field(default_factory=list)

    def begin(self, cuts_in_flight: bool = False) -> None:
        self.injected, self.cuts_in_flight = self.stream.now(), cuts_in_flight
        self.notes["injected_at_s"] = round(self.injected, 2)

    def end(self) -> None:
        """The fault is over (the instance is healthy again, or resumed): recovery is measured
        from here. Requests sent until the proxy sees every instance up again are cut too."""
        self.mark = self.stream.now()
        self.notes["fault_ended_at_s"] = round(self.mark, 2)
        wait_until_proxy_sees_all(self.proxy)
        self.cut_until = self.stream.now()
        self.notes["proxy_saw_all_up_at_s"] = round(self.cut_until, 2)

    def wait_for_victim(self, at_decode: bool) -> None:
        """Until a streamed request is in flight at decode (its first token seen) or at prefill
        (not yet), so that the fault cuts one; at most ``VICTIM_WAIT_S``."""
        deadline = time.monotonic() + VICTIM_WAIT_S
        while time.monotonic() < deadline:
            flying = [r for r in self.stream.in_flight() if r.stream and r.role == "stream"]
            if any((r.first_token is not None) == at_decode for r in flying):
                return
            time.sleep(0.02)


def _sigkill(phase: Phase, name: str) -> None:
    phase.wait_for_victim(at_decode=name.startswith("decode"))
    phase.counters.snapshot()  # the victim's last counters
    phase.begin(cuts_in_flight=True)
    phase.launcher.signal(name, signal.SIGKILL)
    time.sleep(DOWN_S)
    phase.notes["restart_s"] = restart(phase.launcher, name, phase.groups)
    phase.counters.restarted(name)
    phase.end()


def sigkill_decode(phase: Phase) -> None:
    _sigkill(phase, "decode-0")


def sigkill_prefill(phase: Phase) -> None:
    _sigkill(phase, "prefill-0")


def sigstop_decode(phase: Phase) -> None:
    phase.wait_for_victim(at_decode=True)
    phase.begin(cuts_in_flight=True)
    phase.launcher.signal("decode-0", signal.SIGSTOP)
    try:
        time.sleep(STOP_S)
    finally:
        phase.launcher.signal("decode-0", signal.SIGCONT)
    phase.end()


def _receive_buffer(phase: Phase) -> ReceiveBuffer:
    decode = phase.proxy.decode[0]
    return ReceiveBuffer(decode.receiver_host, decode.init_port, decode.alloc_port)


def buffer_full(phase: Phase) -> None:
    """Pages taken and never written; the fault ends when the consumer's lease gives them
    back."""
    rogue = _receive_buffer(phase)
    phase.cleanup.append(rogue.close)
    phase.begin()
    phase.notes |= {"pages_taken": rogue.fill(), "num_pages": rogue.num_pages}
    lease_ends = phase.injected + phase.decode_config.alloc_lease_s + 1
    time.sleep(max(0.0, lease_ends - phase.stream.now()))
    phase.end()


def preemption(phase: Phase) -> None:
    phase.begin()
    futures = [phase.stream.submit(prompt) for prompt in phase.fault_prompts]
    wait(futures)
    phase.end()


def client_disconnect(phase: Phase) -> None:
    phase.begin()
    futures = []
    for prompt in phase.fault_prompts:
        futures.append(phase.stream.submit(prompt, disconnect=True))
        time.sleep(0.3)
    wait(futures)
    phase.notes["disconnects"] = [f.result().outcome for f in futures]
    phase.end()


def malformed_specs(host: str, init_port: int, alloc_port: int) -> dict[str, Any]:
    good = {
        "req_id": "chaos-malformed",
        "receiver_host": host,
        "receiver_init_port": init_port,
        "receiver_alloc_port": alloc_port,
    }
    return {
        "host_not_a_hostname": good | {"receiver_host": "not a host!"},
        "host_empty": good | {"receiver_host": ""},
        "init_port_out_of_range": good | {"receiver_init_port": 70000},
        "alloc_port_zero": good | {"receiver_alloc_port": 0},
        "port_a_string": good | {"receiver_init_port": "55555"},
        "req_id_missing": {key: value for key, value in good.items() if key != "req_id"},
        "req_id_10k_chars": good | {"req_id": "x" * 10_000},
        "unknown_field": good | {"colour": "blue"},
        "not_an_object": "receiver=127.0.0.1",
    }


def malformed_spec(phase: Phase) -> None:
    """Each malformed spec straight to prefill: it must answer (an error or a plain answer)."""
    decode, prefill = phase.proxy.decode[0], phase.proxy.prefill[0].url
    phase.begin()
    answers = {}
    rng = random.Random(3000)
    specs = malformed_specs(decode.receiver_host, decode.init_port, decode.alloc_port)
    for name, spec in specs.items():
        record = RequestRecord(f"malformed:{name}", "fault", False, 300, 1, phase.stream.now())
        body = {"model": phase.proxy.model, "prompt": random_tokens(rng, 300), "max_tokens": 1}
        body["kv_transfer_params"] = {"ret_first_tok": True, "disagg_spec": spec}
        try:
            response = httpx.post(
                f"{prefill}/v1/completions",
                json=body,
                headers=phase.proxy.instance_headers(),  # the instance's own key: past its door
                timeout=60.0,
            )
            record.outcome, record.detail = "answered", f"HTTP {response.status_code}"
        except httpx.HTTPError as exc:
            record.outcome, record.detail = "error", f"no answer: {exc!r}"[:200]
        record.ended = phase.stream.now()
        answers[name] = f"{record.detail} in {record.latency:.2f} s"
        phase.stream.add(record)
    phase.notes["answers"] = answers
    phase.end()


@dataclass(frozen=True, slots=True)
class Fault:
    inject: Callable[[Phase], None]
    deadline: Callable[[ProxyConfig, PDConfig, PDConfig], tuple[float, str]]
    expected_s: float  # how long the fault lasts, to size the phase's prompts


def _connect(proxy: ProxyConfig, *_: PDConfig) -> tuple[float, str]:
    return proxy.timeouts.connect_s, "proxy connect_s"


FAULTS: dict[str, Fault] = {
    "sigkill_decode": Fault(sigkill_decode, _connect, 60),
    "sigkill_prefill": Fault(sigkill_prefill, _connect, 60),
    "sigstop_decode": Fault(
        sigstop_decode,
        lambda proxy, *_: (STOP_S + proxy.timeouts.connect_s, f"stop {STOP_S:.0f} s + connect_s"),
        STOP_S + 20,
    ),
    "buffer_full": Fault(
        buffer_full,
        lambda _, producer, __: (producer.alloc_timeout_s, "producer alloc_timeout_s"),
        70,
    ),
    "client_disconnect": Fault(client_disconnect, _connect, 5),
    "malformed_spec": Fault(malformed_spec, _connect, 5),
    "preemption": Fault(
        preemption,
        lambda _, __, consumer: (consumer.load_timeout_s, "consumer load_timeout_s"),
        40,
    ),
}


def preempting_spec(launcher: PoolLauncher) -> Any:
    spec = launcher.pools.decode[0]
    args = [*spec.vllm_args, "--num-gpu-blocks-override", str(PREEMPT_BLOCKS)]
    return msgspec.structs.replace(spec, vllm_args=args)
