"""Decode's forcing logits processor on vLLM's own batch updates: the named token alone at
output position 0, nothing after, nothing for requests that name none. (Its effect on a real
engine, the raw logprobs and the seeded draws, is checked end to end in test_e2e_vllm.py.)"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from lmcache_pd.connector.forced_first import ForcedFirstToken

pytestmark = pytest.mark.processes  # importing vLLM starts a process
VOCAB = 16


def added(index: int, first_tok: object, output: list[int]) -> tuple:
    params = SamplingParams(extra_args={"kv_transfer_params": {"first_tok": first_tok}})
    return (index, params, [1, 2, 3], output)


def update(*adds: tuple, removed: tuple[int, ...] = ()) -> BatchUpdate:
    return BatchUpdate(batch_size=4, removed=list(removed), added=list(adds), moved=[])


def test_only_the_named_token_is_left_at_the_first_output_position() -> None:
    processor = ForcedFirstToken(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    forced, plain, hostile = [], [], []
    processor.update_state(
        update(added(0, 5, forced), (1, SamplingParams(), None, plain), added(2, 10**6, hostile))
    )
    logits = torch.randn(4, VOCAB)
    before = logits.clone()
    out = processor.apply(logits)
    assert torch.isinf(out[0]).sum() == VOCAB - 1 and out[0].argmax() == 5
    assert torch.equal(out[1], before[1])  # a request that names no token: untouched
    assert torch.equal(out[2], before[2])  # a token past the vocabulary forces nothing
    forced.append(5)  # vLLM appends the sampled token: position 0 is done
    processor.update_state(None)
    logits = torch.randn(4, VOCAB)
    assert torch.equal(processor.apply(logits.clone()), logits)


def test_a_request_removed_or_moved_is_forced_where_it_is_now() -> None:
    processor = ForcedFirstToken(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    processor.update_state(update(added(0, 3, []), added(1, 4, [])))
    processor.update_state(update(removed=(0,)))
    out = processor.apply(torch.zeros(4, VOCAB))
    assert not torch.isinf(out[0]).any() and out[1].argmax() == 4
