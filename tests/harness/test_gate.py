"""The release gate on small synthetic results files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvconform.cli import main as cli_main
from kvconform.gate import compare, load, run_gate


def measure(name: str, value: Any, better: str | None = None, tolerance: float = 0.0, **kw: Any) -> dict:
    return {
        "name": name,
        "value": value,
        "unit": kw.get("unit", ""),
        "op": kw.get("op"),
        "bound": kw.get("bound"),
        "ok": kw.get("ok"),
        "better": better,
        "tolerance": tolerance,
        "note": "",
    }


def record(check: str, outcome: str = "passed", engine: str = "lmcache", measures=(), **kw: Any) -> dict:
    return {
        "check": check,
        "nodeid": f"kvconform/suites/x.py::{check}",
        "engine": engine,
        "engine_version": kw.get("version", "0.5.5"),
        "platform": kw.get("platform", "NVIDIA H100 80GB HBM3"),
        "outcome": outcome,
        "duration_s": 1.0,
        "measures": list(measures),
        "message": kw.get("message", ""),
        "finding": kw.get("finding", ""),
        "finding_class": kw.get("finding_class", ""),
        "written_at": kw.get("written_at", 1.0),
    }


def write(path: Path, records: list[dict], session: dict | None = None, as_dir: bool = True) -> str:
    data = {"session": session or {"engines": {"lmcache": "0.5.5"}, "platform": "gpu"}, "records": records}
    if as_dir:
        path.mkdir(parents=True, exist_ok=True)
        (path / "results.json").write_text(json.dumps(data))
    else:
        path.write_text(json.dumps(data))
    return str(path)


def gate(tmp_path: Path, base: list[dict], cand: list[dict], markdown: bool = False, capsys=None):
    b = write(tmp_path / "baseline", base)
    c = write(tmp_path / "candidate", cand)
    code = run_gate(b, c, markdown=markdown)
    out = capsys.readouterr() if capsys else None
    return code, out


def verdicts(tmp_path: Path, base: list[dict], cand: list[dict]) -> dict[tuple[str, str], str]:
    b = write(tmp_path / "b.json", base, as_dir=False)
    c = write(tmp_path / "c.json", cand, as_dir=False)
    result = compare(load(b), load(c))
    return {(r.verdict, r.check): "blocking" if r.blocking else "ok" for r in result.rows}


def test_identical_runs_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recs = [record("a::x", measures=[measure("hits", 384, "higher", ok=True, op="==", bound=384)])]
    code, out = gate(tmp_path, recs, recs, capsys=capsys)
    assert code == 0
    assert "gate: PASS" in out.out
    assert "1 unchanged" in out.out


def test_new_failure_blocks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [record("a::x"), record("a::y")]
    cand = [
        record("a::x", "failed", message="AssertionError: [lmcache] a::x: hits = 0\nall measurements:"),
        record("a::y"),
    ]
    code, out = gate(tmp_path, base, cand, capsys=capsys)
    assert code == 1
    line = next(ln for ln in out.out.splitlines() if "a::x" in ln)
    assert "new failure" in line and "passed -> failed" in line and "hits = 0" in line
    assert "all measurements" not in out.out  # first line of the message only
    assert "gate: FAIL — 1 new failure" in out.out


def test_error_and_known_finding_count_as_new_failures(tmp_path: Path) -> None:
    base = [record("a::x"), record("a::y"), record("a::z", "skipped")]
    cand = [
        record("a::x", "error"),
        record("a::y", "xfailed", finding="finding on lmcache 0.5.6"),
        record("a::z", "failed"),
    ]
    v = verdicts(tmp_path, base, cand)
    assert v == {
        ("new failure", "a::x"): "blocking",
        ("new failure", "a::y"): "blocking",
        ("new failure", "a::z"): "blocking",  # it now runs, and fails
    }


def test_new_findings_block_by_class(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Defects and known-upstream bugs block; limitations and unconfirmed findings are listed
    apart (a gate that blocks on documented behaviour teaches its users to ignore it)."""
    classes = ("defect", "known-upstream", "limitation", "unconfirmed")
    base = [record(f"a::{k}") for k in classes]
    cand = [record(f"a::{k}", "xfailed", finding=f"{k} on lmcache: x", finding_class=k) for k in classes]
    assert verdicts(tmp_path, base, cand) == {
        ("new failure", "a::defect"): "blocking",
        ("new failure", "a::known-upstream"): "blocking",
        ("new limitation", "a::limitation"): "ok",
        ("new unconfirmed", "a::unconfirmed"): "ok",
    }
    b, c = write(tmp_path / "b2", base), write(tmp_path / "c2", cand)
    assert cli_main(["gate", b, c, "--block-on", "limitation"]) == 1
    out = capsys.readouterr().out
    assert "new limitation" not in out and "new unconfirmed" in out
    assert cli_main(["gate", b, c, "--block-on", "bug"]) == 2
    only_limitation = record("a::limitation", "xfailed", finding="l", finding_class="limitation")
    assert run_gate(b, write(tmp_path / "c3", [base[0], base[1], only_limitation, base[3]])) == 0


