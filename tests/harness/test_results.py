"""Verdicts, the record writer, and one record per test under pytest-xdist (crashes included)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from kvconform.records import read_records
from kvconform.results import CheckRecord, RecordWriter, Verdict, merge


def test_conclude_without_expectation_is_an_error() -> None:
    verdict = Verdict("suite::test_x", "fake")
    verdict.record("hit_tokens", 96, "tokens")
    with pytest.raises(AssertionError, match="suite::test_x: no expectation was checked"):
        verdict.conclude()
    assert verdict.concluded


def test_conclude_lists_every_failure_with_numbers() -> None:
    verdict = Verdict("prefix_reuse::test_hits", "fake")
    verdict.record("prompt_tokens", 200, "tokens")
    assert verdict.expect("cached_tokens", 96, ">=", 96, "tokens", note="floor(100/16)*16")
    is_ok = verdict.equal("queried_delta", 190, 200, "tokens")
    assert not is_ok
    verdict.expect("leak_slope", 5000.0, "<=", 4096, "bytes/cycle")
    with pytest.raises(AssertionError) as err:
        verdict.conclude(context="engine log: nothing unusual")
    head, *rest = str(err.value).splitlines()
    assert head.startswith("[fake] prefix_reuse::test_hits: ")
    assert "cached_tokens" not in head
    assert "queried_delta = 190 tokens, expected == 200 tokens [VIOLATED]" in head
    assert "leak_slope = 5000 bytes/cycle, expected <= 4096 bytes/cycle [VIOLATED]" in head
    body = "\n".join(rest)
    assert "engine log: nothing unusual" in body
    assert "prompt_tokens = 200 tokens" in body
    assert "cached_tokens = 96 tokens, expected >= 96 tokens [ok] (floor(100/16)*16)" in body
    assert [m.name for m in verdict.failures] == ["queried_delta", "leak_slope"]


def test_conclude_passes_when_every_expectation_holds() -> None:
    verdict = Verdict("c", "e")
    verdict.expect("a", 3, "<", 4)
    verdict.expect("b", 10.05, "==", 10, abs_tol=0.1)
    verdict.expect("c", 4.05, "<=", 4, abs_tol=0.1)
    verdict.expect("d", 3.95, ">=", 4, abs_tol=0.1)
    verdict.conclude()


def test_unmet_precondition_fails_as_could_not_judge() -> None:
    v = Verdict("suite::check", "reference")
    v.require("entries_damaged", 0, ">=", 1, note="the prompt must have been persisted")
    v.equal("cached_tokens_from_damaged_entries", 0, 0, "tokens")
    with pytest.raises(AssertionError) as err:
        v.conclude()
    assert "could not judge (a precondition is not met)" in str(err.value)
    assert "entries_damaged = 0, expected >= 1 [PRECONDITION NOT MET]" in str(err.value)
    assert [m.name for m in v.failures] == ["entries_damaged"]


def test_a_precondition_alone_is_no_expectation() -> None:
    v = Verdict("suite::check", "reference")
    v.require("steps_checked", 60, ">=", 50)
    with pytest.raises(AssertionError, match="no expectation was checked"):
        v.conclude()


def test_expect_edge_cases() -> None:
    verdict = Verdict("c", "e")
    assert not verdict.expect("nan", float("nan"), "<=", 1)
    assert not verdict.expect("tol", 10.2, "==", 10, abs_tol=0.1)
    with pytest.raises(ValueError, match="unknown comparison"):
        verdict.expect("x", 1, "~", 1)
    verdict.expect("np", np.int64(7), "==", np.float64(7.0))
    measure = verdict.measures[-1]
    assert type(measure.value) is int and type(measure.bound) is float  # plain JSON numbers
    json.dumps(verdict.as_dict())
    assert verdict.equal("eq", 1, 1) and verdict.measures[-1].better == "exact"


def record(check: str, outcome: str = "passed") -> CheckRecord:
    return CheckRecord(check, f"kvconform/suites/x.py::{check}", "fake", "1.0", "host", outcome, 0.1, [], "")


def test_record_writer_and_merge(tmp_path: Path) -> None:
    writer = RecordWriter(tmp_path / "results")
    writer.write(record("a"))
    writer.write(record("b", "failed"))
    other = tmp_path / "results" / "records-99999999.jsonl"  # another process's file
    other.write_text(json.dumps(asdict(record("c", "skipped"))) + "\n\n")
    assert sorted(r.check for r in read_records(tmp_path / "results")) == ["a", "b", "c"]

    path = merge(tmp_path / "results", {"engines": {"fake": "1.0"}})
    data = json.loads(path.read_text())
    assert data["session"] == {"engines": {"fake": "1.0"}}
    assert sorted((r["check"], r["outcome"]) for r in data["records"]) == [
        ("a", "passed"),
        ("b", "failed"),
        ("c", "skipped"),
    ]
    other.unlink()  # results.json, once merged, is what read_records reads
    assert len(read_records(tmp_path / "results")) == 3


TINY_SUITE = """
import os

