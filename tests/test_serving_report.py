"""The serving benchmark's report, from made-up results: the gap from the first token to the
second beside the ITL, and the cost of disaggregation measured against the prefill instance's
cores alone, beside the ratio to the colocated instance."""

from __future__ import annotations

import pytest

from benchmarks.serving import goals, markdown
from benchmarks.serving_load import RequestResult, summarize
from benchmarks.serving_systems import first_gap_stages


def request(ttft: float, gaps: list[float], error: str | None = None) -> RequestResult:
    return RequestResult(0.0, ttft, gaps, ttft + sum(gaps), len(gaps) + 1, "id", error)


def test_the_first_to_second_token_gap_is_summarized_apart_and_over_the_itl() -> None:
    results = [
        request(0.1, [0.05, 0.01, 0.01, 0.01]),
        request(0.1, [0.07, 0.01, 0.01, 0.01]),
        request(0.1, [0.06, 0.01, 0.01, 0.01]),
        request(0.1, [], error="no token"),  # failed: counted, not summarized
        request(0.1, []),  # one token only: no first gap
    ]
    summary = summarize(results, wall_s=1.0)
    assert summary["failures"] == 1
    assert summary["first_gap_ms_p50"] == pytest.approx(60.0)
    assert summary["itl_ms_p50"] == pytest.approx(10.0)
    assert summary["first_gap_over_itl_p50"] == pytest.approx(6.0)


def record(system: str, ttft: float, first_gap: float = 20.0, itl: float = 10.0) -> dict:
    return {
        "system": system,
        "workload": "1024/32",
        "failures": 0,
        "ttft_ms_p50": ttft,
        "ttft_ms_p99": ttft,
        "itl_ms_p50": itl,
        "itl_ms_p99": itl,
        "first_gap_ms_p50": first_gap,
        "first_gap_over_itl_p50": first_gap / itl,
        "e2e_ms_p50": 500.0,
        "output_tok_s": 10.0,
        "req_s": 1.0,
    }


def test_goals_report_ttft_over_prefill_cores_beside_colocated_and_nixl() -> None:
    records = [
        record("lmcache-pd", 104.0, first_gap=30.0),
        record("prefill-cores", 100.0),
        record("colocated", 80.0),
        record("nixl", 200.0),
    ]
    found = goals(records)
    assert found["ttft_p50_vs_prefill_cores"] == {"ratio": 1.04, "goal": 1.05, "met": True}
    assert found["ttft_p50_vs_colocated"]["ratio"] == pytest.approx(1.3)
    assert not found["ttft_p50_vs_colocated"]["met"]
    assert found["ttft_p50_vs_nixl"]["ratio"] == pytest.approx(0.52)
    assert found["first_gap_over_itl_p50"] == {"ratio": 3.0, "goal": 2.0, "met": False}
    assert found["zero_failures"]
    table = markdown(records, found)
    assert "| 1st-2nd gap p50 |" in table.splitlines()[0]
    assert "| lmcache-pd | 1024/32 | 104.0 | 104.0 | 10.0 | 10.0 | 30.0 |" in table


def test_without_prefill_cores_in_the_run_no_disaggregation_cost_is_claimed() -> None:
    found = goals([record("lmcache-pd", 104.0), record("colocated", 80.0)])
    assert "ttft_p50_vs_prefill_cores" not in found  # the control: nothing to compare with
    assert "ttft_p50_vs_colocated" in found


def test_the_gap_at_the_proxy_is_split_into_stages_that_add_up() -> None:
    proxy = {"decode_sent": 10.000, "first_sent": 10.004, "decode_first": 10.022}
    load = {"queued_at": 10.010, "done_at": 10.012}
    stages = first_gap_stages(proxy, load)
    assert stages["decode_head_start_ms"] == pytest.approx(4.0)
    assert stages["decode_asked_to_step_ms"] == pytest.approx(10.0)
    assert stages["load_ms"] == pytest.approx(2.0)
    assert stages["load_to_decode_token_ms"] == pytest.approx(10.0)
    in_decode = ("decode_asked_to_step_ms", "load_ms", "load_to_decode_token_ms")
    decode_ms = sum(stages[k] for k in in_decode)
    assert stages["gap_at_proxy_ms"] == pytest.approx(decode_ms - stages["decode_head_start_ms"])
    # a request decode never answered has no stages (the control)
    assert first_gap_stages({"decode_sent": 10.0, "first_sent": 10.004}, load) == {}
