"""The wire protocol: every message on our sockets and in NIXL notifications, and every limit.

Each message is a frozen, tagged msgspec ``Struct`` encoded as msgpack. Decoding is two-step: the
envelope (``type`` and ``version``) is read and checked first, so a peer of another version gets a
clear ``VersionMismatch`` instead of a confusing field error; only then is the body decoded against
the one union of messages that the socket accepts. Sizes are bounded before anything is allocated.
No pickle anywhere.

Protocol history:
  1: init port (AgentMetadata, BufferDescriptors), alloc port (AllocRequest/AllocResponse,
     AllocCancel/CancelAck), WriteDone notification with optional xxh3-64 checksums.
  2: BufferDescriptors states the consumer's ``alloc_lease_s`` (the producer derives its write
     deadline from it); KVAbandoned/AbandonAck on the alloc port (a producer or the proxy says a
     request's KV will not come or is not wanted); ErrorCode.DROPPED for an AllocRequest of a
     request the consumer already let go.
  3: the handshake checks compatibility and proves the transport. MetadataRequest and
     AgentMetadata carry each side's KV profile (``compat.KVProfile``: model, dtype, layout,
     block size, chunk size, page bytes, TP size and rank) and network-stack identity; the
     consumer refuses a mismatch with ErrorCode.INCOMPATIBLE naming the field and both values.
     BufferDescriptors hands out a self-test slot; ProbeDone notification, ProbeCheck/ProbeResult
     on the init port; AbandonReason.INCOMPATIBLE.
  4: ``KVProfile.kv_layout`` (the engine's cache shape) becomes ``chunk_format`` (what a chunk's
     bytes are: whole blocks, or tokens-major KV_2LTD), and ``block_size`` is left out for
     token chunks: a GPU producer and consumer whose caches differ in layout or block size
     are compatible; a block-format and a token-format peer are refused.
  5: pages reserved ahead. ReserveRequest/Reservation on the alloc port give a producer pages
     tied to no chunk yet, under the same lease as an allocation; a push small enough writes
     into them at once, without an AllocRequest, and says in its ReservedWriteDone
     notification which chunk went where.
  6: a deployment secret puts CURVE on every ZMQ socket and a MAC on every NIXL notification
     (``lmcache_pd/auth.py``).
  7: prefill and decode at different TP sizes: a KV profile carries the model's KV heads, and a
     part of a chunk travels under keys of its own heads (``lmcache_pd/tp_parts.py``).
  8: each role holds its own share of the secret and its own CURVE client keypair, checked by a
     ZAP allow-list per door (``lmcache_pd/gatekeeper.py``): a 7 peer's keys are refused at the
     handshake (upgrade every process of a deployment together). Chunk keys carry a request's
     LoRA adapter (its name, path and a digest of its files, ``connector/adapter_identity.py``),
     its images (vLLM's multimodal identifiers at their positions) and its LMCache tags, so a
     7 peer keys such requests otherwise (no load, recompute). Without a secret, a mixed pair
     is refused here as ``VersionMismatch``.
  (no version change) DisaggSpec, which travels in HTTP bodies and on no socket of ours, may
     give its ports as lists indexed by rank (tensor parallelism); single integers still mean
     a consumer of one rank.
  (no version change) ``KVTransferParams`` and ``KVTransferReturn`` type the keys of vLLM's
     ``kv_transfer_params`` that the proxy and the connector always sent as plain JSON objects;
     the JSON is unchanged.
  (no version change) ``KVTransferParams.first_tok``: decode is sent the client's own request
     (its prompt, not the prompt plus prefill's first token) and must make ``first_tok`` its
     first output token; the KV it loads is then the whole prompt's but for its last token.
  (no version change) ``KVTransferParams.next_toks``: the output tokens after ``first_tok``,
     forced too: a stream that broke on one decode goes on on another (``proxy/migration.py``).
  (no version change) ``KVTransferParams.tags`` and ``skip_save``: LMCache's request options,
     under LMCache's own keys (``lmcache.tag.<name>``, ``lmcache.skip_save``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Annotated, Any, Generic, TypeVar

import msgspec

from lmcache_pd.compat import KVProfile
from lmcache_pd.errors import ProtocolError, VersionMismatch

PROTOCOL_VERSION = 8

# Limits, checked before anything is allocated for a message.
MAX_FRAME_BYTES = 1 << 20
MAX_CHUNKS_PER_REQUEST = 4096
MAX_KEY_BYTES = 64
MAX_REQ_ID_CHARS = 256
MAX_AGENT_METADATA_BYTES = 1 << 16
MAX_ERROR_DETAIL_CHARS = 1024
MAX_PAGE_BYTES = 1 << 31
MAX_STACK_ID_CHARS = 256
# Token ids past any vocabulary (vLLM's own are int32).
MAX_TOKEN_ID = 1 << 31
# Output tokens one request may have forced (``KVTransferParams.next_toks``): a continued
# stream's tokens so far; more than any model's context holds.
MAX_FORCED_TOKENS = 1 << 20
MAX_RESERVED_PAGES = 64  # pages one Reservation may hand out
MAX_TP_RANKS = 64  # ranks of one tensor-parallel instance a DisaggSpec or config may name
# LMCache's request options in ``kv_transfer_params`` (``KVTransferParams.tags``): tags a request
# may carry, and characters of a tag's name or value (a tenant's or namespace's name).
MAX_TAGS = 16
MAX_TAG_CHARS = 256
# A consumer's state per peer and per request, each bounded whatever its peers send: requests
# it let go and remembers (the oldest are forgotten early beyond this), requests holding pages
# (an allocation for one more is refused as buffer_full), entries of its landed board (the rest
# read as "not landed": their loads are asynchronous).
MAX_DROPPED_REQUESTS = 65536
MAX_HELD_REQUESTS = 16384
MAX_BOARD_ENTRIES = 1024
# Whole messages ZMQ queues per connection on a consumer's port before it stops reading from
# that peer (a well-behaved peer has at most two requests out). A message is queued only whole,
# every frame at most MAX_FRAME_BYTES; ZMQ has no limit on frames per message.
MAX_QUEUED_MESSAGES = 16
# The transport self-test: a write of PROBE_NONCE_BYTES into one of PROBE_SLOTS slots that the
# consumer keeps past its pages (handed out in turn, so concurrent self-tests never share one).
PROBE_NONCE_BYTES = 16
PROBE_SLOTS = 64
PROBE_AREA_BYTES = PROBE_SLOTS * PROBE_NONCE_BYTES

# Default deadlines. The lease must outlive the producer's transfer deadline, so that a page is
# never handed to a new request while a slow write into it may still be in flight.
HANDSHAKE_TIMEOUT_S = 5.0
# A GPU worker's copy of a chunk between the KV cache and the staging buffer, on the
# connector's own CUDA stream: the sender waits this long for it before giving the push up.
DEVICE_COPY_TIMEOUT_S = 10.0
# A child process of ours asked to stop (the consumer's service process, a test's consumer or
# producer) gets this long to exit before it is killed, and as long again after.
PROCESS_EXIT_TIMEOUT_S = 10.0
# A self-test's write and notification take well under a millisecond when the transport works;
# one that misses this deadline never arrives (measured: "PROC" for minutes).
PROBE_TIMEOUT_S = 1.0
# How long a consumer remembers a self-test slot it handed out.
PROBE_TICKET_TTL_S = 30.0
ALLOC_TIMEOUT_S = 5.0
# Short: a cancel is sent after a failure, often to a peer that is gone.
CANCEL_TIMEOUT_S = 0.5
TRANSFER_TIMEOUT_S = 20.0
ALLOC_LEASE_S = 60.0
HOLD_TIMEOUT_S = 300.0
# Pages pushed for a request that no decode has claimed (its client left, or decode computed the
# prompt itself) go back after this.
CLAIM_TIMEOUT_S = 30.0
# How long a consumer remembers a request it let go, to refuse its late pushes.
DROPPED_MEMORY_S = 600.0
# After a producer was refused an allocation for room, every other producer is held to
# ``max_producer_share`` of the consumer's buffer (by default this one) for this long.
SHARE_ENFORCED_S = 5.0
MAX_PRODUCER_SHARE = 0.5
# The producer's write must end this long (or a quarter of the lease, if less) before the
# consumer's lease does, so that a page is never taken back while the write into it may land.
LEASE_MARGIN_S = 1.0


def write_budget_s(alloc_lease_s: float) -> float:
    """How long after asking for pages a producer may still be writing into them."""
    return alloc_lease_s - min(LEASE_MARGIN_S, alloc_lease_s / 4)


# Pages reserved ahead are written into only this soon after the producer asked for them:
# sooner than any consumer restarts (a restarted one has other pages, and only an AllocResponse
# would say so). The consumer polls for their notifications as for pending writes meanwhile.
RESERVED_FRESH_S = 1.0
# A write into reserved pages ends this soon after they were asked for (at the producer's own
# deadline), and the consumer takes reserved pages nobody wrote back this long after it handed
# them out (sooner than an allocation's lease: a producer that stops pushing holds little). An
# AllocCancel naming a reservation gives its unwritten pages back at once.
RESERVED_WRITE_S = 5.0
RESERVED_LEASE_S = RESERVED_WRITE_S + LEASE_MARGIN_S

# How long a consumer waits for a request's KV before it recomputes the prompt instead.
LOAD_TIMEOUT_S = 30.0
# A LoRA adapter's files are read for its identity in chunk keys (``adapter_identity.py``) up
# to this many bytes (rank-64 adapters of 70B models are ~1.6 GiB) within this deadline; an
# adapter past either is served without disaggregation. Its requests wait for the read.
ADAPTER_DIGEST_MAX_BYTES = 16 << 30
ADAPTER_DIGEST_TIMEOUT_S = 60.0
# Adapter paths whose digests one process remembers (the oldest read go first).
MAX_ADAPTER_PATHS = 1024
BUFFER_FULL_RETRY_AFTER_S = 0.05
MAX_ALLOC_RETRIES = 3

ReqId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_REQ_ID_CHARS)]
ChunkKeyBytes = Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_KEY_BYTES)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
# One port per rank of a tensor-parallel instance, indexed by rank.
RankPorts = Annotated[list[Port], msgspec.Meta(min_length=1, max_length=MAX_TP_RANKS)]
Checksum = Annotated[int, msgspec.Meta(ge=0)]  # uint64: msgpack holds no more
PageIndex = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
AllocId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
# A DNS name or an IPv4 address, as ZMQ's tcp:// endpoints take them; anything else (spaces, a
# scheme, a port) would only fail later, inside a socket call on a background thread.
HostName = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=253,
        pattern=r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
        r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$",
    ),
]


class ErrorCode(enum.Enum):
    """Why a request was refused; the producer maps each to an exception in ``errors``."""

    MALFORMED = "malformed"
    VERSION = "version"
    BUFFER_FULL = "buffer_full"
    TOO_LARGE = "too_large"
    BAD_REQUEST = "bad_request"
    INTERNAL = "internal"
    DROPPED = "dropped"  # the request was let go on the consumer: its KV is not wanted any more
    INCOMPATIBLE = "incompatible"  # the two sides' KV profiles differ (the detail names how)


class AbandonReason(enum.Enum):
    """Why a request's KV will not come, or is not wanted (``KVAbandoned``)."""

    STAGING_FULL = "staging_full"  # the producer had no room to copy the KV out
    CONSUMER_REFUSED = "consumer_refused"  # the consumer refused the allocation
    TRANSFER_FAILED = "transfer_failed"  # the NIXL write failed or missed its deadline
    REQUEST_ABORTED = "request_aborted"  # prefill ended before its prompt was computed
    PRODUCER_ERROR = "producer_error"  # a bug or an unexpected error on the producer
    CLIENT_GONE = "client_gone"  # the proxy's client left before decode was asked
    INCOMPATIBLE = "incompatible"  # the handshake found the two sides' KV formats differ


class DisaggSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """Which consumer receives a request's KV; carried in ``kv_transfer_params['disagg_spec']``.

    With tensor parallelism each consumer rank has its own ports: the port fields are lists
    indexed by rank (as LMCache's are), and producer rank r pushes its shard to consumer rank r.
    A single integer is a consumer of one rank. ``for_rank`` gives one rank's spec, with plain
    integers: that is what the producer's transfer code is handed."""

    req_id: ReqId
    receiver_host: HostName
    receiver_init_port: Port | RankPorts
    receiver_alloc_port: Port | RankPorts
    # Leading prompt tokens the proxy saw the chosen decode's prefix cache hold (KV routing):
    # prefill pushes no chunk that lies wholly inside them, and a decode that holds fewer of
    # them by the time it schedules the request recomputes it (their chunks never come).
    decode_holds: Annotated[int, msgspec.Meta(ge=0, lt=1 << 31)] = 0

    def __post_init__(self) -> None:
        if len(_as_list(self.receiver_init_port)) != len(_as_list(self.receiver_alloc_port)):
            raise ValueError(
                f"receiver_init_port has {len(_as_list(self.receiver_init_port))} ranks, "
                f"receiver_alloc_port {len(_as_list(self.receiver_alloc_port))}"
            )

    @classmethod
    def from_dict(cls, raw: object) -> DisaggSpec:
        """Validate a JSON-decoded spec; raises ``ProtocolError`` naming the bad field."""
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise ProtocolError(f"invalid disagg_spec: {exc}") from exc

    def for_attempt(self, attempt: int) -> DisaggSpec:
        """The spec of prefill attempt ``attempt`` (0: this one): a request id of its own, so
        that nothing said of one attempt's push (a producer's abandon notice, re-sent for
        seconds; a drop) touches another's."""
        return (
            self
            if attempt == 0
            else msgspec.structs.replace(self, req_id=f"{self.req_id}~{attempt}")
        )

    @property
    def ranks(self) -> int:
        """How many consumer ranks the spec names (1 for single ports)."""
        return len(_as_list(self.receiver_init_port))

    def for_rank(self, rank: int) -> DisaggSpec:
        """The spec of consumer rank ``rank`` alone (single ports); ``ProtocolError`` if the
        spec names fewer ranks, e.g. a TP-2 producer's rank 1 sent to a TP-1 consumer."""
        if not 0 <= rank < self.ranks:
            raise ProtocolError(
                f"req {self.req_id}: disagg_spec names {self.ranks} consumer rank(s), no port "
                f"for rank {rank} (tensor-parallel sizes differ?)"
            )
        return DisaggSpec(
            self.req_id,
            self.receiver_host,
            _as_list(self.receiver_init_port)[rank],
            _as_list(self.receiver_alloc_port)[rank],
            self.decode_holds,
        )

    def skipped_tokens(self, chunk_size: int) -> int:
        """Leading tokens whose chunks prefill does not push: the whole chunks decode holds."""
        return self.decode_holds // chunk_size * chunk_size

    def every_rank(self) -> list[DisaggSpec]:
        """One single-port spec per consumer rank, in rank order."""
        return [self.for_rank(rank) for rank in range(self.ranks)]


