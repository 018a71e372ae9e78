"""Two systems compared over pooled runs (``benchmarks/serving_compare.py``), on made-up runs:
a real difference is told apart, the same spread with no difference is not (the control)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from typer.testing import CliRunner

from benchmarks.serving_compare import METRICS, app, compare


def document(system: str, scale: float, seed: int, runs: int = 6) -> dict:
    """serving.py's shape: one workload, ``runs`` runs whose figures spread +-30% around 50 ms
    times ``scale`` (the same spread for the same ``seed``)."""
    rng = random.Random(seed)
    return {
        "results": [
            {
                "system": system,
                "workload": "1500/32@1400",
                "runs": [
                    {metric: 50.0 * scale * rng.uniform(0.7, 1.3) for metric in METRICS}
                    for _ in range(runs)
                ],
            }
        ]
    }


def test_a_real_difference_is_told_apart_and_none_is_not() -> None:
    """The same runs' spread in both systems: 1.5x slower is told apart; equal (the control),
    the interval holds 1."""
    slower = [document("a", 1.5, seed=1), document("b", 1.0, seed=1)]
    for record in compare(slower, "a", "b", resamples=1000):
        assert record["runs"] == [6, 6]
        assert 1.0 < record["low"] <= record["ratio"] <= record["high"], record
    same = [document("a", 1.0, seed=1), document("b", 1.0, seed=1)]
    for record in compare(same, "a", "b", resamples=1000):
        assert record["low"] < 1.0 < record["high"] and record["ratio"] == 1.0, record


def test_runs_are_pooled_across_files_and_written(tmp_path: Path) -> None:
    paths = []
    for index, doc in enumerate(
        [document("a", 1.0, 5), document("b", 1.0, 6), document("a", 1.0, 7)]
    ):
        paths.append(tmp_path / f"{index}.json")
        paths[-1].write_text(json.dumps(doc))
    output = tmp_path / "compare.json"
    args = [*map(str, paths), "--system", "a", "--against", "b", "--output", str(output)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    records = json.loads(output.read_text())["records"]
    assert {tuple(r["runs"]) for r in records} == {(12, 6)}
    missing = CliRunner().invoke(app, [str(paths[0]), "--system", "a", "--against", "c"])
    assert missing.exit_code != 0 and "no workload" in missing.output
