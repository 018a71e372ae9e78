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

    def body(self, model: str, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "max_tokens": OUTPUT_TOKENS, "temperature": 0}
        # A prompt of its own each way: one seen before is held in decode's prefix cache, and
        # served there alone.
        seed = 2 * self.seed + stream
        if self.chat:
            body["messages"] = chat_messages(seed)
            if "ends_with" in self.fields:  # the assistant's answer so far, to go on from
                body["messages"].append({"role": "assistant", "content": self.fields["ends_with"]})
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
    Case("prompt_logprobs", {"prompt_logprobs": 1}, seed=19, alone="prompt_logprobs"),
    Case("best_of", {"best_of": 2}, seed=25),  # not a vLLM 0.32 field: ignored by both
    Case("suffix", {"suffix": " end."}, seed=26, alone="suffix"),
    Case("beam_search", {"use_beam_search": True, "n": 2}, seed=27, alone="n"),
    Case("chat_n2", {"n": 2, "temperature": 1.0, "seed": 5}, chat=True, seed=21, alone="n"),
    Case(
        "chat_usage_in_stream",
        {"stream_options": {"include_usage": True, "continuous_usage_stats": False}},
        chat=True,
        seed=15,
    ),
    # vLLM's own sampling and output fields, each on a request of its own.
    Case("n2_greedy", {"n": 2}, seed=30, alone="n"),
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
]


def ask(client: openai.OpenAI, body: dict[str, Any], chat: bool) -> Answer:
    """The raw JSON answer (a stream: its events' JSON, ``[DONE]`` as the string; the events
    of several choices in choice order, each choice's in its own: how vLLM interleaves them is
    a matter of timing); a refusal as its status and body."""
    resource = client.chat.completions if chat else client.completions
    prompt = "messages" if chat else "prompt"
    known = {name: body[name] for name in ("model", "stream", prompt)}
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