def _as_list(ports: int | list[int]) -> list[int]:
    return [ports] if isinstance(ports, int) else ports


# Where a prefill engine sends a request's first-token notice (``first_token.py``): a host as
# ``HostName`` takes it, or a bracketed IPv6 address, and a port.
NOTICE_ADDRESS = re.compile(
    r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?)"
    r":(?P<port>[0-9]{1,5})$"
)
# The key of ``KVTransferParams.first_tok_to`` in the JSON, for logs and tests.
NOTICE_KEY = "first_tok_to"
# LMCache's request options, under its own keys: every key of them starts with the prefix; a
# tag's name follows ``TAG_PREFIX``.
LMCACHE_PREFIX = "lmcache."
TAG_PREFIX = "lmcache.tag."
SKIP_SAVE_KEY = "lmcache.skip_save"


class KVTransferParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """Our keys of the ``kv_transfer_params`` in a request to prefill or decode: a JSON object
    that the proxy sets (a client may not) and vLLM hands our connector's scheduler as a dict.

    Prefill is asked for ``ret_first_tok`` and, when decode goes on, sent the ``disagg_spec``
    and (with first-token notices) ``first_tok_to``, a "tcp://host:port"; decode is sent the
    same ``disagg_spec`` alone. Fields at their default are left out and the fields' order is
    the keys' order, so the JSON is what the proxy built by hand before this type existed.

    LMCache's request options, which a client may send (``lmcache_options``), go under
    LMCache's keys: ``lmcache.tag.<name>`` per tag, ``lmcache.skip_save``."""

    ret_first_tok: bool = False
    disagg_spec: DisaggSpec | None = None
    first_tok_to: str | None = None
    # Decode: the request is the client's own and its first output token must be this one
    # (prefill's); its prompt's KV, but for the last token, comes from the DisaggSpec's push.
    first_tok: int | None = None
    # Decode: the output tokens that must follow ``first_tok`` (what a client already has of a
    # stream continued here after another decode failed under it).
    next_toks: tuple[int, ...] = ()
    # LMCache's tags, (name, value) sorted by name: part of the request's chunk keys (``keys.py``),
    # so requests of different tags never share a chunk, of the same tags do.
    tags: tuple[tuple[str, str], ...] = ()
    # Decode: keep none of this request's KV in the landed-chunk cache once loaded (the push
    # itself still happens: it is how the KV gets there), as LMCache's ``lmcache.skip_save``.
    skip_save: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The JSON object for a request body."""
        raw = msgspec.to_builtins(self)
        tags = raw.pop("tags", ())
        if raw.pop("skip_save", False):
            raw[SKIP_SAVE_KEY] = True
        return raw | {TAG_PREFIX + name: value for name, value in tags}

    @classmethod
    def from_dict(cls, raw: object) -> KVTransferParams:
        """Our keys of a request's params as vLLM hands them over (others are left alone), read
        from a value of any type and shape: the door of each role, where a client's bytes could
        arrive. Raises ``ProtocolError`` naming the field for anything but an object (or none),
        or for a malformed ``disagg_spec``; nothing else. A ``first_tok_to`` that is not a usable
        "tcp://host:port" is left out: a notice is only a head start, so the request goes on
        without one (``notice_address_refused`` says whether the caller should log it)."""
        if raw is None:
            return cls()
        if not isinstance(raw, Mapping):
            raise ProtocolError(f"kv_transfer_params must be an object, not {type(raw).__name__}")
        spec = raw.get("disagg_spec")
        address = raw.get(NOTICE_KEY)
        first = raw.get("first_tok")
        if first is not None and not _is_token_id(first):
            raise ProtocolError(f"kv_transfer_params.first_tok is no token id: {first!r:.40}")
        tags, skip_save = lmcache_options(raw)
        return cls(
            ret_first_tok=raw.get("ret_first_tok") in (True, 1),
            disagg_spec=None if spec is None else DisaggSpec.from_dict(spec),
            first_tok_to=address if is_notice_address(address) else None,
            first_tok=first,
            next_toks=_next_tokens(raw.get("next_toks"), first),
            tags=tags,
            skip_save=skip_save,
        )

    @property
    def forced(self) -> tuple[int, ...]:
        """The tokens the request's output must begin with (none: nothing is forced)."""
        return () if self.first_tok is None else (self.first_tok, *self.next_toks)

    @classmethod
    def forced_tokens(cls, extra_args: object) -> tuple[int, ...]:
        """The tokens a request's output must begin with (``forced``), read from vLLM's
        ``SamplingParams.extra_args`` (where vLLM puts ``kv_transfer_params``); none for a
        request without them, or whose parameters the connector refuses too (it then serves
        the request without disaggregation, so nothing is forced)."""
        raw = extra_args.get("kv_transfer_params") if isinstance(extra_args, Mapping) else None
        try:
            return cls.from_dict(raw).forced
        except ProtocolError:
            return ()

    @staticmethod
    def notice_address_refused(raw: object) -> bool:
        """Whether ``raw`` (an object ``from_dict`` read) named a notice address it left out."""
        asked = raw.get(NOTICE_KEY) if isinstance(raw, Mapping) else None
        return asked is not None and not is_notice_address(asked)


