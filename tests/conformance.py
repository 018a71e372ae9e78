"""The API conformance cases: the same request to the served pools and to one plain vLLM of the
same model and flags, through the official ``openai`` client, and the whole JSON answers
compared (streamed: every event), ids and timestamps aside, logprobs within the end-to-end
tolerance. Every prompt is long enough to be disaggregated (``MIN_DISAGG_TOKENS``)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import msgspec
import openai

from lmcache_pd.proxy.config import MIN_DISAGG_TOKENS
from tests.vllm_support import LOGPROB_TOLERANCE

# Fields that name one answer, its time and its server, not what it says: vLLM's
# system_fingerprint hashes the server's whole configuration, KV connector and all.
NAMING_FIELDS = frozenset({"id", "created", "system_fingerprint"})
PROMPT_TOKENS = MIN_DISAGG_TOKENS + 44
OUTPUT_TOKENS = 8
BOTH = ("whole", "streamed")

Answer = dict[str, Any] | list[Any]


def token_prompt(seed: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(10, 1500) for _ in range(PROMPT_TOKENS)]


def chat_messages(seed: int) -> list[dict[str, str]]:
    """A chat whose template renders past ``MIN_DISAGG_TOKENS`` tokens."""
    words = random.Random(seed).choices(["alpha", "beta", "gamma", "delta", "list"], k=300)
    return [
        {"role": "system", "content": "You answer in JSON."},
        {"role": "user", "content": " ".join(words)},
    ]


@dataclass(frozen=True)
class Case:
    """One request, sent streamed and whole; ``chat`` picks the endpoint."""

    name: str
    fields: dict[str, Any] = field(default_factory=dict)
    chat: bool = False
    seed: int = 0
    # Why the proxy serves it by decode alone (``ClientRequest.alone_reason``); None: it is
    # disaggregated.
    alone: str | None = None
    # Prompts in its batch (one: not a batch).
    prompts: int = 1
    # The tool its whole answer calls (so that an answer without the call cannot pass).
    calls: str | None = None
    # Prompt tokens vLLM keeps of each prompt (``truncate_prompt_tokens``); None: all.
    kept: int | None = None
    # The modes ("whole", "streamed") in which one vLLM refuses it; in the others it must
    # answer (so that a refusal cannot pass for an answer, nor the reverse).
    refused: tuple[str, ...] = ()
    # Named by the client (``request_id``): its ids are compared too.
    named: bool = False
    # A completion's prompt as a text (of ``chat_messages``' words), not token ids.
    text: bool = False

    @property
    def prompt_tokens(self) -> int:
        """Tokens of each prompt the instance answering it computes or loads."""
        return PROMPT_TOKENS if self.kept is None else self.kept

    def body(self, model: str, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": OUTPUT_TOKENS, "temperature": 0}
        # A prompt of its own each way: one seen before is held in decode's prefix cache, and
        # served there alone.
        seed = 2 * self.seed + stream
        if self.chat:
            body["messages"] = chat_messages(seed)
            if "ends_with" in self.fields:  # the assistant's answer so far, to go on from
                body["messages"].append({"role": "assistant", "content": self.fields["ends_with"]})
        elif "prompt_embeds" in self.fields:
            body["prompt"] = None
        elif self.text:
            body["prompt"] = chat_messages(seed)[1]["content"]
        elif self.prompts > 1:
            body["prompt"] = [token_prompt(seed + 1000 * i) for i in range(self.prompts)]
        else:
            body["prompt"] = token_prompt(seed)
        body |= {k: v for k, v in self.fields.items() if k != "ends_with"} | {"stream": stream}
        if not stream:  # vLLM refuses stream options on a whole answer
            body.pop("stream_options", None)
        return body


JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
    "required": ["name", "size"],
}

# A tool whose call is short: its one argument is one of two words.
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}},
            "required": ["city"],
        },
    },
}
NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}

CASES = [
    Case("greedy_logprobs", {"logprobs": 2}, seed=1),
    Case("seeded_t1.5", {"temperature": 1.5, "seed": 7, "logprobs": 1}, seed=2),
    Case("penalties", {"presence_penalty": 1.5, "frequency_penalty": 1.0}, seed=3),
    Case("repetition_penalty", {"repetition_penalty": 1.5, "logprobs": 1}, seed=4),
    Case("min_tokens", {"min_tokens": 6, "max_tokens": 7}, seed=5),
    Case("usage_in_stream", {"stream_options": {"include_usage": True}}, seed=6),
    Case("token_ids", {"return_token_ids": True}, seed=7),
    Case("logit_bias", {"logit_bias": {"100": 5.0, "101": -100}}, seed=8),
    Case("structured_choice", {"structured_outputs": {"choice": ["yes", "no"]}}, seed=9),
    Case("structured_regex", {"structured_outputs": {"regex": "[a-z]{3}-[0-9]{4}"}}, seed=10),
    Case("chat_greedy", {"logprobs": True, "top_logprobs": 2}, chat=True, seed=11),
    Case("chat_json_object", {"response_format": {"type": "json_object"}}, chat=True, seed=12),
    Case(
        "chat_json_schema",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "t", "schema": JSON_SCHEMA},
            }
        },
        chat=True,
        seed=13,
    ),
    # vLLM guides a required or named tool's call: valid from any model (``SERVER_ARGS``).
    Case(
        "chat_tool_required",
        {"tools": [WEATHER_TOOL], "tool_choice": "required", "max_tokens": 40},
        chat=True,
        seed=22,
        calls="get_weather",
    ),
    Case(
        "chat_tool_named",
        {"tools": [WEATHER_TOOL], "tool_choice": NAMED_TOOL, "max_tokens": 40},
        chat=True,
        seed=23,
        calls="get_weather",
    ),
    Case("chat_tool_auto", {"tools": [WEATHER_TOOL]}, chat=True, seed=29),
    Case("chat_tool_none", {"tools": [WEATHER_TOOL], "tool_choice": "none"}, chat=True, seed=24),
    Case("chat_max_completion_tokens", {"max_completion_tokens": 5}, chat=True, seed=14),
    Case("n2_seeded", {"n": 2, "temperature": 1.0, "seed": 3, "logprobs": 1}, seed=16, alone="n"),
    Case("batch", {"logprobs": 1, "stream_options": {"include_usage": True}}, seed=17, prompts=2),
    Case("batch_echo", {"echo": True, "max_tokens": 3}, seed=28, prompts=2, alone="echo"),
    Case("echo", {"echo": True, "max_tokens": 3}, seed=18, alone="echo"),
    # vLLM refuses prompt logprobs on a stream.
    Case(
        "prompt_logprobs",
        {"prompt_logprobs": 1},
        seed=19,
        alone="prompt_logprobs",
        refused=("streamed",),
    ),
    Case("best_of", {"best_of": 2}, seed=25),  # not a vLLM 0.32 field: ignored by both
    # vLLM 0.32 refuses a suffix to token ids, and to a text for a model without fill-in-the-
    # middle rendering (the tiny model).
    Case("suffix", {"suffix": " end."}, seed=26, alone="suffix", refused=BOTH),
    Case("suffix_text", {"suffix": " end."}, seed=85, alone="suffix", text=True, refused=BOTH),
    # vLLM 0.32 refuses beam search streamed.
    Case(
        "beam_search",
        {"use_beam_search": True, "n": 2},
        seed=27,
        alone="n",
        refused=("streamed",),
    ),
    Case("chat_n2", {"n": 2, "temperature": 1.0, "seed": 5}, chat=True, seed=21, alone="n"),
    Case(
        "chat_usage_in_stream",
        {"stream_options": {"include_usage": True, "continuous_usage_stats": False}},
        chat=True,
        seed=15,
    ),
    # vLLM's own sampling and output fields, each on a request of its own.
    # vLLM 0.32 refuses n > 1 under greedy sampling.
    Case("n2_greedy", {"n": 2}, seed=30, alone="n", refused=BOTH),
    Case(
        "top_k_p_min_p",
        {"temperature": 1.0, "seed": 9, "top_k": 20, "top_p": 0.9, "min_p": 0.05},
        seed=31,
    ),
    Case("stop_token_ids", {"stop_token_ids": [5, 6, 7], "logprobs": 1}, seed=32),
    Case("include_stop_str", {"stop": ["ing"], "include_stop_str_in_output": True}, seed=33),
    Case("ignore_eos", {"ignore_eos": True}, seed=34),
    Case(
        "special_tokens_kept",
        {"skip_special_tokens": False, "spaces_between_special_tokens": False},
        seed=35,
    ),
    Case("allowed_token_ids", {"allowed_token_ids": list(range(100, 300)), "logprobs": 1}, seed=36),
    Case("bad_words", {"bad_words": ["the", " a"]}, seed=37),
    Case("tokens_as_ids", {"logprobs": 2, "return_tokens_as_token_ids": True}, seed=38),
    Case("logprob_token_ids", {"logprobs": 1, "logprob_token_ids": [100, 101]}, seed=39),
    Case("stream_interval", {"stream_interval": 3, "logprobs": 1}, seed=40),
    Case("user", {"user": "someone"}, seed=41),
    Case(
        "chat_continue_final_message",
        {"continue_final_message": True, "add_generation_prompt": False, "ends_with": "Sure,"},
        chat=True,
        seed=42,
    ),
    # vLLM 0.32's other request fields (docs/architecture.md, "Request fields").
    Case(
        "truncate_prompt_tokens", {"truncate_prompt_tokens": 280, "logprobs": 1}, seed=43, kept=280
    ),
    Case(
        "truncate_right",
        {"truncate_prompt_tokens": 270, "truncation_side": "right", "logprobs": 1},
        seed=44,
        kept=270,
    ),
    Case(
        "chat_truncate_prompt_tokens", {"truncate_prompt_tokens": 280}, chat=True, seed=45, kept=280
    ),
    # vLLM 0.32 takes any priority under its default policy (FCFS), which orders nothing by it.
    Case("priority", {"priority": 1}, seed=46),
    Case("chat_priority", {"priority": -1}, chat=True, seed=47),
    # vLLM refuses embeddings unless started with --enable-prompt-embeds (before reading them).
    Case(
        "prompt_embeds_refused",
        {"prompt_embeds": "AAAA"},
        seed=48,
        alone="prompt_embeds",
        refused=BOTH,
    ),
    Case(
        "repetition_detection",
        {
            "repetition_detection": {"max_pattern_size": 3, "min_count": 2},
            "ignore_eos": True,
            "max_tokens": 24,
            "logprobs": 1,
        },
        seed=49,
    ),
    # vLLM refuses a thinking budget without a reasoning parser (--reasoning-parser): whole, a
    # 400; streamed, an error event in a 200 stream.
    Case("thinking_token_budget_refused", {"thinking_token_budget": 4}, seed=50, refused=BOTH),
    Case(
        "chat_thinking_token_budget_refused",
        {"thinking_token_budget": 4},
        chat=True,
        seed=51,
        refused=BOTH,
    ),
    Case("cache_salt", {"cache_salt": "tenant-a", "logprobs": 1}, seed=52),
    Case("chat_cache_salt", {"cache_salt": "tenant-b"}, chat=True, seed=53),
    # LMCache's request options, the only kv_transfer_params a client may send (vLLM without a
    # connector ignores them).
    Case("lmcache_options", {"kv_transfer_params": {"lmcache.tag.tenant": "a"}}, seed=54),
    # A custom extension's arguments (vLLM copies them into the sampling params' extra_args).
    Case("vllm_xargs", {"vllm_xargs": {"colour": "blue", "sizes": [1, 2]}}, seed=55),
    Case("chat_vllm_xargs", {"vllm_xargs": {"colour": "red"}}, chat=True, seed=56),
    # vLLM names the answer after it: cmpl-NAME, chatcmpl-NAME.
    Case("request_id", {"request_id": "named-by-client"}, seed=57, named=True),
    Case("chat_request_id", {"request_id": "named-chat"}, chat=True, seed=58, named=True),
    # Without a watermark configuration (a GPU worker's) vLLM applies none.
    Case("watermarking", {"watermarking": True, "temperature": 1.0, "seed": 4}, seed=59),
    Case(
        "beam_length_penalty",
        {"use_beam_search": True, "n": 2, "length_penalty": 0.5},
        seed=60,
        alone="n",
        refused=("streamed",),
    ),
    Case("response_format_json", {"response_format": {"type": "json_object"}}, seed=61),
    Case("session_id", {"session_id": "session-1"}, seed=62),
    Case("add_special_tokens_text", {"add_special_tokens": False}, seed=86, text=True),
    # What vLLM reads only on its render endpoints or for a mixture of experts' routing.
    Case(
        "render_only_fields",
        {"return_token_offsets": True, "mm_payload": "none", "routed_experts_prompt_start": 1},
        seed=63,
    ),
    # The sampling and output fields completions share with chat, on chat.
    Case(
        "chat_sampling",
        {
            "temperature": 1.0,
            "seed": 5,
            "top_k": 20,
            "top_p": 0.9,
            "min_p": 0.05,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"100": 3.0},
            "min_tokens": 4,
            "logprobs": True,
            "top_logprobs": 1,
        },
        chat=True,
        seed=64,
    ),
    Case(
        "chat_stops",
        {
            "stop": ["e"],
            "include_stop_str_in_output": True,
            "stop_token_ids": [5, 6, 7],
            "ignore_eos": True,
        },
        chat=True,
        seed=65,
    ),
    Case(
        "chat_token_fields",
        {
            "allowed_token_ids": list(range(100, 300)),
            "bad_words": ["the"],
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "return_token_ids": True,
            "logprobs": True,
            "top_logprobs": 2,
            "return_tokens_as_token_ids": True,
            "logprob_token_ids": [100, 101],
        },
        chat=True,
        seed=66,
    ),
    Case(
        "chat_structured_outputs",
        {"structured_outputs": {"regex": "[a-z]{3}-[0-9]{4}"}},
        chat=True,
        seed=67,
    ),
    Case(
        "chat_stream_interval_user_session",
        {"stream_interval": 3, "user": "someone", "session_id": "s-2", "watermarking": True},
        chat=True,
        seed=68,
    ),
    Case(
        "chat_prompt_logprobs",
        {"prompt_logprobs": 1},
        chat=True,
        seed=69,
        alone="prompt_logprobs",
        refused=("streamed",),
    ),
    Case(
        "chat_beam_search",
        {"use_beam_search": True, "n": 2, "length_penalty": 0.5},
        chat=True,
        seed=70,
        alone="n",
    ),
    Case("chat_echo", {"echo": True}, chat=True, seed=71, alone="echo"),
    Case("chat_reasoning_effort", {"reasoning_effort": "low"}, chat=True, seed=72),
    # vLLM then hides the token ids of a stream's chunks (it has a parser: the tool parser's).
    Case(
        "chat_include_reasoning_false",
        {"include_reasoning": False, "logprobs": True},
        chat=True,
        seed=83,
        alone="include_reasoning",
    ),
    Case(
        "chat_parallel_tool_calls",
        {
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 40,
        },
        chat=True,
        seed=73,
        calls="get_weather",
    ),
    Case(
        "chat_documents", {"documents": [{"title": "Oslo", "text": "A city."}]}, chat=True, seed=74
    ),
    # vLLM refuses a request's own template unless started with --trust-request-chat-template.
    Case("chat_template_refused", {"chat_template": "{{ 'x' }}"}, chat=True, seed=75, refused=BOTH),
    Case("chat_mm_processor_kwargs", {"mm_processor_kwargs": {}}, chat=True, seed=76),
    # vLLM refuses per-request media_io_kwargs unless started to allow them.
    Case(
        "chat_media_io_kwargs_refused",
        {"media_io_kwargs": {"image": {}}},
        chat=True,
        seed=84,
        refused=BOTH,
    ),
    Case("chat_return_prompt_text", {"return_prompt_text": True}, chat=True, seed=77),
    Case("chat_add_special_tokens", {"add_special_tokens": True}, chat=True, seed=78),
    Case(
        "chat_render_only_fields",
        {
            "return_token_offsets": True,
            "mm_payload": "none",
            "return_mm_kwargs": False,
            "routed_experts_prompt_start": 1,
        },
        chat=True,
        seed=79,
    ),
    Case(
        "chat_repetition_detection",
        {
            "repetition_detection": {"max_pattern_size": 3, "min_count": 2},
            "ignore_eos": True,
            "max_tokens": 24,
        },
        chat=True,
        seed=80,
    ),
    # Every streamed event with the usage so far.
    Case(
        "continuous_usage",
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        seed=81,
    ),
    Case(
        "chat_continuous_usage",
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        chat=True,
        seed=82,
    ),
]


def ask(client: openai.OpenAI, body: dict[str, Any], chat: bool) -> Answer:
    """The raw JSON answer (a stream: its events' JSON, ``[DONE]`` as the string; the events
    of several choices in choice order, each choice's in its own: how vLLM interleaves them is
    a matter of timing); a refusal as its status and body."""
    resource = client.chat.completions if chat else client.completions
    prompt = "messages" if chat else "prompt"
    known = {name: body.get(name) for name in ("model", "stream", prompt)}
    extra = {name: value for name, value in body.items() if name not in known}
    try:
        raw = resource.with_raw_response.create(**known, extra_body=extra)
    except openai.APIStatusError as exc:
        return {"status": exc.status_code, "refusal": exc.response.json()}
    if not body["stream"]:
        return msgspec.json.decode(raw.http_response.read())
    events: list[Any] = []
    for line in raw.http_response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else msgspec.json.decode(data))
    return sorted(events, key=_choice_index)


def response_ids(answer: Answer) -> list[str]:
    """The ids a Responses API answer names itself by (whole: its own; streamed: its events'
    response's)."""
    if isinstance(answer, dict) and "events" in answer:
        return [event["response"]["id"] for event in answer["events"] if "response" in event]
    return [answer["id"]] if isinstance(answer, dict) and "id" in answer else []


def refused(answer: Answer) -> bool:
    """Whether ``answer`` is a refusal: a 4xx, or a stream of an error event."""
    if isinstance(answer, dict):
        return "refusal" in answer
    return bool(answer) and isinstance(answer[0], dict) and "error" in answer[0]


def _choice_index(event: Any) -> float:
    choices = event.get("choices") if isinstance(event, dict) else None
    return choices[0]["index"] if choices else float("inf")


def differences(
    got: Any, want: Any, where: str = "", naming: frozenset[str] = NAMING_FIELDS
) -> list[str]:
    """Where ``got`` is not ``want``: ``naming`` fields aside, floats within the tolerance."""
    if isinstance(want, dict) and isinstance(got, dict):
        keys = (got.keys() | want.keys()) - naming
        return [
            found
            for key in sorted(keys)
            for found in (
                differences(got[key], want[key], f"{where}.{key}", naming)
                if key in got and key in want
                else [f"{where}.{key}: {'missing' if key in want else 'extra'}"]
            )
        ]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{where}: {len(got)} items, not {len(want)}"]
        return [
            d
            for i, (g, w) in enumerate(zip(got, want, strict=True))
            for d in differences(g, w, f"{where}[{i}]", naming)
        ]
    if isinstance(want, float) and isinstance(got, float) and not isinstance(got, bool):
        return [] if abs(got - want) <= LOGPROB_TOLERANCE else [f"{where}: {got} != {want}"]
    return [] if got == want else [f"{where}: {got!r:.80} != {want!r:.80}"]


def called_tools(answer: Answer) -> list[str]:
    """The names of the tools a whole chat answer calls, with their arguments' JSON checked."""
    assert isinstance(answer, dict) and "choices" in answer, answer
    calls = answer["choices"][0]["message"].get("tool_calls") or []
    for call in calls:
        msgspec.json.decode(call["function"]["arguments"])
    return [call["function"]["name"] for call in calls]


def stop_spanning_two_tokens(answer: dict[str, Any]) -> str:
    """A stop string made of the end of an answer's first token and the start of its second."""
    tokens = answer["choices"][0]["logprobs"]["tokens"]
    return tokens[0][-2:] + tokens[1][:2]


# ---- the Responses API (/v1/responses), served by decode alone ----

# What names a Responses API answer and its parts (ids, times), not what it says.
RESPONSES_NAMING = NAMING_FIELDS | {"created_at", "item_id", "call_id"}
RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL["function"]}