def test_fixed_and_still_failing_do_not_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [record("a::x", "failed"), record("a::y", "failed"), record("a::k", "xfailed")]
    cand = [record("a::x"), record("a::y", "failed"), record("a::k", "failed")]
    v = verdicts(tmp_path, base, cand)
    assert v == {
        ("fixed", "a::x"): "ok",
        ("still failing", "a::y"): "ok",
        ("still failing", "a::k"): "ok",
    }
    code, out = gate(tmp_path, base, cand, capsys=capsys)
    assert code == 0 and "1 fixed" in out.out and "2 still failing" in out.out


def test_missing_and_no_longer_run_block(tmp_path: Path) -> None:
    base = [record("a::x"), record("a::y"), record("a::gone-skipped", "skipped"), record("a::s")]
    cand = [record("a::x"), record("a::s", "skipped", message="engine lmcache lacks capability X")]
    v = verdicts(tmp_path, base, cand)
    assert v == {("missing", "a::y"): "blocking", ("no longer run", "a::s"): "blocking"}


def test_new_passing_check_is_reported_not_blocking(tmp_path: Path) -> None:
    base = [record("a::x"), record("a::s", "skipped")]
    v = verdicts(tmp_path, base, [record("a::x"), record("a::new"), record("a::s")])
    assert v == {("new check", "a::new"): "ok", ("now runs", "a::s"): "ok"}


def test_checks_are_keyed_by_engine_and_check(tmp_path: Path) -> None:
    base = [record("a::x", engine="vllm"), record("a::x", engine="lmcache")]
    cand = [record("a::x", engine="vllm"), record("a::x", "failed", engine="lmcache")]
    b = write(tmp_path / "b.json", base, as_dir=False)
    c = write(tmp_path / "c.json", cand, as_dir=False)
    rows = compare(load(b), load(c)).rows
    assert [(r.verdict, r.engine) for r in rows] == [("new failure", "lmcache")]


@pytest.mark.parametrize(
    ("better", "tolerance", "before", "after", "expected"),
    [
        ("lower", 0.5, 2.0, 2.4, None),  # within tolerance: noise
        ("lower", 0.5, 2.0, 2.6, "regression"),
        ("lower", 0.5, 2.0, 1.2, "improvement"),
        ("higher", 0.01, 0.90, 0.85, "regression"),
        ("higher", 0.01, 0.90, 0.95, "improvement"),
        ("higher", 0.0, 1, 1, None),
        ("exact", 0.0, 384, 383, "regression"),  # no bound: any change moves away
        (None, 0.0, 100, 1_000_000, None),  # no direction: informational only
    ],
)
def test_measure_regressions_follow_better_and_tolerance(
    tmp_path: Path, better: str | None, tolerance: float, before: float, after: float, expected: str | None
) -> None:
    base = [record("a::x", measures=[measure("m", before, better, tolerance)])]
    cand = [record("a::x", measures=[measure("m", after, better, tolerance)])]
    v = verdicts(tmp_path, base, cand)
    if expected is None:
        assert v == {}
    else:
        assert v == {(expected, "a::x :: m"): "blocking" if expected == "regression" else "ok"}


