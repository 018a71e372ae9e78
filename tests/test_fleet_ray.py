"""The fleet benchmark's Ray engine (``python -m benchmarks.fleet --engine ray``) where it needs
neither Ray nor vLLM: which events it runs, what it refuses before starting anything, the pages
it reads after a pool shrank, and the order it needs Ray's token in. Fast lane; the run itself
(``benchmarks/results/fleet-ray.md``) is not in the suite."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from benchmarks.chaos.counters import CounterTrack
from benchmarks.fleet.__main__ import app, every_event
from benchmarks.fleet.ray_serve import RayHead
from benchmarks.fleet.report import markdown


def test_the_ray_engine_runs_a_control_then_a_killed_actor_then_a_scale_down() -> None:
    assert every_event("ray") == "sigkill_decode_actor,scale_decode_1"
    assert "sigkill_decode_actor" not in every_event("local")


@pytest.mark.parametrize(
    ("arguments", "refusal"),
    [
        (["--engine", "ray", "--events", "sigterm_decode"], "known on ray"),
        (["--engine", "kubernetes"], "engine is local or ray"),
    ],
)
def test_a_bad_engine_or_event_is_refused_before_anything_starts(
    arguments: list[str], refusal: str, tmp_path: Path
) -> None:
    result = CliRunner().invoke(app, [*arguments, "--workdir", str(tmp_path)])
    assert result.exit_code == 2, result.output
    assert refusal in result.output
    assert list(tmp_path.iterdir()) == []  # nothing started, nothing written


def test_an_instance_scaled_away_leaves_no_stale_pages_in_the_reading() -> None:
    deployment = SimpleNamespace(servers={})  # nothing answers: no counters read
    track = CounterTrack(deployment, "metrics")  # type: ignore[arg-type]
    track.gauges = {"decode-0": {"consumer_used_pages": 0}, "decode-1": {"consumer_used_pages": 3}}
    deployment.servers = {"decode-0": SimpleNamespace(url="http://127.0.0.1:1")}
    track.snapshot()
    # Its last gauges gone; the instance still served keeps its own (the negative control).
    assert track.gauges == {"decode-0": {"consumer_used_pages": 0}}


def test_the_ray_head_refuses_once_ray_was_imported_without_its_token(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "ray", SimpleNamespace())
    with pytest.raises(RuntimeError, match="before its token"):
        RayHead(3, tmp_path / "head.log")
    assert not (tmp_path / "head.log").exists()


def test_what_a_ray_event_struck_is_listed_under_the_table() -> None:
    record = {
        "event": "scale_decode_1",
        "requests": 9,
        "failed": 0,
        "wrong": 0,
        "pages_left": 0,
        "migrated_streams": 0,
        "migrations": {},
        "migrations_refused": {},
        "prefill_retries": 0,
        "goals": {"failed == 0": True},
        "failures": [],
        "notes": {"instance": "decode-1", "running_at_scale": 2, "scale_s": 8.5, "pid": 7},
    }
    for key in ("migrated_max_gap", "stream_max_gap", "itl", "ttft"):
        record |= {f"{key}_p50_s": 0.1, f"{key}_p99_s": 0.2}
    record |= {"serves_again_s": None, "proxy_up_again_s": None}
    text = markdown([record], "1P2D on Ray")
    assert "- scale_decode_1: instance decode-1, running_at_scale 2, scale_s 8.5" in text
    assert "pid 7" not in text  # pids stay in the JSON
