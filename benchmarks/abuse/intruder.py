"""The intruder: a process without the deployment's secret that knocks on ZMQ ports and the
NIXL path (``python -m benchmarks.abuse.intruder TARGET_JSON``: one JSON line per case).

Each case says what came back: whether ZMQ's handshake with the port ever succeeded (a socket
monitor's ``EVENT_HANDSHAKE_SUCCEEDED``: the peer was admitted), how many replies arrived, whether
NIXL metadata or buffer descriptors were among them, and, for raw TCP, the security mechanism the
port's greeting advertised (``CURVE`` where it asks for the secret, ``NULL`` where anyone gets in).
The same functions, run in the suite's own process with the secret's keys, are its positive
control: there the port must answer, or the probe proves nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from lmcache_pd import protocol
from lmcache_pd.auth import SECRET_ENV, DeploymentKeys, Door, Role
from lmcache_pd.compat import KVProfile
from lmcache_pd.errors import PDError
from lmcache_pd.first_token import MAX_NOTICE_BYTES, FirstTokenNotice
from lmcache_pd.keys import ChunkKeyer

# How long a probe waits for a reply, or for ZMQ's handshake, after its last send.
REPLY_WAIT_S = 1.0
# How long one send may wait for a connection to queue it on.
SEND_TIMEOUT_MS = 200
# Bytes of ZMTP 3's greeting (signature, version, mechanism, as-server, filler).
ZMTP_GREETING_BYTES = 64
MECHANISM = slice(12, 32)
SIGNATURE_AND_MAJOR = 11
# The connection flood: raw TCP connections, then ZMQ sockets, held open at once.
FLOOD_TCP = 256
FLOOD_ZMQ = 64
FLOOD_HOLD_S = 2.0
# A ZMQ message of many frames (what ZMQ buffers whole before our code sees any).
MANY_FRAMES = 200
FRAME_OF_MANY_BYTES = 64 << 10
# Chunk size and page size an intruder guesses from the shipped configs (configs/*.yaml).
GUESSED_CHUNK_TOKENS = 256
GUESSED_PAGE_BYTES = 1 << 20
MONITORED = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)

Kind = Literal["init", "alloc", "notice"]


@dataclass(frozen=True, slots=True)
class Target:
    """One port to knock on: a consumer's ``init`` or ``alloc`` ROUTER, or the proxy's
    first-token ``notice`` PULL; ``model`` seeds the chunk keys a guesser computes."""

    host: str
    port: int
    kind: Kind
    model: str = ""
    # Tokens of a prompt the deployment serves (its chunk keys are the guessed ones).
    tokens: tuple[int, ...] = ()


@dataclass(slots=True)
class Knock:
    """What one case got back from its port."""

    case: str
    sent: int = 0  # messages (or connections) sent
    admitted: bool = False  # ZMQ's handshake succeeded at least once
    replies: int = 0
    metadata: bool = False  # NIXL agent metadata or buffer descriptors among the replies
    mechanism: str = ""  # what the port's ZMTP greeting asked for (raw TCP cases)
    detail: str = ""
    errors: list[str] = field(default_factory=list)
    failed: bool = False  # the case itself raised: it tells nothing of the port
    seconds: float = 0.0


def guessed_keys(target: Target, chunks: int = 4) -> list[bytes]:
    """Chunk keys anyone can compute from public values: the model as vLLM was given it, one
    rank, float32, the shipped chunk size, and a prompt's token ids."""
    keyer = ChunkKeyer(
        model_name=target.model,
        world_size=1,
        worker_id=0,
        kv_dtype="float32",
        chunk_size=GUESSED_CHUNK_TOKENS,
    )
    tokens = list(target.tokens) or list(range(10, 10 + chunks * GUESSED_CHUNK_TOKENS))
    return [chunk.key for chunk in keyer.chunk_keys(tokens)][:chunks]


def guessed_profile(target: Target) -> KVProfile:
    """A KV profile that names only what the shipped configs give away: fields left out are
    not compared by the consumer, so without the secret's protection this one would pass."""
    return KVProfile(chunk_size=GUESSED_CHUNK_TOKENS, page_bytes=GUESSED_PAGE_BYTES)