def test_exact_measures_compare_distance_from_their_bound(tmp_path: Path) -> None:
    # the bound moved with the workload: 384 of 384 then 448 of 448 is no regression
    base = [record("a::x", measures=[measure("hits", 384, "exact", op="==", bound=384, ok=True)])]
    cand = [record("a::x", measures=[measure("hits", 448, "exact", op="==", bound=448, ok=True)])]
    assert verdicts(tmp_path, base, cand) == {}
    # further from the bound than before: a regression even if both were already violated
    base = [record("a::x", "failed", measures=[measure("hits", 300, "exact", op="==", bound=384, ok=False)])]
    cand = [record("a::x", "failed", measures=[measure("hits", 0, "exact", op="==", bound=384, ok=False)])]
    assert verdicts(tmp_path, base, cand) == {
        ("still failing", "a::x"): "ok",
        ("regression", "a::x :: hits"): "blocking",
    }


def test_non_numeric_values_are_not_compared(tmp_path: Path) -> None:
    base = [
        record("a::x", measures=[measure("path", "unregister", "exact"), measure("flag", True, "higher")])
    ]
    cand = [record("a::x", measures=[measure("path", "close", "exact"), measure("flag", False, "higher")])]
    assert verdicts(tmp_path, base, cand) == {}


def test_expectation_newly_violated_is_a_regression(tmp_path: Path) -> None:
    base = [record("a::x", "failed", measures=[measure("slope", 0, "lower", op="<=", bound=10, ok=True)])]
    cand = [record("a::x", "failed", measures=[measure("slope", 11, "lower", op="<=", bound=10, ok=False)])]
    v = verdicts(tmp_path, base, cand)
    assert v[("regression", "a::x :: slope")] == "blocking"


def test_markdown_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = [
        record("a::x[1|2]", measures=[measure("drain_time", 1.0, "lower", 0.5, unit="s")]),
        record("a::y"),
    ]
    cand = [
        record("a::x[1|2]", measures=[measure("drain_time", 3.0, "lower", 0.5, unit="s")]),
        record("a::y"),
    ]
    code, out = gate(tmp_path, base, cand, markdown=True, capsys=capsys)
    assert code == 1
    lines = out.out.splitlines()
    assert lines[0].startswith("### kvconform gate:") and "FAIL" in lines[0]
    assert "| | Verdict | Engine | Check | Detail |" in lines
    row = next(ln for ln in lines if "drain_time" in ln)
    assert row.startswith("| :x: | regression | lmcache | `a::x[1\\|2] :: drain_time` |")
    assert "1 -> 3 s (lower is better, tolerance 0.5)" in row
    assert row.count(" | ") == 4  # the escaped pipe did not split the cell


def test_duplicate_records_keep_the_last_written(tmp_path: Path) -> None:
    base = [record("a::x")]
    cand = [record("a::x", "failed", written_at=1.0), record("a::x", "passed", written_at=2.0)]
    b = write(tmp_path / "b.json", base, as_dir=False)
    c = write(tmp_path / "c.json", cand, as_dir=False)
    result = compare(load(b), load(c))
    assert result.rows == [] and result.candidate.duplicates == 1


