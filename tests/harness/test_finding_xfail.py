"""A known finding's strict xfail, end to end: xfailed only on exactly its measures.

The reference engine with a fault plays the engine with a finding: the manifest names the
measure the fault breaks (xfailed), another measure (a failure saying why), or the clean
engine runs under the finding (XPASS(strict), a failure). results.json keeps the outcome.
Also: an INCONCLUSIVE verdict is recorded as its own outcome, never a pass.
"""

from __future__ import annotations

from pathlib import Path

from tests.system.suite_runs import run_suites

CHECK = "prefix_reuse::test_reset_drops_cached_prefix"
FINDING = """
[[finding]]
engine = "reference"
version = "*"
check = "{check}"
measures = {measures}
measured = "kept the prefix"
summary = "reset answers ok and keeps the index"
class = "unconfirmed"
contract = "a fault of the reference engine, for the self-test"
"""
BOTH = '{ "cached_tokens_after_reset" = "above", "prefix_hits_counter_delta_after_reset" = "above" }'


def run_with(tmp_path: Path, measures: str, faults: list[str]) -> tuple[str, dict]:
    manifest = tmp_path / "known.toml"
    manifest.write_text(FINDING.format(check=CHECK, measures=measures))
    options = ["--engine", "reference", "--known-failures", str(manifest), "--check", CHECK]
    options += [arg for fault in faults for arg in ("--fault", fault)]
    proc, records = run_suites(["kvconform/suites"], options, tmp_path / "results", timeout=300)
    assert CHECK in records, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout, records[CHECK]


def test_exactly_the_finding_measures_xfail(tmp_path: Path) -> None:
    out, rec = run_with(tmp_path, BOTH, ["reset_keeps_prefix"])
    assert rec["outcome"] == "xfailed", out[-3000:]
    assert sorted(rec["violated"]) == ["cached_tokens_after_reset", "prefix_hits_counter_delta_after_reset"]
    assert rec["finding_measures"] == [
        "cached_tokens_after_reset (above)",
        "prefix_hits_counter_delta_after_reset (above)",
    ]
    assert "1 xfailed" in out


def test_another_measure_violated_fails_saying_why(tmp_path: Path) -> None:
    out, rec = run_with(tmp_path, '{ "cached_tokens_after_reset" = "above" }', ["reset_keeps_prefix"])
    assert rec["outcome"] == "failed", out[-3000:]
    assert "[finding mismatch]" in rec["message"]
    assert "violated beyond the finding: prefix_hits_counter_delta_after_reset (above)" in rec["message"]
    assert "1 failed" in out


def test_the_wrong_direction_fails(tmp_path: Path) -> None:
    both_below = BOTH.replace('"above"', '"below"')
    _out, rec = run_with(tmp_path, both_below, ["reset_keeps_prefix"])
    assert rec["outcome"] == "failed"
    assert "not violated so: cached_tokens_after_reset (below)" in rec["message"]


def test_a_clean_engine_under_a_finding_is_xpass_strict(tmp_path: Path) -> None:
    _out, rec = run_with(tmp_path, BOTH, [])
    assert rec["outcome"] == "failed"
    assert "XPASS(strict)" in rec["message"]


INCONCLUSIVE_CHECK = """
import pytest


@pytest.mark.check("selftest::test_noisy")
def test_noisy(engine_name, verdict):
    verdict.expect_banded("rss.leak_slope", 2.6e6, (4096.0, 7.6e6), "<=", 2 * 2**20, "bytes/cycle")
    verdict.conclude()
"""


def test_inconclusive_is_its_own_outcome(tmp_path: Path) -> None:
    target = tmp_path / "test_selftest_noisy.py"
    target.write_text(INCONCLUSIVE_CHECK)
    proc, records = run_suites([str(target)], ["--engine", "reference"], tmp_path / "results", timeout=300)
    rec = records["selftest::test_noisy"]
    assert rec["outcome"] == "inconclusive", proc.stdout[-3000:]
    assert rec["message"].startswith("INCONCLUSIVE") or "INCONCLUSIVE" in rec["message"].splitlines()[0]
    assert rec["measures"][0]["ok"] is None and rec["measures"][0]["inconclusive"] is True
    assert proc.returncode != 0, "inconclusive is never a pass"
