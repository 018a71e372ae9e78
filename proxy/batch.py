"""A completion of several prompts (a batch), disaggregated one request per prompt.

Each prompt is served as a client request of its own (placed, prefilled, decoded and migrated on
its own, under ``<req_id>-<i>``), and their answers are merged as vLLM 0.32 merges a batch's:
choices numbered by their prompt's place, one id, usage
summed over the prompts. Each prompt has one choice (a batch with ``n`` > 1 is served alone,
``client_request.py``). A whole answer waits for every prompt. A stream opens once every
prompt's part has (a prompt refused refuses the batch, as vLLM refuses a batch before it
streams), then passes on each part's events as they come, renumbered, and ends with one usage
event (where asked) and one ``[DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from lmcache_pd.proxy.client_request import ClientRequest
from lmcache_pd.proxy.metrics import Outcome
from lmcache_pd.proxy.responses import (
    SSE_HEADERS,
    ClientGone,
    OpenStream,
    close_after_done,
    json_response,
    sse,
    write,
)

# Serves one prompt's request: (where its stream goes, the request, its id, its arrival, its
# trace) -> its response and outcome (``Orchestrator._disaggregate``).
ServeOne = Callable[
    [OpenStream, ClientRequest, str, float, dict[str, Any]],
    Awaitable[tuple[web.StreamResponse, Outcome]],
]
USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")
# A part's bytes, or None once the part has ended, tagged with the prompt's place.
_Item = tuple[int, bytes | None]


class _Part(web.StreamResponse):
    """One prompt's stream, kept for the merge instead of sent: each write goes to the batch's
    queue, tagged with the prompt's place."""

    def __init__(self, index: int, queue: asyncio.Queue[_Item]) -> None:
        super().__init__(headers=SSE_HEADERS)
        self._index, self._queue = index, queue

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        self._queue.put_nowait((self._index, bytes(data)))

    async def write_eof(self, data: bytes = b"") -> None:
        """The part's end is its task's (``_run``)."""


async def serve_batch(
    open_stream: OpenStream,
    client: ClientRequest,
    req_id: str,
    serve_one: ServeOne,
    started: float,
    trace: dict[str, Any],
) -> tuple[web.StreamResponse, Outcome]:
    """Answer the batch ``client`` (``ClientRequest.is_batch``) prompt by prompt with
    ``serve_one``, merged; ``trace`` gets each part's trace under ``parts``."""
    queue: asyncio.Queue[_Item] = asyncio.Queue()
    parts = client.parts()
    opened = [asyncio.Event() for _ in parts]
    traces: list[dict[str, Any]] = [{"req_id": f"{req_id}-{i}"} for i in range(len(parts))]
    trace["parts"] = traces

    def opener(index: int) -> OpenStream:
        async def open_part() -> web.StreamResponse:
            opened[index].set()
            return _Part(index, queue)

        return open_part

    async def run(index: int, part: ClientRequest) -> tuple[web.StreamResponse, Outcome]:
        try:
            return await serve_one(opener(index), part, f"{req_id}-{index}", started, traces[index])
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(run(i, part)) for i, part in enumerate(parts)]
    try:
        # The batch's answer is named as one vLLM names it (``ClientRequest.answer_name``).
        name = client.answer_name(req_id)
        if not client.stream:
            return _merged_whole([await task for task in tasks], name)
        refused = await _first_refusal(tasks, opened)
        if refused is not None:
            return refused
        return await _merged_stream(open_stream, client, name, tasks, queue)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _first_refusal(
    tasks: list[asyncio.Future[tuple[web.StreamResponse, Outcome]]], opened: list[asyncio.Event]
) -> tuple[web.StreamResponse, Outcome] | None:
    """Once every part has opened its stream: None; else the first part's answer that ended
    without one (a refusal or an error, the batch's answer)."""
    for task, event in zip(tasks, opened, strict=True):
        waiter = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        if not event.is_set():
            return task.result()
    return None


def _merged_whole(
    answers: list[tuple[web.StreamResponse, Outcome]], name: str
) -> tuple[web.StreamResponse, Outcome]:
    """The parts' whole answers as one, named ``cmpl-NAME``, or the first that is not an
    answer."""
    for response, outcome in answers:
        if outcome is not Outcome.OK or not isinstance(response, web.Response):
            return response, outcome
    bodies = [msgspec.json.decode(response.body) for response, _ in answers]
    choices = [
        choice | {"index": place} for place, body in enumerate(bodies) for choice in body["choices"]
    ]
    merged = bodies[0] | {"id": f"cmpl-{name}", "choices": choices}
    merged["usage"] = _summed([body.get("usage") for body in bodies])
    return json_response(merged), Outcome.OK


def _summed(usages: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """The parts' usage as vLLM counts a batch's: each count summed, the rest the first's."""
    present = [usage for usage in usages if usage]
    if not present:
        return None
    counts = [name for name in USAGE_COUNTS if name in present[0]]
    return present[0] | {name: sum(u.get(name) or 0 for u in present) for name in counts}


async def _merged_stream(
    open_stream: OpenStream,
    client: ClientRequest,
    name: str,
    tasks: list[asyncio.Future[tuple[web.StreamResponse, Outcome]]],
    queue: asyncio.Queue[_Item],
) -> tuple[web.StreamResponse, Outcome]:
    """The parts' events as they come, renumbered, then one usage event and ``[DONE]``."""
    response = await open_stream()
    usage_events: list[dict[str, Any]] = []
    live = len(tasks)
    try:
        while live:
            index, data = await queue.get()
            if data is None:
                live -= 1
                continue
            out = [
                renumbered
                for payload in _payloads(data)
                if (renumbered := _renumbered(payload, index, name, usage_events)) is not None
            ]
            if out:
                await write(response, b"".join(sse(event) for event in out))
        outcomes = [task.result()[1] for task in tasks]
        if client.include_usage and usage_events:
            usage = _summed([event.get("usage") for event in usage_events])
            await write(response, sse(usage_events[-1] | {"usage": usage}))
        await write(response, sse("[DONE]"))
        await close_after_done(response)
    except ClientGone:
        return response, Outcome.CLIENT_DISCONNECTED
    failed = [outcome for outcome in outcomes if outcome is not Outcome.OK]
    return response, failed[0] if failed else Outcome.OK


def _payloads(data: bytes) -> list[bytes]:
    """The events' data in a part's write (``responses.sse``'s, one or more)."""
    return [chunk[len(b"data: ") :] for chunk in data.split(b"\n\n") if chunk.startswith(b"data: ")]


def _renumbered(
    payload: bytes, place: int, name: str, usage_events: list[dict[str, Any]]
) -> dict[str, Any] | bytes | None:
    """A part's event as the batch's stream shows it: its choices numbered by the prompt's
    ``place``, the batch's id. None for what the merge sends once (``[DONE]``, the usage event,
    kept in ``usage_events``); an error event as it is."""
    if payload == b"[DONE]":
        return None
    try:
        event = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return payload
    if not isinstance(event, dict) or "error" in event:
        return payload
    event["id"] = f"cmpl-{name}"
    choices = event.get("choices") or []
    if not choices and event.get("usage") is not None:
        usage_events.append(event)
        return None
    for choice in choices:
        choice["index"] = place
    return event
