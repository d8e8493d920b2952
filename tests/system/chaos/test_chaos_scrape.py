"""Lying or broken observation channels, through a real suite run: /metrics that is garbage,
cut mid-line, empty, slower than the scrape timeout, or reports NaN/negative gauges; KV-event
batches that fail to decode and batches out of the engine's order."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.system.chaos.harness import Row, first_line, run_chaos, summarize

BLOCK = "kvconform/suites/prefix_reuse/test_block_reuse.py"
FIRST = "test_repeated_prompt_served_from_cache"
TWO = [
    "--check",
    "prefix_reuse::test_repeated_prompt_served_from_cache",
    "--check",
    "prefix_reuse::test_reset_drops_cached_prefix",
]
TIMEOUT_S = 3.0
EXPECTED = {
    "garbage": "/metrics is not Prometheus text",
    "truncated": "/metrics is truncated",
    "empty": "/metrics answered an empty body",
    "slow": "Read timed out",
}


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_metrics_broken(mode: str, tmp_path: Path, chaos_table) -> None:
    fault = {"fault": f"metrics:{mode}", "check": FIRST, "timeout_s": TIMEOUT_S}
    run = run_chaos(tmp_path, fault, [BLOCK], TWO, 2)
    target = run.record(FIRST)
    later = run.later(FIRST)
    row = Row(
        f"/metrics {mode}" + (" (beyond the scrape timeout)" if mode == "slow" else ""),
        "reference",
        first_line(target),
        run.time_to_verdict(FIRST),
        TIMEOUT_S + 3,
        summarize(later),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert target["outcome"] == "failed" and EXPECTED[mode] in target["message"], target["message"]
    assert row.time_to_verdict_s <= row.bound_s
    assert [r["outcome"] for r in later] == ["passed"], run.output
    assert not run.orphans and not run.shm_left and run.complete == "yes"


@pytest.mark.parametrize("mode", ["nan", "negative"])
def test_metrics_gauge_nan_or_negative(mode: str, tmp_path: Path, chaos_table) -> None:
    check = "test_gauges_consistent_under_load"
    fault = {"fault": f"metrics:{mode}", "check": check}
    gauges = "kvconform/suites/offload_metrics/test_gauges.py"
    options = ["--check", f"offload_metrics::{check}"]
    run = run_chaos(tmp_path, fault, [gauges], options, 1)
    target = run.record(check)
    row = Row(
        f"/metrics offload usage gauge {'NaN' if mode == 'nan' else 'negative (-0.5)'}",
        "reference",
        f"{target['outcome']}: VIOLATED {', '.join(target['violated'])}",
        run.time_to_verdict(check),
        "the check's scenario",
        summarize(run.later(check)),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert target["outcome"] == "failed", target
    assert "samples_out_of_[0,1]" in target["violated"], target["violated"]
    assert not run.orphans and not run.shm_left and run.complete == "yes"


@pytest.mark.parametrize("mode", ["malformed", "disorder"])
def test_kv_events_broken(mode: str, tmp_path: Path, chaos_table) -> None:
    check = "test_event_ledger_consistent"
    release = "kvconform/suites/transfer/test_release.py"
    options = ["--check", f"transfer::{check}", "--check", "prefix_reuse::test_reset_drops_cached_prefix"]
    run = run_chaos(
        tmp_path, {"fault": f"events:{mode}", "check": check, "at": 3}, [release, BLOCK], options, 2
    )
    target = run.record(check)
    row = Row(
        "KV-event batches that fail to decode" if mode == "malformed" else "KV-event batches out of order",
        "reference",
        first_line(target),
        run.time_to_verdict(check),
        "the check's scenario",
        summarize(run.later(check)),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert target["outcome"] == "failed", target
    if mode == "malformed":
        assert "2 batch(es) failed to decode" in target["message"] and "seq 3:" in target["message"]
    else:
        assert target["violated"] == ["seq_regress"], target["violated"]
        assert "arrived after seq 4" in target["message"]
    assert not run.orphans and not run.shm_left and run.complete == "yes"
