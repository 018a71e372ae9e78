"""Decode's first output tokens made the ones the client has: a vLLM v1 logits processor.

Decode is sent the client's own request, so its first sampled position is the answer's first
token, which prefill already produced and the client already has. For a request whose
``kv_transfer_params`` name ``first_tok`` (``protocol.KVTransferParams``), this processor
masks every other token at output position 0; where they also name ``next_toks`` (a stream
that broke on another decode goes on here, ``proxy/migration.py``), at each of the following
positions the next of them. Past them it does nothing. So all that vLLM scopes to the output
(penalties, stop strings, ``min_tokens``, grammars, tool-call and reasoning parsers, usage)
sees the one answer one vLLM would produce after those tokens.

What stays the model's own: vLLM reports logprobs from the raw logits, before any processor
(``logprobs_mode`` ``raw_logprobs``, its default), so the forced tokens' logprobs and top
logprobs are decode's model's; and a seeded request draws its random numbers for each forced
position as one vLLM does (the draw happens whatever the logits), so the draws after them line
up.

vLLM loads it from the ``vllm.logits_processors`` entry point of this package (every vLLM with
lmcache-pd installed has it; it acts only on requests that name ``first_tok``). A token id past
the model's vocabulary forces nothing (a caller's bytes must not end the engine); the proxy
checks decode's output against the forced tokens and recovers from a mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates

from lmcache_pd.protocol import KVTransferParams

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def _forced(
    params: SamplingParams, _prompt: list[int] | None, output: list[int]
) -> tuple[tuple[int, ...], Sequence[int]] | None:
    """A new request's (forced tokens, its live output list), if some are not yet made."""
    tokens = KVTransferParams.forced_tokens(params.extra_args)
    if len(output) >= len(tokens):
        return None
    return tokens, output


class ForcedTokens(LogitsProcessor):
    """Masks all but the forced token at each of the first output positions of the requests
    that name them."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        # Batch row -> (forced tokens, the request's output token ids, which vLLM keeps current).
        self._rows: dict[int, tuple[tuple[int, ...], Sequence[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes greedy requests' tokens too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, _forced)
        done = [row for row, (tokens, output) in self._rows.items() if len(output) >= len(tokens)]
        for row in done:
            del self._rows[row]  # every forced token is made: nothing more to force

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        vocabulary = logits.shape[-1]
        for row, (tokens, output) in self._rows.items():
            token = tokens[len(output)]
            if token < vocabulary:
                logits[row].fill_(float("-inf"))
                logits[row, token] = 0.0
        return logits
