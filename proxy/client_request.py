"""A client's OpenAI request, checked at the door, and the two requests made of it: prefill's
(one token, non-streaming, with the DisaggSpec) and decode's (the client's own request, whose
first output token must be prefill's, with the same DisaggSpec).

Only the fields the proxy interprets are validated here; every other field goes to prefill and
to decode as the client sent it (vLLM checks those). What vLLM would
read as transfer parameters is the proxy's alone: a client's ``kv_transfer_params`` (but for
LMCache's ``lmcache.*`` request options, passed on beside the proxy's), and what vLLM copies
into the same place (``ec_transfer_params``, and those keys of ``vllm_xargs``, whose keys become
the sampling params' ``extra_args``, where vLLM looks for ``kv_transfer_params``), are refused;
``vllm_xargs`` of other keys (a custom extension's) goes to prefill and decode as sent.
So is a body nested deeper than any OpenAI request is (``MAX_JSON_DEPTH``): it would cost every
JSON parser on its way a deep recursion.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Annotated, Any

import msgspec

from lmcache_pd.errors import ProtocolError
from lmcache_pd.protocol import LMCACHE_PREFIX, KVTransferParams, lmcache_options
from lmcache_pd.request_body import MAX_JSON_DEPTH, nests_deeper

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
TokenIds = list[NonNegative]

# vLLM's default max_tokens for /v1/completions (chat has none: up to the context length).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16

# Fields vLLM reads transfer parameters from (``to_sampling_params`` in its completion and chat
# protocols): the proxy's to set, refused with any value but null; ``kv_transfer_params`` is
# the proxy's too but for LMCache's request options (``client_options``).
TRANSFER_FIELDS = {
    "ec_transfer_params": "ec_transfer_params (transfer parameters are the proxy's to set)",
}
# Keys of ``vllm_xargs`` refused: vLLM puts both fields above into the same ``extra_args``, and
# its engine reads them from there. Any other key is a custom extension's, sent on as it is.
TRANSFER_XARGS = ("kv_transfer_params", "ec_transfer_params")

# Keys of ``chat_template_kwargs`` that vLLM refuses (``resolve_chat_template_kwargs``).
RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize"})

# Fields with which a request is served by decode alone, its own request unchanged (exact, as
# one vLLM serves it; not disaggregated), named as ``not_disaggregated`` counts them: what spans
# several choices (one first token from prefill cannot start them all), what needs the prompt
# computed where it is answered (vLLM reads no cached or loaded KV for prompt logprobs). Tools
# are disaggregated: prefill's one token is constrained as one vLLM constrains it (a named or
# required tool's grammar), and decode's own parser shapes every delta (``shows_first_alone``).
# ``best_of`` is not a field of vLLM 0.32's (it ignores it, as every field it does not know), so
# it is disaggregated as the rest of the request.
ALONE_FIELDS = {
    "use_beam_search": "beam_search",
    "echo": "echo",
    "prompt_logprobs": "prompt_logprobs",
    "suffix": "suffix",
    # vLLM gives an embeddings prompt no token ids, and chunk keys are made of token ids: its
    # pushed KV could not be told from another's. Decode computes it (where vLLM serves
    # embeddings at all: ``--enable-prompt-embeds``).
    "prompt_embeds": "prompt_embeds",
}


class Endpoint(enum.Enum):
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


class BadRequest(Exception):
    """The client's request cannot be served as sent; the message says why."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        kind: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param


