"""The mutation matrix: every check passes on the clean reference engine and fails on its fault.

For each fault in engines/reference/faults.py, the checks in its `killed_by` run against the
reference engine with that fault injected; each must fail with a message that names the
violated invariant and its numbers. The clean run must pass every check it runs, and every
check that ran must be killed by at least one fault (a check that cannot fail is a defect).
Checks the reference engine cannot run are listed in PROVED_ELSEWHERE with the test that
makes them fail on a faulty input.

The matrix (check x fault) is written to <--results-dir>/mutation-matrix.md.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvconform.checkids import matches
from kvconform.engines.reference.faults import FAULTS
from tests.suite_runs import run_suites

ROOT = Path(__file__).resolve().parent.parent
# Checks skipped on the reference engine, and the test proving each can fail elsewhere.
PROVED_ELSEWHERE: dict[str, str] = {
    "offload_metrics::test_block_pool_stats_consistent": "tests/contract/test_contract_trtllm.py",
    "prefix_reuse::test_radix_cache_state_machine": "tests/test_engine_only_checks.py",
    "prefix_reuse::test_radix_unlock_without_lock_refused": "tests/test_engine_only_checks.py",
    "prefix_reuse::test_radix_index_matches_model": "tests/test_engine_only_checks.py",
    "prefix_reuse::test_trace_replay_reuse_matches_oracle": "tests/test_engine_only_checks.py",
    "transfer::test_handoff_time_matches_bytes_over_bandwidth": "tests/test_engine_only_checks.py",
    "transfer::test_block_tracker_ownership_and_drain": "tests/test_engine_only_checks.py",
    "prefix_reuse::test_events_replayed_into_router_index_match": "tests/test_engine_only_checks.py",
}


def run_reference(results: Path, faults: list[str], checks: list[str]) -> dict[str, dict]:
    options = ["--engine", "reference"]
    options += [arg for fault in faults for arg in ("--fault", fault)]
    options += [arg for check in checks for arg in ("--check", check)]
    proc, records = run_suites([str(ROOT / "kvconform" / "suites")], options, results)
    if not records:
        raise AssertionError(f"no results for faults={faults}: exit {proc.returncode}\n{proc.stdout[-3000:]}")
    return records


@pytest.fixture(scope="module")
def matrix(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[dict[str, dict], dict[str, dict[str, dict]]]:
    base = tmp_path_factory.mktemp("matrix")
    jobs = {"clean": ([], ["*"])}
    for name, fault in FAULTS.items():
        jobs[name] = ([name], list(fault.killed_by))
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(run_reference, base / name, *job) for name, job in jobs.items()}
        outcomes = {name: f.result() for name, f in futures.items()}
    clean = outcomes.pop("clean")
    write_matrix(clean, outcomes, Path(request.config.getoption("--results-dir")))
    return clean, outcomes


def write_matrix(clean: dict[str, dict], faulty: dict[str, dict[str, dict]], out: Path) -> str:
    mark = {"passed": ".", "failed": "F", "error": "E", "skipped": "s", "xfailed": "x"}
    checks = sorted(clean)
    lines = ["| check | clean | " + " | ".join(faulty) + " |", "|---|---|" + "---|" * len(faulty)]
    for check in checks:
        row = [mark.get(clean[check]["outcome"], "?")]
        for fault in faulty:
            record = faulty[fault].get(check)
            row.append(mark.get(record["outcome"], "?") if record else " ")
        lines.append(f"| {check} | " + " | ".join(row) + " |")
    text = "\n".join(lines)
    out.mkdir(exist_ok=True)
    (out / "mutation-matrix.md").write_text(
        "Mutation matrix: F = the check failed under the fault (killed), . = passed, s = skipped\n\n"
        + text
        + "\n"
    )
    return text


def test_clean_engine_passes_every_check(matrix) -> None:
    clean, _ = matrix
    bad = {c: r["outcome"] for c, r in clean.items() if r["outcome"] not in ("passed", "skipped")}
    assert not bad, f"checks not passing on the clean reference engine: {bad}"
    assert sum(r["outcome"] == "passed" for r in clean.values()) >= 20, "too few checks ran"


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_fault_is_killed_by_its_checks(matrix, fault: str) -> None:
    _, faulty = matrix
    records = faulty[fault]
    for pattern in FAULTS[fault].killed_by:
        hits = {c: r for c, r in records.items() if matches(c, pattern)}
        assert hits, f"fault {fault}: no check matching {pattern!r} ran"
        for check, record in hits.items():
            assert record["outcome"] == "failed", (
                f"fault {fault} survived check {check} (outcome {record['outcome']})"
            )
            assert "VIOLATED" in record["message"] and "expected" in record["message"], (
                f"fault {fault}: {check} failed without naming the violated invariant:\n{record['message']}"
            )


def test_every_check_can_fail(matrix) -> None:
    clean, _ = matrix
    killers = [p for f in FAULTS.values() for p in f.killed_by]
    ran = [c for c, r in clean.items() if r["outcome"] == "passed"]
    unkilled = [c for c in ran if not any(matches(c, p) for p in killers)]
    assert not unkilled, f"checks no fault kills (they could be unable to fail): {unkilled}"
    skipped = [
        c for c, r in clean.items() if r["outcome"] == "skipped" and not any(matches(c, p) for p in killers)
    ]
    unproved = [c for c in skipped if c.split("[")[0] not in PROVED_ELSEWHERE and _generic_skip(clean[c])]
    assert not unproved, f"checks the reference engine cannot run and nothing proves can fail: {unproved}"
    for check, test in PROVED_ELSEWHERE.items():
        assert (ROOT / test).exists(), f"{check}: proof {test} is missing"


def _generic_skip(record: dict) -> bool:
    """Skips for a release path or layout another engine has are covered by the same check
    running elsewhere in the matrix; only checks that never run on the reference need proof."""
    return "lacks capability" in record["message"]
