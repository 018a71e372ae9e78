"""Wire protocol: round trips, and strict decoding that only ever raises ProtocolError."""

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_pd import protocol
from lmcache_pd.compat import KVProfile
from lmcache_pd.errors import ProtocolError, VersionMismatch
from lmcache_pd.protocol import (
    ALLOC_REPLIES,
    ALLOC_REQUESTS,
    INIT_REPLIES,
    INIT_REQUESTS,
    NOTIFICATIONS,
    PROTOCOL_VERSION,
    AllocRequest,
    ChunkSpec,
    DisaggSpec,
    ErrorCode,
    ErrorReply,
)

V = PROTOCOL_VERSION
PROFILE = KVProfile(chunk_size=256, page_bytes=1 << 20)
FULL_PROFILE = KVProfile(
    chunk_size=256,
    page_bytes=1 << 20,
    model="/models/llama",
    kv_dtype="float32",
    chunk_format="blocks:4x2x128x128",
    block_size=128,
    tp_size=1,
    tp_rank=0,
)
NONCE = b"n" * protocol.PROBE_NONCE_BYTES
CODECS = [INIT_REQUESTS, INIT_REPLIES, ALLOC_REQUESTS, ALLOC_REPLIES, NOTIFICATIONS]

EXAMPLES = [
    (INIT_REQUESTS, protocol.MetadataRequest(version=V, profile=PROFILE, stack="boot/net:1")),
    (INIT_REQUESTS, protocol.BufferRequest(version=V)),
    (INIT_REQUESTS, protocol.ProbeCheck(version=V, nonce=NONCE)),
    (
        INIT_REPLIES,
        protocol.AgentMetadata(
            version=V, agent_name="a", metadata=b"\x00" * 460, profile=FULL_PROFILE, stack="s"
        ),
    ),
    (INIT_REPLIES, protocol.ProbeResult(version=V, nonce=NONCE, state=protocol.ProbeState.LANDED)),
    (INIT_REPLIES, ErrorReply(version=V, code=ErrorCode.INCOMPATIBLE, detail="chunk_size: 1, 2")),
    (
        INIT_REPLIES,
        protocol.BufferDescriptors(
            version=V,
            agent_name="a",
            mem_type="DRAM",
            device_id=0,
            base_addr=2**47,
            page_bytes=1 << 20,
            num_pages=64,
            alloc_lease_s=60.0,
            probe_addr=2**47 + 64 * (1 << 20),
            probe_nonce=NONCE,
        ),
    ),
    (ALLOC_REQUESTS, AllocRequest(version=V, req_id="r", chunks=[ChunkSpec(b"k" * 16, 10)])),
    (
        ALLOC_REPLIES,
        protocol.AllocResponse(version=V, req_id="r", agent_name="a", alloc_id=7, pages=[3, None]),
    ),
    (
        ALLOC_REPLIES,
        ErrorReply(version=V, code=ErrorCode.BUFFER_FULL, detail="x", retry_after_s=0.05),
    ),
    (
        ALLOC_REQUESTS,
        protocol.KVAbandoned(
            version=V, req_id="r", reason=protocol.AbandonReason.STAGING_FULL, detail="full"
        ),
    ),
    (ALLOC_REPLIES, protocol.AbandonAck(version=V, req_id="r", known=True)),
    (ALLOC_REPLIES, ErrorReply(version=V, code=ErrorCode.DROPPED, detail="let go", req_id="r")),
    (NOTIFICATIONS, protocol.WriteDone(version=V, req_id="r", alloc_id=7, checksums=[2**64 - 1])),
    (NOTIFICATIONS, protocol.WriteDone(version=V, req_id="r", alloc_id=7, checksums=None)),
    (NOTIFICATIONS, protocol.ProbeDone(version=V, nonce=NONCE)),
]


@pytest.mark.parametrize(("codec", "message"), EXAMPLES)
def test_every_message_round_trips(codec: protocol.Codec, message: protocol.Message) -> None:
    assert codec.decode(protocol.encode(message)) == message


