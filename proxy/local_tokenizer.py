"""The model's own tokenizer inside the proxy, where the model's files are on the proxy's host:
a prompt's token ids for KV routing without a round trip to an instance's ``/tokenize``.

Why: that round trip took ~20 ms a request on this machine (mean of the proxy's placement time,
multi-turn chats of ~2.5k tokens, ``benchmarks/multi_turn.py``), the largest part of what
routing by KV added to TTFT; rendering and encoding here takes a few milliseconds, off the
event loop. It renders a chat as vLLM does (transformers' ``apply_chat_template`` into text, then
that text encoded without special tokens unless the request asks for them) and a text prompt
with them unless the request says otherwise. What it cannot render alike (a chat template of
the request's own, tools, documents, messages that are not plain text) goes to an instance's
``/tokenize`` as before. A wrong guess costs only routing quality: these ids look up the KV
index and are never sent to an instance.

A request's ``chat_template_kwargs`` reach the model's own template as vLLM passes them: only
the template's own variables. A key naming one of ``apply_chat_template``'s parameters
(``chat_template``, ``tokenize``, ``tools``, ``documents``, ...) is never passed here:
transformers would take ``chat_template`` as the template to run, so a client's Jinja would run
in the proxy (the door refuses ``chat_template`` and ``tokenize`` there as vLLM does; the rest
go to an instance's ``/tokenize``).
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

logger = logging.getLogger(__name__)

# Chat request fields that change its tokens in ways rendered only by vLLM's own code.
INSTANCE_ONLY_FIELDS = frozenset({"chat_template", "tools", "documents", "mm_processor_kwargs"})
MESSAGE_FIELDS = frozenset({"role", "content"})


class LocalTokenizer:
    """Token ids of the prompts it can render exactly as the instances do; None for others."""

    def __init__(self, tokenizer: Any) -> None:
        """``tokenizer``: a transformers tokenizer of the served model."""
        self._tokenizer = tokenizer
        self._template_variables = _template_variables(getattr(tokenizer, "chat_template", None))
        parameters = inspect.signature(tokenizer.apply_chat_template).parameters.values()
        self._render_parameters = frozenset(
            p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        )

    @classmethod
    def load(cls, model: str) -> LocalTokenizer | None:
        """The tokenizer of ``model`` (as vLLM was given it: a folder, or a name in the local
        Hugging Face cache), never downloaded; None if it cannot be had here."""
        try:
            from transformers import AutoTokenizer  # seconds to import: only where it is used

            tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
        except Exception as exc:  # no files here, no transformers, a config it cannot read
            logger.info(
                "no local tokenizer for %s (%s): prompts are tokenized by an instance",
                model,
                str(exc)[:200],
            )
            return None
        logger.info("tokenizing prompts for KV routing here, with %s's own tokenizer", model)
        return cls(tokenizer)

    def text(self, prompt: object, add_special_tokens: object) -> list[int] | None:
        """A completion's text prompt's token ids; None for anything else. Never raises: the
        body is a client's."""
        if not isinstance(prompt, str) or not isinstance(add_special_tokens, bool):
            return None
        try:
            return list(self._tokenizer.encode(prompt, add_special_tokens=add_special_tokens))
        except Exception as exc:
            logger.debug("could not tokenize a prompt here: %r", exc)
            return None

    def chat(self, body: dict[str, Any]) -> list[int] | None:
        """A chat request's prompt token ids, or None where only an instance can tell them.
        Never raises: the body is a client's."""
        messages = body.get("messages")
        plain = isinstance(messages, list) and all(
            isinstance(m, dict) and set(m) <= MESSAGE_FIELDS and isinstance(m.get("content"), str)
            for m in messages
        )
        kwargs = body.get("chat_template_kwargs") or {}
        special = body.get("add_special_tokens", False)
        if not plain or INSTANCE_ONLY_FIELDS & set(body) or not isinstance(kwargs, dict):
            return None
        if not isinstance(special, bool) or self._template_variables is None:
            return None
        if self._render_parameters & set(kwargs):
            return None  # a parameter of the render itself, never a client's to set here
        # What vLLM keeps of the kwargs: the template's own variables.
        variables = {k: v for k, v in kwargs.items() if k in self._template_variables}
        try:
            text = self._tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                **variables,
            )
            return list(self._tokenizer.encode(text, add_special_tokens=special))
        except Exception as exc:  # a template's own error on odd messages, among others
            logger.debug("could not tokenize a chat here: %r", exc)
            return None


def _template_variables(template: object) -> frozenset[str] | None:
    """The variables the model's chat template reads (what vLLM passes of a request's
    ``chat_template_kwargs``); None where there is no one template to read them from."""
    if not isinstance(template, str):
        return None
    try:
        import jinja2.meta  # transformers' own dependency, as the import above
        import jinja2.sandbox
        from jinja2.ext import loopcontrols
    except ImportError:
        return None
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(extensions=[loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(template)))
    except jinja2.TemplateError as exc:  # a tag of transformers' own ({% generation %}), say
        logger.info("chat template not read here (%s): chats go to an instance's /tokenize", exc)
        return None
