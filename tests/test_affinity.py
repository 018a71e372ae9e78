"""Our threads leave the core vLLM pinned its inference to."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from lmcache_pd.affinity import parse_cpus, unpin_this_thread
from lmcache_pd.config import load_config
from lmcache_pd.deploy.vllm_server import VLLMServer
from lmcache_pd.errors import ConfigError

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity"), reason="thread affinity is Linux-only"
)


def affinity_of_a_thread_started_from_a_pinned_one(cpus: str | None, unpin: bool) -> set[int]:
    """As vLLM's worker: the starting thread is pinned to one CPU, the new one may unpin."""
    seen: list[set[int]] = []

    def child() -> None:
        if unpin:
            unpin_this_thread(cpus, "test thread")
        seen.append(os.sched_getaffinity(0))

    def pinned_parent() -> None:
        os.sched_setaffinity(0, {0})
        thread = threading.Thread(target=child)
        thread.start()
        thread.join(5)

    parent = threading.Thread(target=pinned_parent)
    parent.start()
    parent.join(5)
    return seen[0]


def test_a_thread_started_by_a_pinned_thread_leaves_its_core() -> None:
    everything = set(range(os.cpu_count() or 1))
    assert affinity_of_a_thread_started_from_a_pinned_one(None, unpin=False) == {0}  # control
    assert affinity_of_a_thread_started_from_a_pinned_one(None, unpin=True) == everything


def test_thread_cpus_chooses_where_they_run() -> None:
    assert affinity_of_a_thread_started_from_a_pinned_one("0", unpin=True) == {0}


@pytest.mark.parametrize(("text", "cpus"), [("0", {0}), ("0-2,5", {0, 1, 2, 5}), ("3,1", {1, 3})])
def test_cpu_lists_are_read_as_linux_writes_them(text: str, cpus: set[int]) -> None:
    assert parse_cpus(text) == cpus


@pytest.mark.parametrize("text", ["", "a", "1-", "1,,2", "3-1"])
def test_a_bad_cpu_list_is_refused_naming_the_setting(text: str) -> None:
    with pytest.raises(ConfigError, match="thread_cpus"):
        parse_cpus(text)


@pytest.mark.parametrize("written", ["thread_cpus: 1", "thread_cpus: '1'"])
def test_one_cpu_written_bare_in_yaml_is_a_cpu_list(tmp_path, written: str) -> None:
    """YAML reads ``1`` as a number; the environment's ``LMCACHE_PD_THREAD_CPUS=1`` too."""
    path = tmp_path / "consumer.yaml"
    path.write_text(f"kv_role: kv_consumer\n{written}\n")
    assert load_config(path, environ={}).thread_cpus == "1"
    from_env = load_config(path, environ={"LMCACHE_PD_THREAD_CPUS": "0"})
    assert from_env.thread_cpus == "0"
    with pytest.raises(ConfigError, match="thread_cpus"):  # control: a list still is checked
        load_config(path, environ={"LMCACHE_PD_THREAD_CPUS": "1,,2"})


@pytest.mark.processes
def test_process_cpus_the_host_lacks_are_refused_before_anything_starts(tmp_path: Path) -> None:
    """A CPU outside this process's affinity fails at once with the setting named; a CPU it
    has (control) gets past the check, to the server's start (here: a command that exits)."""
    missing = max(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match=rf"process_cpus '{missing}'.*\[{missing}\]"):
        VLLMServer(Path("no-model"), 1, tmp_path / "a.log", process_cpus=str(missing))
    assert not (tmp_path / "a.log").exists()
    with pytest.raises(RuntimeError, match="exited"):
        VLLMServer(
            Path("no-model"),
            1,
            tmp_path / "b.log",
            process_cpus=str(min(os.sched_getaffinity(0))),
            wrap=["true"],
        )