def raw(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\xc1",
        raw(type="AllocRequest"),
        raw(type="AllocRequest", version=V, req_id="r", chunks=[]),
        raw(type="AllocRequest", version=V, req_id="", chunks=[[b"k", 1]]),
        raw(type="AllocRequest", version=V, req_id="r", chunks=[[b"k", 0]]),
        raw(type="AllocRequest", version=V, req_id="r", chunks=[[b"k", -1]]),
        raw(type="AllocRequest", version=V, req_id="r", chunks=[[b"k" * 65, 1]]),
        raw(type="AllocRequest", version=V, req_id="r", chunks=[[b"k", 1, 2]]),
        raw(type="AllocRequest", version=V, req_id="r" * 300, chunks=[[b"k", 1]]),
        raw(type="KVAbandoned", version=V, req_id="r", reason="tired"),
        raw(type="KVAbandoned", version=V, reason="client_gone"),
        raw(type="AllocRequest", version=V, req_id="r", chunks=[[b"k", 1]], extra=1),
        raw(type="AllocRequest", version=V, req_id="r", chunks=[[b"k", 1]] * 4097),
        raw(type="AllocRequest", version=True, req_id="r", chunks=[[b"k", 1]]),
        raw(type="MetadataRequest", version=V),
        raw(type=1, version=V),
        msgspec.msgpack.encode([1, 2, 3]),
        b"\x00" * (protocol.MAX_FRAME_BYTES + 1),
    ],
)
def test_malformed_alloc_requests_raise_protocol_error(frame: bytes) -> None:
    with pytest.raises(ProtocolError):
        ALLOC_REQUESTS.decode(frame)


def test_other_version_is_reported_as_such_before_the_body_is_read() -> None:
    other = V + 1
    with pytest.raises(VersionMismatch, match=f"version {other}"):
        ALLOC_REQUESTS.decode(raw(type="AllocRequest", version=other, anything="goes"))


def test_reply_codec_refuses_requests() -> None:
    with pytest.raises(ProtocolError):
        INIT_REPLIES.decode(protocol.encode(protocol.BufferRequest(version=V)))


@settings(max_examples=500, deadline=None)
@given(frame=st.binary(max_size=512))
def test_random_bytes_only_ever_raise_protocol_error(frame: bytes) -> None:
    for codec in CODECS:
        with contextlib.suppress(ProtocolError):
            codec.decode(frame)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text()
    | st.binary(),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=8), children, max_size=5)
    ),
    max_leaves=20,
)


@settings(max_examples=500, deadline=None)
@given(
    name=st.sampled_from(["AllocRequest", "AllocResponse", "WriteDone", "BufferDescriptors", "x"]),
    fields=st.dictionaries(
        st.sampled_from(["req_id", "chunks", "pages", "alloc_id", "checksums", "base_addr", "z"]),
        msgpack_values,
    ),
)
def test_structured_garbage_only_ever_raises_protocol_error(name: str, fields: dict) -> None:
    frame = msgspec.msgpack.encode({"type": name, "version": V, **fields})
    for codec in CODECS:
        with contextlib.suppress(ProtocolError):
            codec.decode(frame)


def test_disagg_spec_is_validated_naming_the_field() -> None:
    good = {
        "req_id": "r",
        "receiver_host": "h",
        "receiver_init_port": 1,
        "receiver_alloc_port": 2,
    }
    assert DisaggSpec.from_dict(good).receiver_alloc_port == 2
    with pytest.raises(ProtocolError, match="receiver_init_port"):
        DisaggSpec.from_dict({**good, "receiver_init_port": 70000})
    with pytest.raises(ProtocolError, match="unknown"):
        DisaggSpec.from_dict({**good, "surprise": 1})