def protocol_messages(target: Target) -> list[bytes]:
    """Well-formed messages of the port's own protocol, under guessed keys and random ids."""
    rng = random.Random(target.port)
    version = protocol.PROTOCOL_VERSION
    req_id = f"cmpl-guess-{rng.getrandbits(64):016x}"
    if target.kind == "init":
        messages: list[protocol.Message] = [
            protocol.MetadataRequest(version, guessed_profile(target), "intruder"),
            protocol.BufferRequest(version),
            protocol.ProbeCheck(version, rng.randbytes(protocol.PROBE_NONCE_BYTES)),
        ]
    elif target.kind == "alloc":
        chunks = [protocol.ChunkSpec(key, GUESSED_PAGE_BYTES) for key in guessed_keys(target)]
        messages = [
            protocol.AllocRequest(version, req_id, chunks),
            protocol.ReserveRequest(version, protocol.MAX_RESERVED_PAGES),
            protocol.KVAbandoned.of(req_id, protocol.AbandonReason.CLIENT_GONE, "intruder"),
            protocol.AllocCancel(version, req_id, rng.getrandbits(63)),
        ]
    else:
        notice = FirstTokenNotice(req_id, list(target.tokens[:64]) or [1, 2, 3], 7)
        return [msgspec.msgpack.encode(notice), b"\x93\xa1x\x90\x07"]
    return [protocol.encode(message) for message in messages]


def _socket_type(target: Target) -> int:
    return zmq.PUSH if target.kind == "notice" else zmq.DEALER


# The door (``auth.py``) each kind of target is.
KEY_DOORS = {"init": Door.INIT, "alloc": Door.ALLOC, "notice": Door.NOTICES}


class _Probe:
    """One ZMQ socket to the target, its handshake watched; ``keys`` None: no CURVE at all."""

    def __init__(
        self, context: zmq.Context, target: Target, keys: DeploymentKeys | None, knock: Knock
    ) -> None:
        self.knock = knock
        self.socket = context.socket(_socket_type(target))
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        if keys is not None:
            keys.connect(self.socket, KEY_DOORS[target.kind])
        self.monitor = self.socket.get_monitor_socket(MONITORED)
        self.socket.connect(f"tcp://{target.host}:{target.port}")

    def send(self, frames: list[bytes]) -> None:
        try:
            self.socket.send_multipart(frames)
            self.knock.sent += 1
        except zmq.Again:  # no connection takes it: ZMQ dropped the refused one
            self.knock.errors.append(f"send refused for {SEND_TIMEOUT_MS} ms: not connected")

    def settle(self, wait_s: float) -> None:
        """Read replies and handshake events until ``wait_s`` passes."""
        deadline = time.monotonic() + wait_s
        poller = zmq.Poller()
        poller.register(self.monitor, zmq.POLLIN)
        if self.socket.type == zmq.DEALER:
            poller.register(self.socket, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            for ready, _ in poller.poll(int(left * 1000) + 1):
                if ready is self.monitor:
                    if recv_monitor_message(self.monitor)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                        self.knock.admitted = True
                else:
                    self._reply(self.socket.recv_multipart())

    def _reply(self, frames: list[bytes]) -> None:
        self.knock.replies += 1
        for codec in (protocol.INIT_REPLIES, protocol.ALLOC_REPLIES):
            with contextlib.suppress(PDError):
                reply = codec.decode(frames[-1])
                if isinstance(reply, protocol.AgentMetadata | protocol.BufferDescriptors):
                    self.knock.metadata = True
                self.knock.detail = f"got {type(reply).__name__}"
                return

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)


@contextlib.contextmanager
def _probe(target: Target, keys: DeploymentKeys | None, knock: Knock) -> Iterator[_Probe]:
    context = zmq.Context()
    probe = _Probe(context, target, keys, knock)
    try:
        yield probe
    finally:
        probe.close()
        context.destroy(linger=0)


