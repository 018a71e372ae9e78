"""Decode's forcing logits processor on vLLM's own batch updates: the named tokens alone at
the first output positions, nothing after, nothing for requests that name none. (Its effect on
a real engine, the raw logprobs and the seeded draws, is checked end to end in
test_e2e_vllm.py.)"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate

from lmcache_pd.connector.forced_tokens import ForcedTokens

pytestmark = pytest.mark.processes  # importing vLLM starts a process
VOCAB = 16


def added(index: int, first_tok: object, output: list[int], then: tuple = ()) -> tuple:
    params = {"first_tok": first_tok} | ({"next_toks": list(then)} if then else {})
    return (index, SamplingParams(extra_args={"kv_transfer_params": params}), [1, 2, 3], output)


def update(*adds: tuple, removed: tuple[int, ...] = ()) -> BatchUpdate:
    return BatchUpdate(batch_size=4, removed=list(removed), added=list(adds), moved=[])


def test_only_the_named_token_is_left_at_the_first_output_position() -> None:
    processor = ForcedTokens(None, torch.device("cpu"), False)  # type: ignore[arg-type]
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
    processor = ForcedTokens(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    processor.update_state(update(added(0, 3, []), added(1, 4, [])))
    processor.update_state(update(removed=(0,)))
    out = processor.apply(torch.zeros(4, VOCAB))
    assert not torch.isinf(out[0]).any() and out[1].argmax() == 4


def test_a_continued_stream_is_forced_token_by_token_then_left_alone() -> None:
    """A stream continued on another decode (``next_toks``): each forced token in turn at its
    position, whatever the output list held when the request joined the batch."""
    processor = ForcedTokens(None, torch.device("cpu"), False)  # type: ignore[arg-type]
    output: list[int] = []
    processor.update_state(update(added(0, 5, output, then=(9, 2))))
    for token in (5, 9, 2):
        assert processor.apply(torch.randn(4, VOCAB))[0].argmax() == token
        output.append(token)
        processor.update_state(None)
    logits = torch.randn(4, VOCAB)
    assert torch.equal(processor.apply(logits.clone()), logits)