# What vLLM 0.32 hides of its error messages' file system paths (``sanitize_message``): one
# under these roots, with the rest of it (name characters, dots, dashes, slashes), and any path
# that ends in a file name with an extension.
_HIDDEN_PATH = re.compile(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+")
_FILE_PATH = re.compile(r"(?:/[\w\-]+)+/[\w\-]+\.\w+")


def unknown_model(name: str, base: str) -> BadRequest:
    """vLLM's own answer to a model name it does not serve (``base``: the model it serves),
    its paths hidden as vLLM hides them."""
    message = f"The model `{name}` does not exist. Valid aliases: {base}."
    message = _FILE_PATH.sub("<path>", _HIDDEN_PATH.sub("<path>", message)).strip()
    return BadRequest(message, status=404, kind="NotFoundError", param="model")


class _StreamOptions(msgspec.Struct):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None  # none: the base model, as vLLM takes it
    cache_salt: Annotated[str, msgspec.Meta(min_length=1)] | None = None
    stream: bool | None = None
    stream_options: _StreamOptions | None = None
    n: Annotated[int, msgspec.Meta(ge=1)] | None = None
    min_tokens: NonNegative | None = None
    max_tokens: Positive | None = None
    request_id: str | None = None


class _CompletionFields(_Common):
    # A text, token ids, or a batch of either (checked in ``_check_prompts``); None: the
    # prompt is ``prompt_embeds``.
    prompt: str | list[Any] | None = None
    logprobs: NonNegative | None = None


class _ContentPart(msgspec.Struct, kw_only=True):
    """A part of a message's content as the proxy reads it (a text part's text; vLLM checks
    the rest, and also takes a plain string as a text part)."""

    type: str | None = None
    text: str | None = None


class _Message(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[str | _ContentPart] | None = None


class _ChatFields(_Common):
    messages: Annotated[list[_Message], msgspec.Meta(min_length=1)]
    chat_template_kwargs: dict[str, Any] | None = None
    max_completion_tokens: Positive | None = None
    logprobs: bool | None = None
    top_logprobs: NonNegative | None = None


def _validate(endpoint: Endpoint, body: dict[str, Any]) -> _CompletionFields | _ChatFields:
    check_transfer_fields(body)
    fields_type = _CompletionFields if endpoint is Endpoint.COMPLETIONS else _ChatFields
    try:
        fields = msgspec.convert(body, fields_type)
    except msgspec.ValidationError as exc:
        raise BadRequest(str(exc)) from exc
    if isinstance(fields, _CompletionFields):
        if fields.prompt is None:
            if body.get("prompt_embeds") in (None, []):  # vLLM's own check and words
                raise BadRequest(
                    "Either prompt or prompt_embeds must be provided and non-empty.",
                    param="prompt",
                )
        else:
            _check_prompts(fields.prompt)
    else:
        _template_kwargs(fields.chat_template_kwargs or {})
    # The prompt is checked: a text or token ids, at most two deep. The rest is walked.
    for name, value in body.items():
        if name != "prompt" and nests_deeper(value, MAX_JSON_DEPTH - 1):
            raise BadRequest(f"`{name}` is nested deeper than {MAX_JSON_DEPTH} levels")
    return fields


def check_transfer_fields(body: dict[str, Any]) -> None:
    """Refuse what vLLM would read as transfer parameters, the proxy's to set: ``TRANSFER_FIELDS``,
    ``vllm_xargs`` carrying ``TRANSFER_XARGS``, and ``kv_transfer_params`` but for LMCache's
    options (``client_options``). Every route that generates reads them (the Responses API's
    too). Raises ``BadRequest`` naming the field."""
    for name, what in TRANSFER_FIELDS.items():
        if body.get(name) is not None:
            raise BadRequest(f"{what} may not be sent to the disaggregating proxy", param=name)
    _check_xargs(body.get("vllm_xargs"))
    client_options(body)


def _check_xargs(xargs: object) -> None:
    """Refuse ``vllm_xargs`` that carry transfer parameters (``TRANSFER_XARGS``), naming the
    key; a value that is not an object is vLLM's to refuse."""
    if not isinstance(xargs, dict):
        return
    for key in TRANSFER_XARGS:
        if key in xargs:
            raise BadRequest(
                f"vllm_xargs.{key} may not be sent to the disaggregating proxy (vLLM reads "
                "transfer parameters from vllm_xargs; the proxy sets those)",
                param="vllm_xargs",
            )


def client_options(body: dict[str, Any]) -> dict[str, Any]:
    """The client's ``kv_transfer_params``, which may hold LMCache's request options only
    (every key ``lmcache.``: its tags and ``lmcache.skip_save``, read by the connector, and
    LMCache's others, meaning nothing here); they go to prefill and decode beside the proxy's
    own. None: {}. Raises ``BadRequest`` naming the key for another key (the proxy's to set)
    or a malformed option (``protocol.lmcache_options``: bounded tags, strings only)."""
    raw = body.get("kv_transfer_params")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadRequest("kv_transfer_params must be an object of lmcache.* options")
    for key in raw:
        if not key.startswith(LMCACHE_PREFIX):
            raise BadRequest(
                f"kv_transfer_params.{key:.40} may not be sent to the disaggregating proxy (the "
                "proxy sets kv_transfer_params, but for LMCache's lmcache.* options)",
                param="kv_transfer_params",
            )
    try:
        lmcache_options(raw)
    except ProtocolError as exc:
        raise BadRequest(str(exc), param="kv_transfer_params") from exc
    return raw


def _template_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse what vLLM refuses in ``chat_template_kwargs``, with its words: a template of the
    request's own, and ``tokenize``. The proxy renders chats with the model's template
    (``local_tokenizer.py``), where transformers would run such a template."""
    if kwargs.get("chat_template") is not None:
        raise BadRequest(
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template "
            "(chat_template_kwargs.chat_template)."
        )
    if unexpected := RESERVED_TEMPLATE_KWARGS & kwargs.keys():
        raise BadRequest(f"Found unexpected chat template kwargs from request: {unexpected}")


def completion_prompt(prompt: str | list[Any]) -> str | list[Any]:
    """A completion's one prompt: a batch of one (a text or token ids, which the door lets
    through) unwrapped; a prompt of token ids, one or many, as it is."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    return prompt


def _check_prompts(prompt: str | list[Any]) -> None:
    """Refuse a malformed prompt: a text, token ids, or a batch of either (each checked)."""
    batch = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    for one in prompt if batch else [prompt]:
        if isinstance(one, str):
            continue
        try:
            msgspec.convert(one, Annotated[TokenIds, msgspec.Meta(min_length=1)])
        except msgspec.ValidationError as exc:
            raise BadRequest(
                f"prompt must be a text, a list of token ids, or a list of either: {exc}"
            ) from exc


def _alone_reason(body: dict[str, Any], fields: _CompletionFields | _ChatFields) -> str | None:
    """Why decode serves the request alone, its own request unchanged (``ALONE_FIELDS``, more
    than one choice, hidden reasoning); None: it is disaggregated (a batch of prompts one
    request per prompt)."""
    if (fields.n or 1) > 1:
        return "n"
    if isinstance(fields, _ChatFields) and body.get("include_reasoning") is False:
        # vLLM then hides every chunk's token ids (where it has a parser), and decode's stream
        # cannot be followed token by token from prefill's first token.
        return "include_reasoning"
    for name, reason in ALONE_FIELDS.items():
        if body.get(name) not in (None, False, [], {}):
            return reason
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class ClientRequest:
    """A validated client request and what the proxy derived from it."""

    endpoint: Endpoint
    body: dict[str, Any]
    # The model named (None: the base model; ``model_names.py`` resolves it at the door).
    model: str | None
    stream: bool
    include_usage: bool
    # Whether every streamed event carries the usage so far (``continuous_usage_stats``).
    continuous_usage: bool
    # Output tokens the client wants in all; None: up to the model's context (chat default).
    max_tokens: int | None
    min_tokens: int
    # Why decode serves it alone, unchanged (``ALONE_FIELDS``); None: disaggregated.
    alone_reason: str | None = None
    # Whether it is one prompt of a batch, its answer merged with the others' (``batch.py``).
    batch_part: bool = False
    # What the client named the request (its ``X-Request-Id`` header, else its ``request_id``),
    # which vLLM names its answer after; None: nothing (``answer_name``).
    named: str | None = None

    @classmethod
    def from_json(cls, endpoint: Endpoint, raw: bytes) -> ClientRequest:
        """Decode the body ``raw`` and ``parse`` it; raises ``BadRequest``."""
        try:
            body = msgspec.json.decode(raw)
        # msgspec raises the latter for bad UTF-8 inside a string
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise BadRequest(f"malformed JSON body: {exc}") from exc
        except RecursionError:  # msgspec's own limit, far deeper than MAX_JSON_DEPTH
            raise BadRequest(f"the body is nested deeper than {MAX_JSON_DEPTH} levels") from None
        return cls.parse(endpoint, body)

    @classmethod
    def parse(cls, endpoint: Endpoint, body: object) -> ClientRequest:
        """Check ``body``; raises ``BadRequest``. Whether its model is served is
        ``model_names.py``'s to say (``unknown_model``)."""
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        fields = _validate(endpoint, body)
        if isinstance(fields, _ChatFields):
            max_tokens = fields.max_completion_tokens or fields.max_tokens
        else:
            max_tokens = fields.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        min_tokens = fields.min_tokens or 0
        if max_tokens is not None and min_tokens > max_tokens:
            # vLLM's own check and words, before prefill is spent on a request decode refuses.
            raise BadRequest(
                f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                f"got {min_tokens}."
            )
        return cls(
            endpoint=endpoint,
            body=body,
            model=fields.model,
            stream=bool(fields.stream),
            include_usage=bool(fields.stream_options and fields.stream_options.include_usage),
            continuous_usage=bool(
                fields.stream_options and fields.stream_options.continuous_usage_stats
            ),
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            alone_reason=_alone_reason(body, fields),
            named=fields.request_id,
        )

    @property
    def is_batch(self) -> bool:
        """Whether it is a completion of several prompts, disaggregated one request per prompt
        (``batch.py``; one served alone for a field goes to decode whole)."""
        prompt = self.body.get("prompt")
        return (
            self.alone_reason is None
            and isinstance(prompt, list)
            and len(prompt) > 1
            and isinstance(prompt[0], str | list)
        )

    def parts(self) -> list[ClientRequest]:
        """A batch's requests, one per prompt in its order, each the client's request with that
        prompt alone."""
        return [
            dataclasses.replace(self, body=self.body | {"prompt": one}, batch_part=True)
            for one in self.body["prompt"]
        ]

    def answer_name(self, req_id: str) -> str:
        """What the instances are told to name the request (``X-Request-Id``), and so its
        answer (``cmpl-NAME``, ``chatcmpl-NAME``): the client's name for it, as one vLLM names
        it, else the proxy's ``req_id``."""
        return req_id if self.named is None else self.named

    @property
    def needs_decode(self) -> bool:
        """False when prefill's one token is the whole answer: no KV needs to move."""
        return self.max_tokens is None or self.max_tokens > 1

    def prefill_body(self, kv_transfer_params: KVTransferParams) -> dict[str, Any]:
        """The client's request, cut to one non-streamed token that returns the prompt's ids."""
        body = {
            key: value
            for key, value in self.body.items()
            if key not in ("stream_options", "max_completion_tokens")
        }
        body |= {
            "stream": False,
            "max_tokens": 1,
            "min_tokens": min(self.min_tokens, 1),
            "return_token_ids": True,
            "kv_transfer_params": client_options(self.body) | kv_transfer_params.to_dict(),
        }
        return body

    def decode_body(self, kv_transfer_params: KVTransferParams) -> dict[str, Any]:
        """The client's own request, with the token ids that show decode's output, and the
        params (where they say anything: the KV pushed for it, the tokens its output must
        begin with). A request served alone for a field (``alone_reason``) goes as it is: its
        answer is passed on unread."""
        if self.alone_reason is not None:
            return self.body
        body = self.body | {"return_token_ids": True}
        if kv_transfer_params != KVTransferParams():
            body["kv_transfer_params"] = client_options(self.body) | kv_transfer_params.to_dict()
        return body

    @property
    def asks_token_ids(self) -> bool:
        """Whether the client asked for token ids in its answer (else they are nulled there)."""
        return self.body.get("return_token_ids") is True