def _zmq_case(
    target: Target, name: str, frames: list[list[bytes]], keys: DeploymentKeys | None = None
) -> Knock:
    knock = Knock(name)
    with _probe(target, keys, knock) as probe:
        for message in frames:
            probe.send(message)
        probe.settle(REPLY_WAIT_S)
    return knock


def garbage(target: Target) -> Knock:
    """Bytes that are no message at all."""
    return _zmq_case(target, "garbage", [[b"\x00garbage"], [os.urandom(512)]])


def oversized_frame(target: Target) -> Knock:
    """One frame past the port's size limit."""
    limit = MAX_NOTICE_BYTES if target.kind == "notice" else protocol.MAX_FRAME_BYTES
    return _zmq_case(target, "oversized_frame", [[b"\x01" * (limit + 1)]])


def multi_frame(target: Target) -> Knock:
    """One message of many frames, each within the limit."""
    frames = [b"\x02" * FRAME_OF_MANY_BYTES] * MANY_FRAMES
    return _zmq_case(target, "multi_frame", [frames])


def guessed_messages(target: Target) -> Knock:
    """The port's own protocol: allocation under guessed chunk keys, abandon and cancel of
    guessed requests, the handshake, a first-token notice."""
    return _zmq_case(target, "guessed_messages", [[m] for m in protocol_messages(target)])


def wrong_secret(target: Target) -> Knock:
    """CURVE, with the server key of another deployment's secret."""
    keys = DeploymentKeys.from_secret("not-this-deployment-" + "x" * 40, Role.PRODUCER)
    return _zmq_case(target, "wrong_secret", [[m] for m in protocol_messages(target)], keys)


