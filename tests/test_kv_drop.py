"""The proxy's drop notices to decode: bounded however many requests end at once."""

from __future__ import annotations

import asyncio

from lmcache_pd.protocol import DisaggSpec
from lmcache_pd.proxy.kv_drop import MAX_DROPS_IN_FLIGHT, KVDropper
from tests.helpers import free_port


def test_drop_notices_in_flight_are_bounded_and_the_rest_counted() -> None:
    """A burst of ended requests toward a decode that never answers opened a socket each for
    up to the drop deadline, without bound; past ``MAX_DROPS_IN_FLIGHT`` a notice is skipped
    and counted (its pages come back at decode's claim timeout)."""
    skipped: list[int] = []
    nobody = DisaggSpec("pd-x", "127.0.0.1", free_port(), free_port())

    async def burst() -> int:
        dropper = KVDropper(skipped=lambda: skipped.append(1))
        for _ in range(MAX_DROPS_IN_FLIGHT + 10):
            dropper.drop(nobody, "client gone")
        in_flight = len(dropper._tasks)
        for task in list(dropper._tasks):
            task.cancel()
        await dropper.close()
        return in_flight

    assert asyncio.run(burst()) == MAX_DROPS_IN_FLIGHT
    assert len(skipped) == 10


def test_every_notice_to_one_decode_rank_goes_on_one_socket_and_is_acknowledged() -> None:
    """Fifty requests ending at once toward one decode rank: one DEALER (a CURVE handshake per
    notice cost a connection each), every notice acknowledged, matched by its request id."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_proxy import AllocChannel

    channel = AllocChannel()
    specs = [DisaggSpec(f"pd-{i}", "127.0.0.1", free_port(), channel.port) for i in range(50)]

    async def burst() -> tuple[list[bool], int]:
        dropper = KVDropper()
        try:
            told = await asyncio.gather(*(dropper._send(spec, "client gone") for spec in specs))
            return told, len(dropper._ranks)
        finally:
            await dropper.close()

    try:
        with ThreadPoolExecutor(1) as thread:
            heard = thread.submit(channel.receive, 2.0)
            told, sockets = asyncio.run(burst())
        assert all(told) and sockets == 1
        assert sorted(n.req_id for n in heard.result()) == sorted(s.req_id for s in specs)
    finally:
        channel.close()
