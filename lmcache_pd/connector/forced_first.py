"""Decode's first output token made prefill's: a vLLM v1 logits processor.

Decode is sent the client's own request, so its first sampled position is the answer's first
token, which prefill already produced and the client already has. For a request whose
``kv_transfer_params`` name ``first_tok`` (``protocol.KVTransferParams``), this processor
masks every other token at output position 0; from position 1 on it does nothing. So all that
vLLM scopes to the output (penalties, stop strings, ``min_tokens``, grammars, tool-call and
reasoning parsers, usage) sees the one answer one vLLM would produce after that token.

What stays the model's own: vLLM reports logprobs from the raw logits, before any processor
(``logprobs_mode`` ``raw_logprobs``, its default), so the first token's logprob and top
logprobs are decode's model's; and a seeded request draws its random numbers for position 0 as
one vLLM does (the draw happens whatever the logits), so the draws after it line up.

vLLM loads it from the ``vllm.logits_processors`` entry point of this package (every vLLM with
lmcache-pd installed has it; it acts only on requests that name ``first_tok``). A token id past
the model's vocabulary forces nothing (a caller's bytes must not end the engine); the proxy
checks decode's first token and recovers from a mismatch.
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
) -> tuple[int, Sequence[int]] | None:
    """A new request's (token, its live output list), if its first output is forced and not
    yet made."""
    token = KVTransferParams.forced_first_token(params.extra_args)
    if token is None or output:
        return None
    return token, output


class ForcedFirstToken(LogitsProcessor):
    """Masks all but ``first_tok`` at output position 0 of the requests that name one."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, is_pin_memory: bool) -> None:
        # Batch row -> (forced token, the request's output token ids, which vLLM keeps current).
        self._rows: dict[int, tuple[int, Sequence[int]]] = {}

    def is_argmax_invariant(self) -> bool:
        return False  # it changes greedy requests' first token too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self._rows, batch_update, _forced)
        for row in [row for row, (_, output) in self._rows.items() if output]:
            del self._rows[row]  # its first token is made: nothing more to force

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        vocabulary = logits.shape[-1]
        for row, (token, _) in self._rows.items():
            if token < vocabulary:
                logits[row].fill_(float("-inf"))
                logits[row, token] = 0.0
        return logits
