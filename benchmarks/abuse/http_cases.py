"""The HTTP doors' cases: each a named, small, deterministic input and the answers its door
should give (``proxy/client_request.py``, ``proxy/door.py``: 400/401/404/413/503 from the proxy;
``deploy/instance_guard.py``: 401 from an instance without its key; with the key, the
connector's ``ParamsDoor`` serves any ``kv_transfer_params`` without disaggregation)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Literal

from benchmarks.chaos.judge import random_tokens

Auth = Literal["key", "none", "wrong", "basic"]
# Any answer below 500 (an instance called with its key may serve or refuse these, but neither
# fail nor die).
BELOW_500 = frozenset(range(100, 500))
# A raw HTTP case's connection closed with no answer: a refusal too.
CLOSED = 0
REFUSED_RAW = frozenset({CLOSED, 400, 413, 414, 431})
HUGE_BODY_BYTES = 9 << 20  # past the proxy's max_body_bytes (8 MiB)
# What the open-path case sends of a chunked body it never ends.
ENDLESS_BODY_MIB = 16
DEEP_LEVELS = 100_000
# Deep enough for pickle's recursion limit (vLLM pickles each step's new requests, their
# kv_transfer_params too, for its workers), shallow enough for the JSON parsers on the way.
DEEP_PARAMS_LEVELS = 600
# A template whose render takes about forever: loops nested as deep as the sandbox allows.
NESTED_LOOP_TEMPLATE = "{% for a in range(99999) %}" * 6 + "x" + "{% endfor %}" * 6
LONG_PROMPT_TOKENS = 300  # past a chunk (256): prefill's connector acts on it


@dataclass(frozen=True, slots=True)
class Call:
    """One HTTP request: JSON (a dict) or raw body bytes, with the door's key or not."""

    body: dict[str, Any] | bytes = b""
    path: str = "/v1/completions"
    auth: Auth = "key"
    method: str = "POST"


@dataclass(frozen=True, slots=True)
class HttpCase:
    """Calls (or raw bytes on a socket, or a custom action) and the statuses that are right."""

    name: str
    expect: frozenset[int]
    calls: tuple[Call, ...] = ()
    raw: bytes = b""
    action: str = ""  # "burst", "slow_headers": see ``http_doors``
    short: bool = False
    what: str = ""


@dataclass(frozen=True, slots=True)
class Context:
    """What the cases are built from."""

    model: str
    # A decode instance's receive address (spec cases that name a real consumer).
    decode_host: str
    decode_init_port: int
    decode_alloc_port: int
    tokens: tuple[int, ...] = field(
        default_factory=lambda: tuple(random_tokens(random.Random(7), LONG_PROMPT_TOKENS))
    )

    def completion(self, **extra: Any) -> dict[str, Any]:
        body = {"model": self.model, "prompt": list(self.tokens), "max_tokens": 2}
        return body | {"temperature": 0} | extra

    def chat(self, **extra: Any) -> dict[str, Any]:
        content = " ".join(["door"] * LONG_PROMPT_TOKENS)
        body = {"model": self.model, "messages": [{"role": "user", "content": content}]}
        return body | {"max_tokens": 2, "temperature": 0} | extra

    def spec(self, req_id: str = "cmpl-abuse-0", **change: Any) -> dict[str, Any]:
        """A disagg_spec naming nobody (ports nobody listens on) unless changed."""
        spec = {
            "req_id": req_id,
            "receiver_host": "127.0.0.1",
            "receiver_init_port": 1,
            "receiver_alloc_port": 2,
        }
        return spec | change


def deep(levels: int) -> bytes:
    return b"[" * levels + b"]" * levels


def deep_body(model: str, levels: int, field_name: str = "user") -> bytes:
    head = json.dumps({"model": model, "prompt": "hi", "max_tokens": 2})[:-1].encode()
    return head + f', "{field_name}": '.encode() + deep(levels) + b"}"


RAW_CASES = (
    HttpCase(
        "smuggle_cl_te",
        REFUSED_RAW,
        raw=b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
        short=True,
        what="Content-Length and Transfer-Encoding both (request smuggling)",
    ),
    HttpCase(
        "garbage_request_line",
        REFUSED_RAW,
        raw=b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03 not http\r\n\r\n",
        what="a TLS hello to a plain-HTTP port",
    ),
    HttpCase(
        "huge_header",
        REFUSED_RAW,
        raw=b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (64 << 10) + b"\r\n\r\n",
        what="one 64 KiB header",
    ),
    HttpCase(
        "slow_headers",
        frozenset({200}),
        action="slow_headers",
        what="connections that send half their headers and wait (the door must still answer)",
    ),
)