def lmcache_options(raw: Mapping[str, Any]) -> tuple[tuple[tuple[str, str], ...], bool]:
    """LMCache's request options among ``raw``'s keys: its tags, sorted by name, and whether it
    skips saving. Other ``lmcache.`` keys (LMCache's own, meaning nothing here) are left alone.
    Raises ``ProtocolError`` naming the key for a tag that is not a string, a name or value
    of more than ``MAX_TAG_CHARS`` characters, an empty name, more than ``MAX_TAGS`` tags, or
    a ``skip_save`` that is not a boolean."""
    tags: list[tuple[str, str]] = []
    for key, value in raw.items():
        if not isinstance(key, str) or not key.startswith(TAG_PREFIX):
            continue
        name = key[len(TAG_PREFIX) :]
        shown = f"kv_transfer_params.{key:.{len(TAG_PREFIX) + 40}}"
        if not isinstance(value, str):
            raise ProtocolError(f"{shown} must be a string, not {type(value).__name__}")
        if not name or len(name) > MAX_TAG_CHARS or len(value) > MAX_TAG_CHARS:
            raise ProtocolError(
                f"{shown}: a tag's name (not empty) and value have at most {MAX_TAG_CHARS} "
                "characters each"
            )
        tags.append((name, value))
        if len(tags) > MAX_TAGS:
            raise ProtocolError(f"kv_transfer_params: more than {MAX_TAGS} {TAG_PREFIX}* tags")
    skip_save = raw.get(SKIP_SAVE_KEY, False)
    if not isinstance(skip_save, bool):
        raise ProtocolError(f"kv_transfer_params.{SKIP_SAVE_KEY} must be true or false")
    return tuple(sorted(tags)), skip_save