def zmtp_greeting(mechanism: bytes = b"NULL") -> bytes:
    """ZMTP 3.0's greeting of a client asking for ``mechanism``."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\x00") + bytes(32)


def _read_some(sock: socket.socket, wait_s: float) -> bytes:
    sock.settimeout(wait_s)
    data = b""
    with contextlib.suppress(OSError):
        while len(data) < ZMTP_GREETING_BYTES:
            more = sock.recv(ZMTP_GREETING_BYTES - len(data))
            if not more:
                break
            data += more
    return data


def raw_tcp(target: Target) -> Knock:
    """TCP without ZMQ: a NULL greeting (what the port answers names its mechanism), then
    random bytes on a second connection."""
    knock = Knock("raw_tcp")
    with socket.create_connection((target.host, target.port), timeout=5) as sock:
        # The signature and major version first: the port then sends its whole greeting (all
        # at once, a mechanism it refuses could close the connection before that is read).
        greeting = zmtp_greeting()
        sock.sendall(greeting[:SIGNATURE_AND_MAJOR])
        answer = _read_some(sock, REPLY_WAIT_S)
        with contextlib.suppress(OSError):
            sock.sendall(greeting[SIGNATURE_AND_MAJOR:])
            knock.sent += 1
        knock.mechanism = answer[MECHANISM].rstrip(b"\x00").decode("ascii", "replace")
        knock.admitted = knock.mechanism == "NULL"
    with socket.create_connection((target.host, target.port), timeout=5) as sock:
        with contextlib.suppress(OSError):  # the port may close on the first bad byte
            sock.sendall(random.Random(target.port).randbytes(64 << 10))
            knock.sent += 1
        knock.detail = f"{len(_read_some(sock, REPLY_WAIT_S))} bytes back after random bytes"
    return knock


def connection_flood(target: Target) -> Knock:
    """Many raw TCP connections (each sending a greeting) and ZMQ sockets, all open at once."""
    knock = Knock("connection_flood")
    with contextlib.ExitStack() as stack:
        for _ in range(FLOOD_TCP):
            try:
                sock = stack.enter_context(socket.create_connection((target.host, target.port), 5))
                sock.sendall(zmtp_greeting())
                knock.sent += 1
            except OSError as exc:
                knock.errors.append(f"tcp: {exc}")
                break
        context = zmq.Context()
        stack.callback(context.destroy, linger=0)
        probes = [_Probe(context, target, None, knock) for _ in range(FLOOD_ZMQ)]
        for probe in probes:
            stack.callback(probe.close)
            probe.send(protocol_messages(target)[:1])
        time.sleep(FLOOD_HOLD_S)
        for probe in probes:
            probe.settle(0.01)
    knock.detail = f"{FLOOD_TCP} TCP connections and {FLOOD_ZMQ} ZMQ sockets held {FLOOD_HOLD_S} s"
    return knock


def nixl_handshake(target: Target, keys: DeploymentKeys | None = None) -> Knock:
    """The producer's handshake (MetadataRequest, then BufferRequest) as an intruder makes it,
    with a profile that the consumer would accept: does NIXL metadata come back?"""
    knock = Knock("nixl_handshake" if keys is None else "nixl_handshake_with_secret")
    with _probe(target, keys, knock) as probe:
        for message in protocol_messages(target)[:2]:
            probe.send([message])
            probe.settle(REPLY_WAIT_S)
    return knock


def control(target: Target, keys: DeploymentKeys) -> Knock:
    """The positive control, with a producer's share of the secret: the handshake on an init
    port (metadata must come back), a cancel of an unknown allocation on an alloc port (a
    CancelAck), a notice for no request on a notice port (ZMQ's handshake must succeed)."""
    if target.kind == "init":
        return nixl_handshake(target, keys)
    messages = protocol_messages(target)
    message = messages[-1] if target.kind == "alloc" else messages[0]
    return _zmq_case(target, "with_secret", [[message]], keys)


def listener_garbage(host: str, port: int) -> Knock:
    """A listening port of another protocol (UCX's TCP transport, vLLM's internals): random
    bytes, then a connection held open while nothing is sent."""
    knock = Knock(f"listener:{port}")
    try:
        with socket.create_connection((host, port), timeout=5) as sock:
            with contextlib.suppress(OSError):
                sock.sendall(random.Random(port).randbytes(4096))
                knock.sent += 1
            knock.detail = f"{len(_read_some(sock, 0.2))} bytes back"
        with socket.create_connection((host, port), timeout=5):
            time.sleep(0.2)
            knock.sent += 1
    except OSError as exc:
        knock.errors.append(repr(exc))
    return knock


ZMQ_CASES: dict[str, Callable[[Target], Knock]] = {
    "garbage": garbage,
    "oversized_frame": oversized_frame,
    "multi_frame": multi_frame,
    "guessed_messages": guessed_messages,
    "wrong_secret": wrong_secret,
    "raw_tcp": raw_tcp,
    "connection_flood": connection_flood,
    "nixl_handshake": nixl_handshake,
}


def knock(target: Target, case: str) -> Knock:
    """Run one case; an exception of the case itself is its detail, not the intruder's end."""
    started = time.monotonic()
    try:
        found = ZMQ_CASES[case](target)
    except Exception as exc:  # one case's failure is its answer, not the intruder's end
        found = Knock(case, errors=[repr(exc)], failed=True)
    found.seconds = round(time.monotonic() - started, 2)
    return found


def run_in_child(request: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """Run ``request`` (``{"target": {...}, "cases": [...], "listeners": [[host, port]]}``) in a
    child Python whose environment holds no secret and no key; its knocks, as dicts."""
    import subprocess

    env = {
        name: value
        for name, value in os.environ.items()
        if name != SECRET_ENV and not name.startswith("LMCACHE_PD_PROXY_")
    }
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.abuse.intruder", json.dumps(request)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    knocks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0:
        knocks.append(asdict(Knock("intruder", errors=[done.stderr[-2000:]], failed=True)))
    return knocks


def main(argv: list[str]) -> int:
    request = json.loads(argv[1])
    if os.environ.get(SECRET_ENV):
        raise SystemExit(f"the intruder must not hold the secret ({SECRET_ENV} is set)")
    if request.get("target"):
        raw = request["target"]
        target = Target(raw["host"], raw["port"], raw["kind"], raw["model"], tuple(raw["tokens"]))
        for case in request["cases"]:
            print(json.dumps(asdict(knock(target, case))), flush=True)
    for host, port in request.get("listeners", []):
        print(json.dumps(asdict(listener_garbage(host, port))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
