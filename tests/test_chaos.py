"""The chaos suite's short run (python -m benchmarks.chaos --short): 1P1D behind the proxy, a steady
stream of requests, and three faults in turn (SIGKILL of decode then its restart, clients that
disconnect after their first token, malformed ``disagg_spec``s sent straight to prefill).

What must hold today is asserted: no answer ever differs from one plain vLLM's, errors only for
requests the fault itself cut, and no process left behind. The suite's other goals are checked
per fault too; those that fail today are listed in ``FAILING_TODAY`` with what was seen, and run
as expected failures, so that they show in every report and turn into passes when fixed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.chaos.faults import SHORT_FAULTS
from benchmarks.chaos.pools import alive_groups
from tests.vllm_support import PlainVLLM

ROOT = Path(__file__).resolve().parents[1]
# The pools (~40-60 s to start), then three faults, one a restart.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
RUN_TIMEOUT_S = 840
GOALS = (
    "pages_leaked == 0",
    "max_latency_s <= deadline_s + 1",
    "recovered_s <= 10",
)
# (fault, goal) -> what was seen. Empty: every goal held in the short run of 2026-11-23
# (commit 389abaf, 14 passed in 188 s; 266 s on a busier machine). The full run's misses are in
# benchmarks/results/chaos.md (SIGSTOP of decode, preemption, and 2P1D on two cores).
FAILING_TODAY: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory: pytest.TempPathFactory, plain_vllm: PlainVLLM) -> dict[str, Any]:
    """The short run, its references from the suite's plain vLLM (the pools' model and flags)
    rather than one more vLLM started alone."""
    folder = tmp_path_factory.mktemp("chaos")
    output = folder / "chaos.json"
    command = [sys.executable, "-m", "benchmarks.chaos", "--short", "--output", str(output)]
    command += ["--workdir", str(folder / "work"), "--reference-url", plain_vllm.server.url]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return json.loads(output.read_text())


def by_fault(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {record["fault"]: record for record in run["results"]}


def test_the_short_run_injects_its_three_faults_into_1p1d(chaos_run: dict[str, Any]) -> None:
    assert list(by_fault(chaos_run)) == SHORT_FAULTS.split(",")
    for record in chaos_run["results"]:
        assert record["pools"] == "1P1D"
        assert record["requests"] >= 6


def test_no_answer_ever_differs_from_one_plain_vllm(chaos_run: dict[str, Any]) -> None:
    wrong = {r["fault"]: r["failures"] for r in chaos_run["results"] if r["wrong_outputs"]}
    assert not wrong


def test_errors_only_for_requests_the_fault_cut(chaos_run: dict[str, Any]) -> None:
    uncut = {
        r["fault"]: r["failures"] for r in chaos_run["results"] if r["errors"] != r["errors_cut"]
    }
    assert not uncut


def test_no_process_is_left_behind(chaos_run: dict[str, Any]) -> None:
    assert chaos_run["processes_left"] == []
    assert alive_groups(chaos_run["process_groups"]) == []


def test_no_connector_thread_dies(chaos_run: dict[str, Any]) -> None:
    dead = {r["fault"]: r["log_excerpts"] for r in chaos_run["results"] if r["threads_dead"]}
    assert not dead


@pytest.mark.parametrize("goal", GOALS)
@pytest.mark.parametrize("fault", SHORT_FAULTS.split(","))
def test_goal(chaos_run: dict[str, Any], fault: str, goal: str) -> None:
    known = FAILING_TODAY.get((fault, goal))
    if known:
        pytest.xfail(known)
    record = by_fault(chaos_run)[fault]
    assert record["goals"][goal], {
        key: record[key]
        for key in ("max_latency_s", "deadline_s", "recovered_s", "pages_leaked", "failures")
    }