def _next_tokens(raw: object, first: int | None) -> tuple[int, ...]:
    """``next_toks`` checked: token ids, at most ``MAX_FORCED_TOKENS``, only after a
    ``first_tok``."""
    if raw is None:
        return ()
    if first is None:
        raise ProtocolError("kv_transfer_params.next_toks comes only with a first_tok")
    if not isinstance(raw, list) or len(raw) > MAX_FORCED_TOKENS:
        raise ProtocolError(
            f"kv_transfer_params.next_toks must be a list of at most {MAX_FORCED_TOKENS} token ids"
        )
    if not all(map(_is_token_id, raw)):
        raise ProtocolError("kv_transfer_params.next_toks holds something that is no token id")
    return tuple(raw)


def _is_token_id(value: object) -> bool:
    return type(value) is int and 0 <= value < MAX_TOKEN_ID


def is_notice_address(address: object) -> bool:
    """Whether ``address`` is a "tcp://host:port" a first-token notice may be sent to ("" and
    anything not a string are not)."""
    if not isinstance(address, str):
        return False
    match = NOTICE_ADDRESS.match(address)
    return match is not None and 1 <= int(match["port"]) <= 65535


class KVTransferReturn(msgspec.Struct, frozen=True, omit_defaults=True):
    """Our keys of the ``kv_transfer_params`` in prefill's answer, returned by its connector
    when asked (``ret_first_tok``): the request's first output token, and the DisaggSpec's
    ``req_id``."""

    first_tok: int | None = None
    disagg_req_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON object that vLLM puts in the answer."""
        return msgspec.to_builtins(self)

    @classmethod
    def from_dict(cls, raw: object) -> KVTransferReturn:
        """Read prefill's returned params (none: an empty one; keys not ours are left alone);
        raises ``ProtocolError`` naming the field if they are malformed."""
        try:
            return msgspec.convert(raw or {}, cls)
        except msgspec.ValidationError as exc:
            raise ProtocolError(f"invalid kv_transfer_params: {exc}") from exc


class Message(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """Base of every tagged message: the tag is the class name, ``version`` travels with it."""

    version: int


StackId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STACK_ID_CHARS)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=PROBE_NONCE_BYTES, max_length=PROBE_NONCE_BYTES)]


# Init port: the NIXL handshake (metadata, buffer, then the transport self-test).
class MetadataRequest(Message, frozen=True):
    """Step 1: the producer's KV profile and network-stack identity (``transport.py``); asks
    for the consumer's NIXL agent metadata, refused (INCOMPATIBLE) if the profiles differ."""

    profile: KVProfile
    stack: StackId