def proxy_cases(c: Context) -> list[HttpCase]:
    """The proxy's door, called as a client would, with the client key unless the case is
    about the key."""
    bad_parts = [
        [{"type": "text", "text": 5}],
        [42],
        {"a": 1},
        [{"type": "text", "text": ["nested"]}],
    ]
    return [
        HttpCase("no_key", frozenset({401}), (Call(c.completion(), auth="none"),), short=True),
        HttpCase("wrong_key", frozenset({401}), (Call(c.completion(), auth="wrong"),), short=True),
        HttpCase(
            "not_bearer",
            frozenset({401}),
            (
                Call(c.completion(), auth="basic"),
                Call(path="/v1/models", auth="none", method="GET"),
            ),
        ),
        HttpCase("not_json", frozenset({400}), (Call(b"{not json"),), short=True),
        HttpCase("not_an_object", frozenset({400}), (Call(b"[1, 2]"), Call(b'"text"'))),
        HttpCase("invalid_utf8", frozenset({400}), (Call(b'{"model": "\xff\xfe"}'),)),
        HttpCase(
            "deep_nesting",
            frozenset({400}),
            (Call(deep_body(c.model, DEEP_LEVELS)), Call(deep_body(c.model, 40, "logit_bias"))),
            short=True,
        ),
        HttpCase("huge_body", frozenset({413}), (Call(b" " * HUGE_BODY_BYTES),), short=True),
        HttpCase(
            "wrong_types",
            frozenset({400}),
            (
                Call(c.completion(prompt=5)),
                Call(c.completion(max_tokens="ten")),
                Call(c.completion(model=7)),
                Call(c.completion(prompt=[-1, 2])),
                Call(c.completion(stream="yes")),
                Call(c.completion(stream=True, stream_options="x")),
            ),
            short=True,
        ),
        HttpCase(
            "out_of_range",
            frozenset({400}),
            (
                Call(c.completion(logprobs=1000)),
                Call(c.completion(max_tokens=10**9)),
                Call(c.completion(temperature=-1)),
                Call(c.chat(logprobs=True, top_logprobs=1000), "/v1/chat/completions"),
            ),
            short=True,
            what="fields of the right type out of the range vLLM serves: its 400, passed on",
        ),
        HttpCase(
            "prompt_too_long",
            frozenset({400}),
            (Call(c.completion(prompt=[5] * 5000)),),
            short=True,
            what="5000 tokens, past the model's 4096: prefill refuses, the client gets its 400",
        ),
        HttpCase(
            "huge_cache_salt",
            frozenset({400}),
            (Call(c.completion(cache_salt="s" * (1 << 20))),),
            what="a 1 MiB cache_salt (part of every chunk key)",
        ),
        HttpCase(
            "wrong_method",
            frozenset({405}),
            (Call(path="/v1/completions", method="GET"), Call(c.completion(), method="PUT")),
        ),
        HttpCase(
            "token_out_of_vocab",
            frozenset({400}),
            (Call(c.completion(prompt=[10**9, 5])),),
            what="token ids the model does not have: refused by prefill, passed on as 400",
        ),
        HttpCase(
            "bad_content_parts",
            frozenset({400}),
            (
                *(
                    Call(c.chat(messages=[{"role": "user", "content": p}]), "/v1/chat/completions")
                    for p in bad_parts
                ),
                Call(c.chat(messages=[{"content": "no role"}]), "/v1/chat/completions"),
            ),
            short=True,
        ),
        HttpCase(
            "vllm_xargs_smuggling",
            frozenset({400}),
            (
                Call(c.completion(vllm_xargs={"kv_transfer_params": "x"})),
                Call(c.completion(vllm_xargs={"kv_transfer_params": [1, 2]})),
                Call(c.completion(prompt=[5, 6], vllm_xargs={"kv_transfer_params": "x"})),
                Call(c.chat(vllm_xargs={"kv_transfer_params": "x"}), "/v1/chat/completions"),
            ),
            short=True,
        ),
        HttpCase(
            "kv_transfer_params",
            frozenset({400}),
            (
                Call(c.completion(kv_transfer_params={"disagg_spec": c.spec()})),
                Call(c.completion(kv_transfer_params={"first_tok_to": "tcp://-:1"})),
                Call(c.completion(kv_transfer_params="x")),
                Call(c.completion(kv_transfer_params={"lmcache.tag.t": 7})),
                Call(c.completion(kv_transfer_params={f"lmcache.tag.{i}": "v" for i in range(99)})),
            ),
            short=True,
        ),
        HttpCase(
            "ec_transfer_params", frozenset({400}), (Call(c.completion(ec_transfer_params={})),)
        ),
        HttpCase(
            "bad_fields",
            frozenset({400}),
            (
                Call(c.completion(n=0)),
                Call(c.completion(prompt=["a", [-1]])),
                Call(c.completion(cache_salt="")),
            ),
        ),
        HttpCase(
            "template_in_kwargs",
            frozenset({400}),
            tuple(
                Call(c.chat(chat_template_kwargs=kwargs), "/v1/chat/completions")
                for kwargs in (
                    {"chat_template": NESTED_LOOP_TEMPLATE},
                    {"chat_template": None},
                    {"tokenize": True},
                )
            ),
            short=True,
            what="a Jinja template of the client's inside chat_template_kwargs (the proxy's own "
            "tokenizer once ran it), and tokenize: refused as vLLM refuses them",
        ),
        HttpCase("unknown_model", frozenset({404}), (Call(c.completion(model="other")),)),
        *RAW_CASES,
        HttpCase(
            "admission_burst",
            frozenset({200, 503}),
            action="burst",
            short=True,
            what="3x max_in_flight requests at once: some 503 with Retry-After, the rest served",
        ),
    ]


