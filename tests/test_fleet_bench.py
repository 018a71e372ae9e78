"""The fleet benchmark's short run (python -m benchmarks.fleet --short): a real ``lmcache-pd
serve`` of one prefill and two decode instances, a steady load of greedy streams, and after a
control phase (the same load, no event) one event: decode-0 SIGKILLed mid-stream (a drain on
SIGTERM under streams is ``test_drain_vllm.py``'s; every event is the full benchmark's).

What the design promises is asserted: no client sees a failure and every answer is one plain
vLLM's (``proxy/migration.py`` carries the killed decode's streams over to the other), and the
killed instance serves again. The negative
controls: the control phase migrates nothing, and the judge the run relies on does call an
answer wrong when one token differs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.chaos.judge import judge
from benchmarks.chaos.pools import alive_groups
from benchmarks.fleet.events import SHORT_EVENTS
from tests.vllm_support import PlainVLLM

ROOT = Path(__file__).resolve().parents[1]
# serve (~60-90 s to start three instances), the control, and a kill with its instance
# started again (~30-60 s on two cores).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
RUN_TIMEOUT_S = 1140
PROMISED = SHORT_EVENTS.split(",")


@pytest.fixture(scope="module")
def fleet_run(tmp_path_factory: pytest.TempPathFactory, plain_vllm: PlainVLLM) -> dict[str, Any]:
    """The short run, its references from the suite's plain vLLM (the pools' model and flags)."""
    folder = tmp_path_factory.mktemp("fleet")
    output = folder / "fleet.json"
    command = [sys.executable, "-m", "benchmarks.fleet", "--short", "--output", str(output)]
    command += ["--workdir", str(folder / "work"), "--reference-url", plain_vllm.server.url]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return json.loads(output.read_text())


def by_event(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {record["event"]: record for record in run["results"]}


def test_the_short_run_is_a_control_then_its_events_on_1p2d(fleet_run: dict[str, Any]) -> None:
    assert list(by_event(fleet_run)) == ["control", *PROMISED]
    assert fleet_run["settings"]["layout"] == "1P2D"
    for record in fleet_run["results"]:
        assert record["requests"] >= 8


@pytest.mark.parametrize("event", ["control", *PROMISED])
def test_no_client_sees_a_failure(fleet_run: dict[str, Any], event: str) -> None:
    record = by_event(fleet_run)[event]
    assert record["failed"] == 0, record["failures"]


@pytest.mark.parametrize("event", ["control", *PROMISED])
def test_every_answer_is_one_plain_vllms(fleet_run: dict[str, Any], event: str) -> None:
    record = by_event(fleet_run)[event]
    assert record["wrong"] == 0, record["failures"]


def test_streams_of_the_killed_decode_went_on_on_the_other(fleet_run: dict[str, Any]) -> None:
    record = by_event(fleet_run)["sigkill_decode_mid_stream"]
    assert record["migrated_streams"] >= 1, "no stream was on the killed decode: proved nothing"
    assert record["migrated_streams_judged_ok"] == record["migrated_streams"]


def test_the_control_migrates_nothing(fleet_run: dict[str, Any]) -> None:
    record = by_event(fleet_run)["control"]
    assert record["migrated_streams"] == 0
    assert record["migrations"] == {}


def test_the_judge_calls_one_different_token_wrong() -> None:
    want = (["a", "b", "c"], [-0.1, -0.2, -0.3])
    assert judge(want, want) == ("ok", "")
    assert judge((["a", "x", "c"], want[1]), want)[0] == "wrong"
    assert judge((want[0], [-0.1, -0.2, -0.31]), want)[0] == "wrong"


@pytest.mark.parametrize("event", PROMISED)
def test_the_instance_serves_again(fleet_run: dict[str, Any], event: str) -> None:
    record = by_event(fleet_run)[event]
    assert record["serves_again_s"] is not None, record["notes"]
    assert record["proxy_up_again_s"] is not None, record["notes"]


def test_no_process_is_left_behind(fleet_run: dict[str, Any]) -> None:
    assert fleet_run["processes_left"] == []
    assert alive_groups(fleet_run["process_groups"]) == []
