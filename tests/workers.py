"""How `make test` shares the suite between its two workers (pytest-xdist, ``-n 2
--no-loadscope-reorder``): a vLLM start is mostly one process importing at a time, so one
worker alone leaves a core idle.

Every module that starts vLLM (``VLLM_MODULES``) is one unit of work, run by one worker in
order, as a run without workers would: their instances are what fills memory (a vLLM worker
process holds ~1.7 GiB here, an instance ~2.8 GiB; two modules' pools at once ran 24 GiB out
and the kernel killed instances), and that one worker starts the reference vLLM once. Every
other module is a unit of its own (its module fixtures start once), run by whichever worker is
free; the vLLM unit goes first, and the rest fills the core its imports and requests leave idle.

The units are told apart by module name, as pytest-xdist's scheduler sees only test ids (its
own ``xdist_group`` marks reach it through ids that pytest 9.2 no longer lets a plugin change);
collection refuses a module with a ``vllm`` mark that the list lacks.
"""

from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

from tests.lanes import lane_rank

VLLM_MODULES = frozenset(
    {
        "test_abuse",
        "test_bench_serving",
        "test_chaos",
        "test_drain_vllm",
        "test_e2e_mla",
        "test_e2e_tp",
        "test_e2e_vllm",
        "test_fleet_bench",
        "test_kv_routing",
        "test_launcher",
        "test_lmcache_proxy_vllm",
        "test_lora_vllm",
        "test_nixl_baseline",
        "test_proxy_vllm",
        "test_ray_cluster",
        "test_vision_vllm",
    }
)


class ModulesThenVLLM(LoadScopeScheduling):
    """pytest-xdist's scheduling by scope, with a module as the scope and the vLLM modules as
    one."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return "vllm" if Path(module).stem in VLLM_MODULES else module


def order_for_workers(items: list[pytest.Item]) -> None:
    """Order ``items`` by lane (vLLM, other processes, fast), each module whole; refuse a
    module with a vLLM test that ``VLLM_MODULES`` lacks (a worker would run it beside the
    others)."""
    rank: dict[Path, int] = {}
    for item in items:
        rank[item.path] = min(rank.get(item.path, len(items)), lane_rank(item))
    unlisted = sorted(
        path.stem for path, lane in rank.items() if lane == 0 and path.stem not in VLLM_MODULES
    )
    if unlisted:
        raise pytest.UsageError(
            f"a vLLM module missing from tests/workers.py VLLM_MODULES: {unlisted}"
        )
    items.sort(key=lambda item: rank[item.path])  # stable: a module's own order stays