class AgentMetadata(Message, frozen=True):
    """Step 1 reply: what ``add_remote_agent`` needs, and the consumer's profile and identity
    (the producer checks the profiles too, and picks its transports from the identities)."""

    agent_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_AGENT_METADATA_BYTES)]
    profile: KVProfile
    stack: StackId


class BufferRequest(Message, frozen=True):
    """Step 2: ask for the consumer's registered buffer, once its agent is known."""


class BufferDescriptors(Message, frozen=True):
    """Step 2 reply: one contiguous registered region carved into equal pages."""

    agent_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    mem_type: Annotated[str, msgspec.Meta(min_length=1, max_length=16)]
    device_id: Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
    base_addr: Annotated[int, msgspec.Meta(ge=0)]
    page_bytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGE_BYTES)]
    num_pages: Annotated[int, msgspec.Meta(ge=1, lt=1 << 32)]
    # How long an allocated page waits for its write before the consumer takes it back.
    alloc_lease_s: Annotated[float, msgspec.Meta(gt=0.0, le=3600.0)]
    # The self-test: write ``probe_nonce`` at ``probe_addr`` with a ProbeDone notification.
    probe_addr: Annotated[int, msgspec.Meta(ge=0)]
    probe_nonce: Nonce


class ProbeCheck(Message, frozen=True):
    """Step 3, repeated until its deadline: has the self-test of ``nonce`` landed?"""

    nonce: Nonce