def test_reads_unmerged_records_of_a_crashed_run(tmp_path: Path) -> None:
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    (crashed / "records-123.jsonl").write_text(json.dumps(record("a::x", "failed")) + "\n")
    base = write(tmp_path / "base", [record("a::x")])
    assert run_gate(base, str(crashed)) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file or directory"),
        ("{not json", "not valid JSON"),
        ('{"records": 3}', "not a kvconform results file"),
        ('{"session": {}, "records": []}', "holds no check records"),
        ('{"records": [{"engine": "x"}]}', "lacks a check id or an outcome"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    good = write(tmp_path / "good", [record("a::x")])
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    assert run_gate(good, str(bad)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and str(bad) in err


def test_empty_directory_is_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path / "good", [record("a::x")])
    (tmp_path / "empty").mkdir()
    assert run_gate(str(tmp_path / "empty"), good) == 2
    assert "no results.json" in capsys.readouterr().err


def test_cli_dispatches_to_the_gate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = write(tmp_path / "b", [record("a::x")])
    cand = write(tmp_path / "c", [record("a::x", "failed")])
    assert cli_main(["gate", base, cand, "--markdown"]) == 1
    assert "| :x: | new failure |" in capsys.readouterr().out
    assert cli_main(["gate", base, base]) == 0


# ---------------------------------------------------------- known findings: numbers and manner


def leak(slope: float, ok: bool = False, name: str = "shm.leak_slope", tol: float = 0.0) -> dict:
    return measure(name, slope, "lower", tol, op="<=", bound=8192, ok=ok, unit="bytes/cycle")


def test_known_leak_that_doubles_is_a_regression(tmp_path: Path) -> None:
    base = [record("m::churn", "xfailed", measures=[leak(4194304.0)], finding="finding on lmcache 0.5.6")]
    cand = [record("m::churn", "xfailed", measures=[leak(8388608.0)], finding="finding on lmcache 0.5.6")]
    assert verdicts(tmp_path, base, cand) == {("regression", "m::churn :: shm.leak_slope"): "blocking"}


def test_known_leak_unchanged_or_within_tolerance_passes(tmp_path: Path) -> None:
    rss = "rss.leak_slope"
    base = [record("m::c", "xfailed", measures=[leak(4194304.0), leak(3.4e6, name=rss, tol=2**20)])]
    same = [record("m::c", "xfailed", measures=[leak(4194304.0), leak(3.9e6, name=rss, tol=2**20)])]
    assert verdicts(tmp_path, base, same) == {}
    worse = [record("m::c", "xfailed", measures=[leak(4194304.0), leak(6.8e6, name=rss, tol=2**20)])]
    assert verdicts(tmp_path, base, worse) == {("regression", f"m::c :: {rss}"): "blocking"}


def test_known_finding_that_now_crashes_blocks(tmp_path: Path) -> None:
    base = [record("m::c", "xfailed", measures=[leak(4194304.0)])]
    cand = [record("m::c", "failed", measures=[], message="engine lmcache: server died")]
    rows = compare(
        load(write(tmp_path / "b.json", base, as_dir=False)),
        load(write(tmp_path / "c.json", cand, as_dir=False)),
    ).rows
    assert [(r.verdict, r.blocking) for r in rows] == [("fails otherwise", True)]
    assert (
        "failed on shm.leak_slope in baseline, now failed on no measure (engine lmcache: server died)"
        in rows[0].detail
    )


def test_known_finding_failing_on_another_measure_too_blocks(tmp_path: Path) -> None:
    base = [record("m::c", "xfailed", measures=[leak(4194304.0), leak(0.0, ok=True, name="rss.leak_slope")])]
    cand = [record("m::c", "failed", measures=[leak(4194304.0), leak(9e6, name="rss.leak_slope")])]
    got = verdicts(tmp_path, base, cand)
    assert got[("fails otherwise", "m::c")] == "blocking"
    assert got[("regression", "m::c :: rss.leak_slope")] == "blocking"


def test_known_finding_failing_the_same_way_on_a_new_release_is_still_failing(tmp_path: Path) -> None:
    base = [record("m::c", "xfailed", measures=[leak(4194304.0)])]
    cand = [record("m::c", "failed", measures=[leak(4194304.0)], version="0.5.7")]
    assert verdicts(tmp_path, base, cand) == {("still failing", "m::c"): "ok"}


def test_inconclusive_counts_as_failing(tmp_path: Path) -> None:
    rss = measure("rss.leak_slope", 2.6e6, "lower", op="<=", bound=2097152, ok=None)
    base = [record("m::c", "passed", measures=[leak(0.0, ok=True)])]
    cand = [record("m::c", "inconclusive", measures=[rss], message="INCONCLUSIVE [lmcache] m::c: ...")]
    assert verdicts(tmp_path, base, cand) == {("new failure", "m::c"): "blocking"}
    assert verdicts(tmp_path, cand, base) == {("fixed", "m::c"): "ok"}