@dataclass(frozen=True)
class ResponsesCase:
    """One /v1/responses request, sent streamed and whole."""

    name: str
    fields: dict[str, Any] = field(default_factory=dict)
    refused: bool = False

    def body(self, model: str, stream: bool) -> dict[str, Any]:
        base = {
            "model": model,
            "input": "Tell me a story about a lighthouse",
            "max_output_tokens": OUTPUT_TOKENS,
            "temperature": 0,
        }
        return base | self.fields | {"stream": stream}


RESPONSES_CASES = [
    ResponsesCase("string_input"),
    ResponsesCase(
        "messages_and_instructions",
        {
            "input": [
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": [{"type": "input_text", "text": "Another one."}]},
            ],
            "instructions": "You answer in one word.",
        },
    ),
    ResponsesCase("seeded_sampling", {"temperature": 1.2, "top_p": 0.9, "seed": 7}),
    ResponsesCase(
        "tool_required",
        {"tools": [RESPONSES_TOOL], "tool_choice": "required", "max_output_tokens": 40},
    ),
    ResponsesCase(
        "json_schema",
        {
            "text": {"format": {"type": "json_schema", "name": "t", "schema": JSON_SCHEMA}},
            "max_output_tokens": 40,
        },
    ),
    ResponsesCase("store_false", {"store": False}),
    # vLLM keeps no response without VLLM_ENABLE_RESPONSES_API_STORE (off by default).
    ResponsesCase("previous_response_id", {"previous_response_id": "resp_0"}, refused=True),
    ResponsesCase(
        "include_logprobs", {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
    ),
    ResponsesCase("truncation_auto", {"truncation": "auto"}),
    ResponsesCase("metadata", {"metadata": {"tenant": "a"}}),
    ResponsesCase("user", {"user": "someone"}),
    # vLLM names the response after it.
    ResponsesCase("request_id", {"request_id": "resp_named_by_client"}),
    ResponsesCase(
        "sampling_fields",
        {
            "temperature": 1.0,
            "seed": 3,
            "top_k": 20,
            "min_p": 0.05,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.2,
            "logit_bias": {"100": 3.0},
            "stop": ["e"],
            "include_stop_str_in_output": True,
            "stop_token_ids": [5, 6, 7],
            "ignore_eos": True,
            "skip_special_tokens": False,
        },
    ),
    ResponsesCase(
        "bookkeeping_fields",
        {
            "service_tier": "auto",
            "prompt_cache_key": "k",
            "session_id": "s-3",
            "priority": 1,
            "cache_salt": "tenant-c",
            "watermarking": True,
            "parallel_tool_calls": False,
            "max_tool_calls": 2,
            "include_reasoning": False,
            "mm_processor_kwargs": {},
            "mm_payload": "none",
            "return_mm_kwargs": False,
            "chat_template_kwargs": {},
        },
    ),
    ResponsesCase("structured_outputs", {"structured_outputs": {"choice": ["yes", "no"]}}),
    ResponsesCase("enable_response_messages", {"enable_response_messages": True}),
    # vLLM keeps no response to run in the background without its store.
    ResponsesCase("background", {"background": True}, refused=True),
    ResponsesCase("media_io_kwargs", {"media_io_kwargs": {"image": {}}}, refused=True),
]


def ask_responses(client: openai.OpenAI, body: dict[str, Any]) -> Answer:
    """The raw JSON answer; streamed, its events but the deltas (vLLM joins deltas while its
    reader lags, so their count and the events' sequence numbers are timing's), and each kind
    of delta joined (its text, its logprobs); a refusal as its status and body."""
    known = {name: body[name] for name in ("model", "input", "stream")}
    extra = {name: value for name, value in body.items() if name not in known}
    try:
        raw = client.responses.with_raw_response.create(**known, extra_body=extra)
    except openai.APIStatusError as exc:
        return {"status": exc.status_code, "refusal": exc.response.json()}
    if not body["stream"]:
        return msgspec.json.decode(raw.http_response.read())
    events = [
        msgspec.json.decode(line[len("data: ") :])
        for line in raw.http_response.iter_lines()
        if line.startswith("data: ")
    ]
    deltas: dict[str, dict[str, Any]] = {}
    rest = []
    for event in events:
        if event["type"].endswith(".delta"):
            joined = deltas.setdefault(event["type"], {"delta": "", "logprobs": []})
            joined["delta"] += event["delta"]
            joined["logprobs"] += event.get("logprobs") or []
        else:
            rest.append({k: v for k, v in event.items() if k != "sequence_number"})
    return {"events": rest, "deltas": deltas}