@pytest.mark.parametrize(
    "host", ["decode 0", "tcp://decode-0", "decode-0:5555", "-decode", "decode..svc", "a" * 254]
)
def test_a_receiver_host_zmq_cannot_connect_to_is_refused_at_the_door(host: str) -> None:
    """Refused while decoding the request, not later inside a socket call on a sender thread
    (zmq raises EINVAL there)."""
    good = {"req_id": "r", "receiver_init_port": 1, "receiver_alloc_port": 2}
    for fine in ("127.0.0.1", "decode-0.pd.svc.cluster.local", "localhost"):  # control
        assert DisaggSpec.from_dict({**good, "receiver_host": fine}).receiver_host == fine
    with pytest.raises(ProtocolError, match="receiver_host"):
        DisaggSpec.from_dict({**good, "receiver_host": host})


def test_kv_transfer_params_travel_as_the_json_the_proxy_always_sent() -> None:
    """The keys, their order and the defaults left out are the hand-built dicts' of before."""
    spec = DisaggSpec("r", "h", 1, [2])
    spec_json = (
        b'{"req_id":"r","receiver_host":"h","receiver_init_port":1,"receiver_alloc_port":[2]}'
    )
    to_prefill = protocol.KVTransferParams(True, spec, "tcp://p:5")
    assert msgspec.json.encode(to_prefill.to_dict()) == (
        b'{"ret_first_tok":true,"disagg_spec":' + spec_json + b',"first_tok_to":"tcp://p:5"}'
    )
    assert protocol.KVTransferParams(ret_first_tok=True).to_dict() == {"ret_first_tok": True}
    to_decode = protocol.KVTransferParams(disagg_spec=spec).to_dict()
    assert msgspec.json.encode(to_decode) == b'{"disagg_spec":' + spec_json + b"}"
    assert protocol.KVTransferParams.from_dict(to_decode).disagg_spec == spec
    returned = protocol.KVTransferReturn(first_tok=7, disagg_req_id="r").to_dict()
    assert returned == {"first_tok": 7, "disagg_req_id": "r"}
    assert protocol.KVTransferReturn.from_dict(returned) == protocol.KVTransferReturn(7, "r")


def test_kv_transfer_params_refuse_a_bad_spec_and_leave_out_a_bad_notice_address() -> None:
    spec = {"req_id": "r", "receiver_host": "h", "receiver_init_port": 1, "receiver_alloc_port": 2}
    read = protocol.KVTransferParams.from_dict
    assert read(None) == protocol.KVTransferParams()
    with pytest.raises(ProtocolError, match="disagg_spec"):
        read({"disagg_spec": {**spec, "receiver_init_port": "x"}})
    for not_an_object in ("x", 5, [1], 1.5, True):
        with pytest.raises(ProtocolError, match="must be an object"):
            read(not_an_object)
    for bad in ("127.0.0.1; rm -rf", 5, "tcp://-:1", "tcp://h:0", "tcp://h:65536", "tcp://h:"):
        params = read({"disagg_spec": spec, protocol.NOTICE_KEY: bad, "ret_first_tok": 1})
        assert (params.first_tok_to, params.ret_first_tok) == (None, True)
        assert params.disagg_spec == DisaggSpec.from_dict(spec)
    assert read({protocol.NOTICE_KEY: "tcp://[::1]:9"}).first_tok_to == "tcp://[::1]:9"
    assert read({protocol.NOTICE_KEY: "tcp://h:65535"}).first_tok_to == "tcp://h:65535"
    assert protocol.KVTransferParams.notice_address_refused({protocol.NOTICE_KEY: "tcp://-:1"})
    assert not protocol.KVTransferParams.notice_address_refused({"ret_first_tok": True})
    with pytest.raises(ProtocolError, match="first_tok"):
        protocol.KVTransferReturn.from_dict({"first_tok": "seven"})
    assert protocol.KVTransferReturn.from_dict({"first_tok": 3, "other": 1}).first_tok == 3


