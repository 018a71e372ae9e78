"""Pools that change while the proxy serves (``membership.py``): what a cluster engine says the
members are is what the proxy routes to, over real HTTP with the official ``openai`` client,
in front of stand-in vLLMs. The engine itself is a stand-in here (``Source``, a list the test
edits); the real one, Ray, is ``tests/test_ray_cluster.py``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import msgspec
import openai
import pytest

from lmcache_pd.harness.app_thread import AppThread, proxy_thread
from lmcache_pd.harness.standin import Standin
from lmcache_pd.proxy.config import KVEventsAddress, proxy_config
from lmcache_pd.proxy.membership import Member, Membership, Outstanding
from lmcache_pd.proxy.routing import Pool, Role
from tests.helpers import free_port, wait_for

MODEL = "tiny"
INTERVAL_S = 0.05


class Source:
    """The engine's answer, as the test sets it; it records every report it hears."""

    interval_s = INTERVAL_S

    def __init__(self, members: list[Member]) -> None:
        self.answer = members
        self.heard: list[Outstanding] = []
        self.failing = False

    async def members(self, outstanding: Outstanding) -> list[Member]:
        self.heard.append(outstanding)
        if self.failing:
            raise ConnectionError("the engine is away")
        return list(self.answer)


class Cluster:
    """Stand-in instances on free ports, and a proxy whose pools a ``Source`` decides."""

    def __init__(self) -> None:
        self._exit = ExitStack()
        self.standins: dict[str, Standin] = {}

    def instance(self, role: str, name: str, alloc_port: int = 2) -> Member:
        standin, port = Standin(), free_port()
        self._exit.enter_context(AppThread(standin.app(), "127.0.0.1", port))
        url = f"http://127.0.0.1:{port}"
        self.standins[name] = standin
        if role == "decode":
            return Member(name, "decode", url, "127.0.0.1", 1, alloc_port)
        return Member(name, "prefill", url)

    def serve(self, source: Source) -> openai.OpenAI:
        first = {m.role: m for m in reversed(source.answer)}
        config = proxy_config(
            {
                "min_disagg_tokens": 0,
                "model": MODEL,
                "port": free_port(),
                "prefill": [{"url": first["prefill"].url}],
                "decode": [
                    {
                        "url": first["decode"].url,
                        "receiver_host": "127.0.0.1",
                        "init_port": 1,
                        "alloc_port": 2,
                    }
                ],
            }
        )
        self.proxy = self._exit.enter_context(proxy_thread(config, source))
        return openai.OpenAI(
            base_url=f"{self.proxy.url}/v1", api_key="none", max_retries=0, timeout=30
        )

    def decode_gauge(self) -> set[str]:
        text = httpx.get(f"{self.proxy.url}/metrics").text
        return {
            line.split('instance="')[1].split('"')[0]
            for line in text.splitlines()
            if line.startswith("lmcache_pd_proxy_instance_up{") and 'role="decode"' in line
        }

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.proxy.url}/metrics").text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        return 0.0

    def received(self, name: str) -> int:
        return len(self.standins[name].state.received)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    yield made
    made._exit.close()


def ask(client: openai.OpenAI, count: int = 1) -> None:
    """``count`` requests one after another, the engine asked in between (routing must not
    start over at each answer it gives)."""
    for _ in range(count):
        client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3)
        time.sleep(3 * INTERVAL_S)


def test_a_decode_instance_that_joins_takes_requests_and_one_that_leaves_takes_none(
    cluster: Cluster,
) -> None:
    prefill, first = cluster.instance("prefill", "p0"), cluster.instance("decode", "d0")
    source = Source([prefill, first])
    client = cluster.serve(source)
    second = cluster.instance("decode", "d1")
    source.answer = [prefill, first, second]
    wait_for(lambda: cluster.decode_gauge() == {first.url, second.url}, timeout_s=5)
    ask(client, 4)
    assert (cluster.received("d0"), cluster.received("d1")) == (2, 2)  # round-robin of equals

    source.answer = [prefill, second]
    wait_for(lambda: cluster.decode_gauge() == {second.url}, timeout_s=5)
    ask(client, 3)
    assert (cluster.received("d0"), cluster.received("d1")) == (2, 5)


def test_requests_at_an_instance_taken_out_are_reported_until_they_end(cluster: Cluster) -> None:
    prefill, decode = cluster.instance("prefill", "p0"), cluster.instance("decode", "d0")
    source = Source([prefill, decode])
    client = cluster.serve(source)
    cluster.standins["d0"].state.first_delay_s = 1.0  # decode holds the request a while
    replacement = cluster.instance("decode", "d1")
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(ask, client)
        wait_for(lambda: cluster.standins["d0"].state.in_flight == 1, timeout_s=5)
        source.answer = [prefill, replacement]  # d0 drains
        wait_for(lambda: cluster.decode_gauge() == {replacement.url}, timeout_s=5)
        heard_at = len(source.heard)
        wait_for(lambda: len(source.heard) > heard_at + 1, timeout_s=5)
        assert source.heard[-1][decode.url] == 1  # gone from the pool, still busy there
        answer.result(timeout=10)
    heard_at = len(source.heard)
    wait_for(lambda: len(source.heard) > heard_at + 1, timeout_s=5)
    assert decode.url not in source.heard[-1]