class ProbeState(enum.Enum):
    """What the consumer saw of one self-test."""

    PENDING = "pending"  # no notification yet
    LANDED = "landed"  # notification arrived and the slot holds the nonce
    CORRUPT = "corrupt"  # notification arrived but the slot does not hold the nonce
    UNKNOWN = "unknown"  # no such self-test (expired, or from another consumer process)


class ProbeResult(Message, frozen=True):
    """Reply to ProbeCheck."""

    nonce: Nonce
    state: ProbeState


# Alloc port.
class ChunkSpec(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One chunk the producer wants to write: its key and its size in bytes."""

    key: ChunkKeyBytes
    nbytes: Annotated[int, msgspec.Meta(ge=1, le=MAX_PAGE_BYTES)]


class AllocRequest(Message, frozen=True):
    """Ask for one page per chunk, all or nothing."""

    req_id: ReqId
    chunks: Annotated[
        list[ChunkSpec], msgspec.Meta(min_length=1, max_length=MAX_CHUNKS_PER_REQUEST)
    ]


class AllocResponse(Message, frozen=True):
    """Per chunk, the page to write into, or None if the consumer already holds that chunk.
    ``agent_name`` lets the producer notice a consumer restarted since its handshake."""

    req_id: ReqId
    agent_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    alloc_id: AllocId
    pages: Annotated[list[PageIndex | None], msgspec.Meta(max_length=MAX_CHUNKS_PER_REQUEST)]


class ReserveRequest(Message, frozen=True):
    """Ask for ``pages`` pages tied to no chunk yet, for a later push to write into without
    asking first (it then says where each chunk went, in its ReservedWriteDone)."""

    pages: Annotated[int, msgspec.Meta(ge=1, le=MAX_RESERVED_PAGES)]


class Reservation(Message, frozen=True):
    """Reply to ReserveRequest: the pages, under the lease of an allocation
    (``BufferDescriptors.alloc_lease_s``), and the consumer's agent (a restarted consumer's
    pages are not ours)."""

    agent_name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    reservation_id: AllocId
    pages: Annotated[list[PageIndex], msgspec.Meta(min_length=1, max_length=MAX_RESERVED_PAGES)]


class AllocCancel(Message, frozen=True):
    """The producer will not write ``alloc_id`` after all (its post failed or was cancelled):
    the pages stop waiting for a write, and their keys are free to be sent again."""

    req_id: ReqId
    alloc_id: AllocId


class CancelAck(Message, frozen=True):
    """Reply to AllocCancel; ``known`` is False if the allocation had landed or lapsed."""

    req_id: ReqId
    alloc_id: AllocId
    known: bool


class KVAbandoned(Message, frozen=True):
    """``req_id``'s KV will not come (from its producer) or is not wanted (from the proxy): the
    consumer fails a load that waits for it at once, frees its pages and refuses its later
    pushes. Idempotent."""

    req_id: ReqId
    reason: AbandonReason
    detail: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_DETAIL_CHARS)] = ""
    # False when the sender knows no write of this request can still land: the consumer then
    # frees its pending allocations at once instead of at their lease.
    write_in_flight: bool = True

    @classmethod
    def of(
        cls, req_id: str, reason: AbandonReason, detail: str = "", write_in_flight: bool = True
    ) -> KVAbandoned:
        """This version's notice, its detail cut to the protocol's limit."""
        return cls(
            version=PROTOCOL_VERSION,
            req_id=req_id,
            reason=reason,
            detail=detail[:MAX_ERROR_DETAIL_CHARS],
            write_in_flight=write_in_flight,
        )


class AbandonAck(Message, frozen=True):
    """Reply to KVAbandoned; ``known`` is False if the consumer held nothing of the request."""

    req_id: ReqId
    known: bool


class ErrorReply(Message, frozen=True):
    """Any refusal. ``retry_after_s`` is set only for ``BUFFER_FULL``."""

    code: ErrorCode
    detail: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_DETAIL_CHARS)]
    req_id: Annotated[str, msgspec.Meta(max_length=MAX_REQ_ID_CHARS)] = ""
    retry_after_s: Annotated[float, msgspec.Meta(ge=0.0, le=60.0)] = 0.0


# NIXL notification, sent by the producer's WRITE after its data.
class WriteDone(Message, frozen=True):
    """The pages of ``alloc_id`` hold their chunks now; checksums are in the request's chunk order
    over the chunks that were written (the ``None`` pages of the AllocResponse are skipped)."""

    req_id: ReqId
    alloc_id: AllocId
    checksums: Annotated[list[Checksum], msgspec.Meta(max_length=MAX_CHUNKS_PER_REQUEST)] | None


class ReservedWriteDone(Message, frozen=True):
    """``chunks`` of ``req_id`` were written into ``pages`` (one each, in order) of reservation
    ``reservation_id``, with their ``checksums``. Pages a chunk did not need stay reserved."""

    req_id: ReqId
    reservation_id: AllocId
    chunks: Annotated[list[ChunkSpec], msgspec.Meta(min_length=1, max_length=MAX_RESERVED_PAGES)]
    pages: Annotated[list[PageIndex], msgspec.Meta(min_length=1, max_length=MAX_RESERVED_PAGES)]
    checksums: Annotated[list[Checksum], msgspec.Meta(max_length=MAX_RESERVED_PAGES)] | None


class ProbeDone(Message, frozen=True):
    """The self-test's notification: its nonce is in the slot it was given."""

    nonce: Nonce