def test_lmcache_request_options_are_read_under_lmcache_keys_and_bounded() -> None:
    """``lmcache.tag.<name>`` and ``lmcache.skip_save``, as LMCache's users send them, are read
    beside our keys (tags sorted by name) and written back under the same keys; LMCache's
    other options are left alone; a tag that is not a string, too long, too many tags or a
    skip_save that is not a boolean refuses the params, naming the key."""
    read = protocol.KVTransferParams.from_dict
    raw = {
        "lmcache.tag.user": "x",
        "lmcache.tag.tenant": "a",
        "lmcache.skip_save": True,
        "lmcache.ttl": 60,  # LMCache's, meaning nothing here
        "ret_first_tok": True,
    }
    params = read(raw)
    assert params.tags == (("tenant", "a"), ("user", "x")) and params.skip_save
    assert params.to_dict() == {k: v for k, v in raw.items() if k != "lmcache.ttl"}
    assert read(params.to_dict()) == params
    assert read({"ret_first_tok": True}).to_dict() == {"ret_first_tok": True}  # none: no keys
    long = "v" * (protocol.MAX_TAG_CHARS + 1)
    too_many = {f"lmcache.tag.t{i}": "v" for i in range(protocol.MAX_TAGS + 1)}
    for bad, named in [
        ({"lmcache.tag.tenant": 7}, "lmcache.tag.tenant must be a string, not int"),
        ({"lmcache.tag.tenant": ["a"]}, "lmcache.tag.tenant must be a string"),
        ({"lmcache.tag.tenant": long}, "lmcache.tag.tenant"),
        ({f"lmcache.tag.{long}": "a"}, "lmcache.tag.vvv"),
        ({"lmcache.tag.": "a"}, "lmcache.tag."),
        (too_many, f"more than {protocol.MAX_TAGS}"),
        ({"lmcache.skip_save": "yes"}, "lmcache.skip_save"),
    ]:
        with pytest.raises(ProtocolError, match=named):
            read(bad)
    at_most = {f"lmcache.tag.t{i}": "v" * protocol.MAX_TAG_CHARS for i in range(protocol.MAX_TAGS)}
    assert len(read(at_most).tags) == protocol.MAX_TAGS  # the control: at the bounds


def test_decodes_forced_tokens_are_token_ids_or_the_params_are_refused() -> None:
    """``first_tok`` names decode's first output token (the client's own request goes on from
    it), ``next_toks`` the ones after it (a stream continued elsewhere): token ids, read by the
    connector and by the forcing logits processor alike; anything else refuses the params (the
    request is then served without disaggregation, nothing forced)."""
    spec = {"req_id": "r", "receiver_host": "h", "receiver_init_port": 1, "receiver_alloc_port": 2}
    read = protocol.KVTransferParams.from_dict
    params = read({"disagg_spec": spec, "first_tok": 7})
    assert params.first_tok == 7 and params.forced == (7,)
    assert params.to_dict() == {"disagg_spec": spec, "first_tok": 7}
    assert read({"disagg_spec": spec}).forced == ()
    continued = read({"first_tok": 7, "next_toks": [3, 4]})
    assert continued.forced == (7, 3, 4)
    assert read(msgspec.json.decode(msgspec.json.encode(continued.to_dict()))) == continued
    forced = protocol.KVTransferParams.forced_tokens
    assert forced({"kv_transfer_params": {"disagg_spec": spec, "first_tok": 7}}) == (7,)
    for bad in (-1, 1 << 31, True, 7.0, "7", [7]):
        with pytest.raises(ProtocolError, match="first_tok"):
            read({"disagg_spec": spec, "first_tok": bad})
        assert forced({"kv_transfer_params": {"first_tok": bad}}) == ()
        with pytest.raises(ProtocolError, match="next_toks"):
            read({"first_tok": 7, "next_toks": [3, bad]})
    too_many = [1] * (protocol.MAX_FORCED_TOKENS + 1)
    for bad_next in ({"next_toks": [3]}, {"first_tok": 7, "next_toks": too_many}):
        with pytest.raises(ProtocolError, match="next_toks"):
            read(bad_next)
    for nothing in (None, {}, {"kv_transfer_params": None}, {"kv_transfer_params": "x"}, "x"):
        assert forced(nothing) == ()
