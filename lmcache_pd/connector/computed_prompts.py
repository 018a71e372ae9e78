"""Which prompts decode computes itself, and when each is done: the scheduler's side of decode
keeping what it computed.

A request decode serves alone computes its prompt past what it held (its prefix cache's hit and
the chunks it loaded from its consumer). vLLM keeps those blocks only while nothing needs the
room, so a conversation's next turn, sent to the same decode, finds its history evicted and
computes it again (on the multi-turn benchmark's small-cache pools, 420-470 prompt tokens per
follow-up served alone, of ~200 the turn added). Once the step that computes the prompt's last
token is scheduled, its whole chunks past what decode held go to the worker as a
``KeepRequest``: the worker copies them into the consumer's cache after that step's forward pass
(``wait_for_save``), while the request, still running, holds its blocks, and they stay there as
chunks pushed to decode do: a second tier that later requests load from
(``landed_chunks.py``) and that the proxy hears of (``landed_events.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lmcache_pd.connector.metadata import KeepRequest
from lmcache_pd.keys import MMItems

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


@dataclass(slots=True)
class _Computing:
    prompt: list[int]
    cache_salt: str | None
    lora: str | None
    tags: tuple[tuple[str, str], ...] = ()
    mm: MMItems = ()
    start: int = -1  # where its first chunk decode computes begins (-1: not scheduled yet)
    blocks: list[int] = field(default_factory=list)


class ComputedPrompts:
    """The running requests decode serves alone, until their prompt is computed. Bounded by
    the requests vLLM runs at once: each is forgotten when kept or finished."""

    def __init__(self, chunk_size: int) -> None:
        self._chunk_size = chunk_size
        self._computing: dict[str, _Computing] = {}

    def track(
        self,
        req_id: str,
        prompt: list[int],
        cache_salt: str | None,
        lora: str | None = None,
        tags: tuple[tuple[str, str], ...] = (),
        mm: MMItems = (),
    ) -> None:
        """Decode serves ``req_id`` alone: keep its prompt's chunks once computed (under keys
        of its salt, LoRA adapter, LMCache tags and images). A prompt shorter than a chunk has
        none to keep."""
        if len(prompt) >= self._chunk_size:
            self._computing.setdefault(req_id, _Computing(prompt, cache_salt, lora, tags, mm))

    def forget(self, req_id: str) -> None:
        self._computing.pop(req_id, None)

    def keeps(self, output: SchedulerOutput) -> list[KeepRequest]:
        """The prompts this step finishes computing, with their blocks as of this step."""
        scheduled = output.num_scheduled_tokens
        done: list[tuple[str, _Computing]] = []
        for new in output.scheduled_new_reqs:
            computing = self._computing.get(new.req_id)
            if computing is None:
                continue
            # What it held when scheduled: its prefix-cache hit and what it loaded.
            held = new.num_computed_tokens
            computing.start = held - held % self._chunk_size
            computing.blocks = list(new.block_ids[0])
            if held + scheduled.get(new.req_id, 0) >= len(computing.prompt):
                done.append((new.req_id, computing))
        cached = output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            computing = self._computing.get(req_id)
            if computing is None or computing.start < 0:
                continue
            added = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:  # after a preemption: a fresh set of blocks
                computing.blocks = list(added[0]) if added else []
            elif added:
                computing.blocks.extend(added[0])
            computed = cached.num_computed_tokens[index] + scheduled.get(req_id, 0)
            if computed >= len(computing.prompt):
                done.append((req_id, computing))
        keeps = []
        for req_id, computing in done:
            del self._computing[req_id]
            end = len(computing.prompt) - len(computing.prompt) % self._chunk_size
            if end > computing.start:
                keeps.append(
                    KeepRequest(
                        req_id,
                        computing.prompt[:end],
                        computing.blocks,
                        computing.start,
                        computing.cache_salt,
                        computing.lora,
                        computing.tags,
                        computing.mm,
                    )
                )
        return keeps