class _Envelope(msgspec.Struct, frozen=True):
    """What every message has, read before its body so a version mismatch is reported as such."""

    type: str
    version: int


M = TypeVar("M")

_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_Envelope)
_ENCODER = msgspec.msgpack.Encoder()


def encode(message: Message) -> bytes:
    """Serialize one message to msgpack."""
    return _ENCODER.encode(message)


class Codec(Generic[M]):
    """Strict decoder for one socket's union of messages."""

    def __init__(self, union: type[M] | object) -> None:
        self._decoder = msgspec.msgpack.Decoder(union)

    def decode(self, frame: bytes) -> M:
        """Decode one frame; raises ``VersionMismatch`` or ``ProtocolError`` and nothing else."""
        if len(frame) > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
        try:
            envelope = _ENVELOPE_DECODER.decode(frame)
        except msgspec.MsgspecError as exc:
            raise ProtocolError(f"not a tagged message: {exc}") from exc
        if envelope.version != PROTOCOL_VERSION:
            raise VersionMismatch(
                f"peer sent {envelope.type} with protocol version {envelope.version}, "
                f"this side speaks {PROTOCOL_VERSION}"
            )
        try:
            return self._decoder.decode(frame)
        except msgspec.MsgspecError as exc:
            raise ProtocolError(f"invalid {envelope.type}: {exc}") from exc


INIT_REQUESTS: Codec[MetadataRequest | BufferRequest | ProbeCheck] = Codec(
    MetadataRequest | BufferRequest | ProbeCheck
)
INIT_REPLIES: Codec[AgentMetadata | BufferDescriptors | ProbeResult | ErrorReply] = Codec(
    AgentMetadata | BufferDescriptors | ProbeResult | ErrorReply
)
ALLOC_REQUESTS: Codec[AllocRequest | ReserveRequest | AllocCancel | KVAbandoned] = Codec(
    AllocRequest | ReserveRequest | AllocCancel | KVAbandoned
)
ALLOC_REPLIES: Codec[AllocResponse | Reservation | CancelAck | AbandonAck | ErrorReply] = Codec(
    AllocResponse | Reservation | CancelAck | AbandonAck | ErrorReply
)
NOTIFICATIONS: Codec[WriteDone | ReservedWriteDone | ProbeDone] = Codec(
    WriteDone | ReservedWriteDone | ProbeDone
)