# kv_transfer_params that a caller with an instance's key may send straight to it: every type,
# every malformed spec, every notice address ZMQ refuses or that names nobody.
def hostile_params(c: Context) -> list[tuple[str, object, bool]]:
    """(name, kv_transfer_params, in the short run)."""
    nowhere = c.spec()
    return [
        ("first_tok_to_dash", {"disagg_spec": nowhere, "first_tok_to": "tcp://-:1"}, True),
        ("params_string", "x", True),
        ("params_number", 5, False),
        ("params_list", [1, "a", None], True),
        ("params_true", True, False),
        ("params_empty", {}, False),
        ("spec_string", {"disagg_spec": "x"}, True),
        (
            "spec_wrong_types",
            {"disagg_spec": {"req_id": 5, "receiver_host": [], "receiver_init_port": "a"}},
            False,
        ),
        ("spec_port_out_of_range", {"disagg_spec": c.spec(receiver_init_port=70000)}, False),
        (
            "spec_rank_mismatch",
            {"disagg_spec": c.spec(receiver_init_port=[1, 2], receiver_alloc_port=3)},
            False,
        ),
        (
            "spec_65_ranks",
            {"disagg_spec": c.spec(receiver_init_port=[1] * 65, receiver_alloc_port=[2] * 65)},
            False,
        ),
        ("spec_bad_host", {"disagg_spec": c.spec(receiver_host="-:1")}, True),
        ("spec_unknown_field", {"disagg_spec": c.spec(extra=1)}, False),
        ("first_tok_to_number", {"disagg_spec": nowhere, "first_tok_to": 5}, False),
        ("first_tok_to_ipc", {"disagg_spec": nowhere, "first_tok_to": "ipc:///tmp/abuse"}, False),
        ("first_tok_to_inproc", {"disagg_spec": nowhere, "first_tok_to": "inproc://x"}, False),
        ("first_tok_to_big_port", {"disagg_spec": nowhere, "first_tok_to": "tcp://a:99999"}, True),
        ("first_tok_to_wildcard", {"disagg_spec": nowhere, "first_tok_to": "tcp://*:1"}, False),
        ("first_tok_to_bad_ipv6", {"disagg_spec": nowhere, "first_tok_to": "tcp://[::1:1"}, False),
        (
            "first_tok_to_long_host",
            {"disagg_spec": nowhere, "first_tok_to": "tcp://" + "a." * 126 + "b:1"},
            False,
        ),
        ("ret_first_tok_string", {"ret_first_tok": "yes", "disagg_spec": nowhere}, False),
        ("deep_params", {"x": json.loads(deep(DEEP_PARAMS_LEVELS))}, True),
        ("lmcache_tag_not_a_string", {"disagg_spec": nowhere, "lmcache.tag.t": [1]}, False),
        ("lmcache_tag_too_long", {"lmcache.tag.t": "a" * 100_000}, False),
    ]