import pytest


def test_pass():
    pass


def test_fail():
    assert 1 == 2, "measured 1"


@pytest.mark.skip(reason="static skip")
def test_skip_marker():
    pass


def test_skip_runtime():
    pytest.skip("runtime skip")


@pytest.mark.xfail(reason="known", strict=True)
def test_xfail():
    assert False


@pytest.mark.parametrize("n", [1, 2, 3])
def test_param(n):
    assert n


@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")


def test_setup_error(broken):
    pass


@pytest.fixture
def breaks_after():
    yield
    raise RuntimeError("teardown broke")


def test_teardown_error(breaks_after):
    pass


def test_worker_crash():
    os._exit(3)


def test_after_crash():
    pass
"""

EXPECTED = {
    "test_pass": "passed",
    "test_fail": "failed",
    "test_skip_marker": "skipped",
    "test_skip_runtime": "skipped",
    "test_xfail": "xfailed",
    "test_param[1]": "passed",
    "test_param[2]": "passed",
    "test_param[3]": "passed",
    "test_setup_error": "error",
    "test_teardown_error": "error",
    "test_worker_crash": "error",
    "test_after_crash": "passed",
}


def test_one_record_per_test_under_xdist(tmp_path: Path) -> None:
    """`-n 2`: records are written where reports arrive (the controller), one per test —
    skipped ones included, none twice — and a worker that dies mid-test still leaves one."""
    suite = tmp_path / "tiny"
    suite.mkdir()
    (suite / "test_tiny.py").write_text(textwrap.dedent(TINY_SUITE))
    results = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KVCONFORM_"))}
    # The tiny suite uses no engine. Select the oMLX adapter (a light module whose preflight
    # only looks for `omlx` on PATH, faked here) so that the controller and the three
    # workers do not each spend seconds importing the reference engine's torch.
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "omlx").write_text("#!/bin/sh\nexit 0\n")
    (fake_bin / "omlx").chmod(0o755)
    env["PATH"] = f"{fake_bin}{os.pathsep}{env.get('PATH', '')}"
    run = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", str(suite), "-n", "2", "-q", "--engine", "omlx"),
            *("--results-dir", str(results)),
            *("-p", "no:cacheprovider", "-p", "no:allure_pytest", "-p", "no:hypothesispytest"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 1, output
    assert "crashed while running" in output

    data = json.loads((results / "results.json").read_text())
    records = data["records"]
    names = [r["nodeid"].split("::", 1)[1] for r in records]
    assert Counter(names) == Counter(EXPECTED.keys()), f"duplicates or missing: {Counter(names)}"
    outcomes = {r["nodeid"].split("::", 1)[1]: r["outcome"] for r in records}
    assert outcomes == EXPECTED
    by_name = {r["nodeid"].split("::", 1)[1]: r for r in records}
    assert by_name["test_skip_marker"]["message"].endswith("static skip")
    assert "measured 1" in by_name["test_fail"]["message"]
    assert "crashed" in by_name["test_worker_crash"]["message"]
    assert by_name["test_param[2]"]["check"] == "test_tiny::test_param[2]"
    assert data["session"]["exitstatus"] == 1
    written = [line for p in results.glob("records-*.jsonl") for line in p.read_text().splitlines()]
    assert len(written) == len(EXPECTED), "the raw records agree with results.json"