def test_an_engine_that_does_not_answer_leaves_the_pools_as_they_were(cluster: Cluster) -> None:
    prefill, decode = cluster.instance("prefill", "p0"), cluster.instance("decode", "d0")
    source = Source([prefill, decode])
    client = cluster.serve(source)
    source.failing = True
    wait_for(lambda: cluster.metric("lmcache_pd_proxy_membership_errors_total") >= 3, timeout_s=5)
    ask(client, 2)
    assert cluster.received("d0") == 2 and cluster.decode_gauge() == {decode.url}
    source.failing, source.answer = False, [prefill]  # back, and decode is gone
    wait_for(lambda: cluster.decode_gauge() == set(), timeout_s=5)
    with pytest.raises(openai.APIStatusError) as refused:
        ask(client)
    assert refused.value.status_code == 503


def test_an_instance_back_on_its_address_with_other_kv_ports_gets_them_in_the_spec(
    cluster: Cluster,
) -> None:
    prefill, decode = cluster.instance("prefill", "p0"), cluster.instance("decode", "d0")
    source = Source([prefill, decode])
    client = cluster.serve(source)
    moved = Member(decode.name, "decode", decode.url, "127.0.0.1", 11, 12)
    source.answer = [prefill, moved]
    heard_at = len(source.heard)
    wait_for(lambda: len(source.heard) > heard_at + 1, timeout_s=5)
    ask(client)
    _, _, body = cluster.standins["p0"].state.received[-1]
    spec = body["kv_transfer_params"]["disagg_spec"]
    assert (spec["receiver_init_port"], spec["receiver_alloc_port"]) == (11, 12)


def test_an_instance_back_with_other_kv_event_ports_is_followed_there() -> None:
    """A restarted instance publishes on fresh ports (Ray's): it is a new upstream, with the new
    address, so the KV index stops the old feed and starts one there (``kv_index.sync``)."""
    old = KVEventsAddress("127.0.0.1", 7001, 7002)
    new = KVEventsAddress("127.0.0.1", 7011, 7012)
    member = Member("p0", "prefill", "http://127.0.0.1:9", kv_events=old)
    pools = {Role.PREFILL: Pool(Role.PREFILL, []), Role.DECODE: Pool(Role.DECODE, [])}
    source = Source([member])
    membership = Membership(source, pools, lambda: None)
    assert asyncio.run(membership.refresh())
    [first] = pools[Role.PREFILL].members
    assert first.kv_events == old
    asyncio.run(membership.refresh())  # the same answer keeps the same upstream
    assert pools[Role.PREFILL].members == [first]
    source.answer = [msgspec.structs.replace(member, kv_events=new)]
    asyncio.run(membership.refresh())
    [second] = pools[Role.PREFILL].members
    assert second is not first and second.kv_events == new


def test_an_instance_that_leaves_takes_its_error_series_with_it() -> None:
    """``upstream_errors`` is labelled by instance URL: on a cluster engine, whose instances
    come and go on new addresses, series of instances long gone grew without bound. One that
    leaves its pool loses them; the control: one that stays keeps them."""
    from lmcache_pd.proxy.metrics import ProxyMetrics

    members = [Member(f"d{i}", "decode", f"http://127.0.0.1:{9000 + i}") for i in range(2)]
    pools = {Role.PREFILL: Pool(Role.PREFILL, []), Role.DECODE: Pool(Role.DECODE, [])}
    metrics = ProxyMetrics(lambda: pools[Role.DECODE].members, lambda: 0)
    source = Source(members)
    membership = Membership(source, pools, lambda: None, metrics.forget_instance)
    assert asyncio.run(membership.refresh())
    for upstream in pools[Role.DECODE].members:
        metrics.upstream_error(upstream, "timeout")
        metrics.upstream_error(upstream, "connect")
    source.answer = members[1:]
    asyncio.run(membership.refresh())
    text = metrics.exposition().decode()
    assert "127.0.0.1:9000" not in text and text.count('instance="http://127.0.0.1:9001"') >= 2


def test_an_error_of_an_instance_that_already_left_makes_no_series() -> None:
    """A request in flight on an instance when it leaves (it died: its calls fail after) ends
    after its series were removed: counted under its URL then, the series was never removed
    again. Such an error goes to the log only; the control: one of an instance still there is
    counted."""
    from lmcache_pd.proxy.metrics import ProxyMetrics

    members = [Member(f"d{i}", "decode", f"http://127.0.0.1:{9000 + i}") for i in range(2)]
    pools = {Role.PREFILL: Pool(Role.PREFILL, []), Role.DECODE: Pool(Role.DECODE, [])}
    metrics = ProxyMetrics(lambda: pools[Role.DECODE].members, lambda: 0)
    source = Source(members)
    membership = Membership(source, pools, lambda: None, metrics.forget_instance)
    assert asyncio.run(membership.refresh())
    leaving, staying = pools[Role.DECODE].members
    source.answer = members[1:]
    asyncio.run(membership.refresh())
    metrics.upstream_error(leaving, "broken")  # its request failed after it left
    metrics.upstream_error(staying, "timeout")
    text = metrics.exposition().decode()
    assert "127.0.0.1:9000" not in text and 'instance="http://127.0.0.1:9001"' in text