def instance_cases(c: Context, role: str) -> list[HttpCase]:
    """An instance's own HTTP port, called around the proxy: without its key (refused, 401);
    with it, hostile ``kv_transfer_params`` of every type and ``vllm_xargs`` smuggling (served,
    or refused below 500; the instance lives on)."""
    killer = {"disagg_spec": c.spec(), "first_tok_to": "tcp://-:1"}
    deep_value = json.loads(deep(DEEP_PARAMS_LEVELS))
    other_paths = (
        "/invocations", "/tokenize", "/detokenize", "/v1/responses", "/pooling", "/classify",
        "/score", "/rerank", "/v1/embeddings", "/v1/audio/transcriptions", "/reset_prefix_cache",
        "/sleep", "/wake_up", "/collective_rpc", "/start_profile", "/scale_elastic_ep",
        "/v1/load_lora_adapter", "/update_weights",
    )  # fmt: skip
    cases = [
        HttpCase(
            "no_key",
            frozenset({401}),
            (
                Call(c.completion(kv_transfer_params=killer), auth="none"),
                Call(c.chat(kv_transfer_params=killer), "/v1/chat/completions", auth="none"),
            ),
            short=True,
        ),
        HttpCase("wrong_key", frozenset({401}), (Call(c.completion(), auth="wrong"),)),
        HttpCase(
            "other_paths_no_key",
            frozenset({401}),
            (
                *(Call(c.completion(kv_transfer_params=killer), p, "none") for p in other_paths),
                Call(path="/v1/models", auth="none", method="GET"),
            ),
            short=True,
            what="every path but /health and /metrics (SageMaker's /invocations runs a completion)",
        ),
    ]
    for name, params, short in hostile_params(c):
        # A notice address matters to prefill alone (it once ended prefill's engine); decode
        # waits its load_timeout_s for KV the spec's prefill never pushes (30 s a case in
        # configs/consumer.yaml), so the short run leaves those cases to prefill's door.
        short = short and not (role == "decode" and name.startswith("first_tok_to"))
        cases.append(
            HttpCase(name, BELOW_500, (Call(c.completion(kv_transfer_params=params)),), short=short)
        )
    cases += [
        HttpCase(
            "chat_first_tok_to_dash",
            BELOW_500,
            (Call(c.chat(kv_transfer_params=killer), "/v1/chat/completions"),),
        ),
        HttpCase(
            "vllm_xargs_smuggling",
            BELOW_500,
            (
                Call(c.completion(vllm_xargs={"kv_transfer_params": "x"})),
                Call(c.completion(vllm_xargs={"kv_transfer_params": [1, 2]})),
                Call(c.completion(vllm_xargs={"kv_transfer_params": json.dumps(killer)})),
                Call(c.completion(vllm_xargs={"kv_transfer_params": killer})),
                Call(c.chat(vllm_xargs={"kv_transfer_params": "x"}), "/v1/chat/completions"),
            ),
            short=True,
        ),
        HttpCase(
            "vllm_xargs_falsy",
            BELOW_500,
            tuple(Call(c.completion(vllm_xargs={"kv_transfer_params": v})) for v in (0, "", [])),
            short=True,
            what="values vLLM's own checks pass (falsy) and hand on to the engine's scheduler",
        ),
        HttpCase(
            "do_remote_prefill",
            BELOW_500,
            (
                Call(
                    c.completion(
                        kv_transfer_params={
                            "do_remote_prefill": True,
                            "remote_prefill_cached_tokens": "x",
                            "remote_block_ids": "x",
                        }
                    )
                ),
            ),
            what="NixlConnector's keys, which vLLM's own scheduler reads",
        ),
        HttpCase(
            "deep_nesting",
            BELOW_500,
            (Call(deep_body(c.model, DEEP_LEVELS)),),
            short=True,
        ),
        HttpCase(
            "deep_response_format",
            BELOW_500,
            (
                Call(
                    c.completion(
                        response_format={
                            "type": "json_schema",
                            "json_schema": {"name": "x", "schema": {"x": deep_value}},
                        }
                    )
                ),
            ),
            what="another field that reaches the engine: a JSON schema as deep as deep_params",
        ),
        HttpCase(
            "huge_body",
            BELOW_500,
            (Call(c.completion(user="u" * HUGE_BODY_BYTES)),),
        ),
        HttpCase(
            "huge_cache_salt",
            BELOW_500,
            (Call(c.completion(cache_salt="s" * (1 << 20))),),
            what="a 1 MiB cache_salt (part of every chunk key)",
        ),
        HttpCase(
            "spec_unreachable_host",
            BELOW_500,
            (
                Call(
                    c.completion(
                        kv_transfer_params={"disagg_spec": c.spec(receiver_host="198.51.100.1")}
                    )
                ),
            ),
            what="a consumer that never answers: prefill's handshake ends by its deadline",
        ),
        *RAW_CASES,
        HttpCase(
            "open_path_endless_body",
            frozenset({413}),
            raw=b"POST /health HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            + (b"100000\r\n" + b"x" * (1 << 20) + b"\r\n") * ENDLESS_BODY_MIB,
            short=True,
            what="a chunked body that never ends, on a path open without the key (the guard "
            "read such bodies whole: vLLM's API server grew until it was killed)",
        ),
    ]
    real = c.spec(
        "cmpl-abuse-real",
        receiver_host=c.decode_host,
        receiver_init_port=c.decode_init_port,
        receiver_alloc_port=c.decode_alloc_port,
    )
    what = (
        "a spec naming the real decode with no push behind it: decode waits its "
        "load_timeout_s, then computes the prompt"
        if role == "decode"
        else "a push into the real decode that no decode request will claim (claim_timeout_s)"
    )
    cases.append(
        HttpCase(
            "spec_real_decode_unclaimed",
            BELOW_500,
            (Call(c.completion(kv_transfer_params={"disagg_spec": real})),),
            what=what,
        )
    )
    return cases
