"""The mutation matrix, per measure: every check passes on the clean reference engine, and each
fault violates exactly the measures it names.

For each fault in engines/reference/faults.py, the checks in its `killed_by` run against the
reference engine with that fault injected; each must fail with a message that names the
violated invariant and its numbers, and the VIOLATED measures of its record (results.json,
measures with ok == False) must be exactly the fault's `violates` for that check: a fault
that moves some other measure, or misses one it names, fails. The clean run must pass every
check it runs; every check that ran must be killed by a fault. Checks the reference engine
cannot run are in PROVED_ELSEWHERE with the test that makes them fail.

Measure coverage: every measure any check compares with a bound (expect/equal) on the clean
reference engine or a clean test double (tests/doubles, proved by
tests/system/test_engine_only_checks.py) must be seen VIOLATED by at least one fault or double
fault. Measures only real engines (or GPU runners) record are judged where they are recorded:
the per-engine proof table of `make mutants` (docs/mutants.md) credits a measure on an engine
only where a run on that engine had it VIOLATED, never because a test file exists.
KNOWN_GAPS lists the measures no fault moves yet, each with why: the coverage test fails
for any other unkilled measure and for a gap that is no longer one, and the strict xfail
test_every_measure_is_killed passes only at 100 %.

The matrix (measure x fault, and check x fault) is written to <--results-dir>/mutation-matrix.md
and mutation-matrix.json. The fault runs are evidence kept in docs/mutation-matrix.json, remade
by `make matrix`; a self-test run remakes the smoke faults and those whose fingerprint changed,
and reads the others (tests/system/mutation_runs.py). Faults that need a GPU (Fault.needs) are left
out of this CPU matrix, with the reason in the files.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from kvconform.checkids import base_check as base
from kvconform.checkids import matches
from kvconform.engines.reference.faults import FAULTS
from kvconform.plugin.session import results_dir
from tests.doubles import faults_by_double
from tests.paths import REPO
from tests.system.mutation_runs import (
    EVIDENCE,
    EXCLUDED_ON_CPU,
    FULL,
    double_fingerprint,
    doubles_live,
    doubles_matrix,
    expected,
    preconditions,
    reference_fingerprint,
    reference_matrix,
    slim,
    suite_files,
    violated,
)
from tests.system.test_engine_only_checks import PROVES

ROOT = REPO
ENGINE_ONLY = "tests/system/test_engine_only_checks.py"
# Checks skipped on the reference engine (or whose measures need what it lacks), and the
# test proving each can fail elsewhere.
PROVED_ELSEWHERE: dict[str, str] = {
    "offload_metrics::test_block_pool_stats_consistent": "tests/adapters/contract/test_contract_trtllm.py",
    "prefix_reuse::test_radix_cache_state_machine": ENGINE_ONLY,
    "prefix_reuse::test_radix_index_matches_model": ENGINE_ONLY,
    "memory_reclaim::test_radix_index_memory_flat_under_eviction_churn": ENGINE_ONLY,
    "prefix_reuse::test_trace_replay_reuse_matches_oracle": ENGINE_ONLY,
    "transfer::test_handoff_time_matches_bytes_over_bandwidth": ENGINE_ONLY,
    "transfer::test_block_tracker_ownership_and_drain": ENGINE_ONLY,
    "prefix_reuse::test_events_replayed_into_router_index_match": ENGINE_ONLY,
    # Runs on the reference engine too; its router-event and active-block measures only where
    # a router reports them (the router double here, Dynamo among the engines).
    "prefix_reuse::test_router_prediction_matches_worker": ENGINE_ONLY,
    "prefix_reuse::test_remote_damaged_entry_recomputed": ENGINE_ONLY,
    # No reference-engine model of a store threshold: both measures VIOLATED on vLLM itself, by
    # release 0.28.0 (vllm-52227) and the mutant store_threshold_off_by_one.
    "offload_metrics::test_store_threshold_counts_offers": "docs/mutants.md",
    # No reference-engine salts: VIOLATED on SGLang's server by release 0.5.17 (sglang-30827) and
    # on vLLM by the mutant cache_salt_not_hashed.
    "prefix_reuse::test_cache_salt_isolates_prefix_and_event_hashes": "docs/history.md",
    "offload_metrics::test_remote_tier_bytes_reconcile": ENGINE_ONLY,
    "offload_metrics::test_remote_tier_eviction_within_capacity": ENGINE_ONLY,
    "offload_metrics::test_remote_server_loss": ENGINE_ONLY,
    "offload_metrics::test_remote_store_counters_track_pending_writes": ENGINE_ONLY,
}
# Measures no fault moves yet, and why. Each is a defect to fix (a fault modelled on a real bug,
# or deleting the measure where it cannot fail); the coverage test keeps this list honest.
# Preconditions of a workload (Verdict.require: the failure path ran, the machine took its
# steps) are not measures of the engine and are listed apart in the matrix.
KNOWN_GAPS: dict[tuple[str, str], str] = {}


@pytest.fixture(scope="module")
def matrix(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[dict[str, dict], dict[str, dict[str, dict]]]:
    clean, faulty, live = reference_matrix(tmp_path_factory)
    doubles = doubles_matrix(tmp_path_factory, PROVES)
    live |= doubles_live()
    write_matrix(clean, faulty, doubles, results_dir(request.config), live)
    if FULL:  # `make matrix`: the evidence later self-test runs read
        write_matrix(clean, faulty, doubles, EVIDENCE.parent, live)
    return clean, faulty


@pytest.fixture(scope="module")
def coverage(matrix, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], list[str]]:
    clean, faulty = matrix
    return measure_coverage(clean, faulty, doubles_matrix(tmp_path_factory, PROVES))


def measure_coverage(
    clean: dict[str, dict],
    faulty: dict[str, dict[str, dict]],
    doubles: dict[tuple[str, str | None], dict[str, dict]],
) -> dict[tuple[str, str], list[str]]:
    """(check, measure) -> the faults seen to violate it, for every measure a clean run
    compared with a bound (checks without their parameters: a measure of a parametrised
    check counts as killed when some parameter's run is)."""
    runs: dict[str, dict[str, dict]] = dict(faulty)
    for (double, fault), records in doubles.items():
        if fault is not None:
            runs[f"{double}/{fault}"] = records
    cleans = [clean] + [r for (_d, f), r in doubles.items() if f is None]
    measures: dict[tuple[str, str], list[str]] = {}
    for records in cleans:
        for check, record in records.items():
            if record["outcome"] == "passed":
                for name in expected(record):
                    measures.setdefault((base(check), name), [])
    for fault, records in runs.items():
        for check, record in records.items():
            for name in violated(record):
                key = (base(check), name)
                if key in measures and fault not in measures[key]:
                    measures[key].append(fault)
    return measures


def write_matrix(
    clean: dict[str, dict],
    faulty: dict[str, dict[str, dict]],
    doubles: dict[tuple[str, str | None], dict[str, dict]],
    out: Path,
    live: set[str],
) -> str:
    coverage = measure_coverage(clean, faulty, doubles)
    columns = list(faulty) + [f"{d}/{f}" for (d, f) in doubles if f is not None]
    runs = {**faulty, **{f"{d}/{f}": r for (d, f), r in doubles.items() if f is not None}}
    killed = sum(1 for faults in coverage.values() if faults)
    made = provenance()
    lines = [
        f"Made {made['date']} at commit {made['commit']}. Fault runs made live: {len(live)} of "
        f"{len(runs)}; the others are the evidence committed in docs/mutation-matrix.json "
        "(`make matrix` remakes all of them; a self-test run remakes those whose fingerprint changed).",
        "",
        f"Measures killed: {killed} of {len(coverage)} ({100 * killed / max(len(coverage), 1):.1f} %)",
        "",
        "V = the fault violated the measure, . = measured and held, blank = not run.",
        "",
        "| check | measure | killed by | " + " | ".join(columns) + " |",
        "|---|---|---|" + "---|" * len(columns),
    ]
    for (check, name), faults in sorted(coverage.items()):
        cells = []
        for column in columns:
            records = {c: r for c, r in runs[column].items() if base(c) == check}
            if any(name in violated(r) for r in records.values()):
                cells.append("V")
            elif any(name in expected(r) for r in records.values()):
                cells.append(".")
            else:
                cells.append(" ")
        gap = f"GAP: {KNOWN_GAPS[(check, name)]}" if (check, name) in KNOWN_GAPS else ""
        lines.append(
            f"| {check} | {name} | {', '.join(faults) or gap or '**none**'} | " + " | ".join(cells) + " |"
        )
    mark = {"passed": ".", "failed": "F", "error": "E", "skipped": "s", "xfailed": "x"}
    lines += ["", "Checks: F = failed under the fault (killed), . = passed, s = skipped", ""]
    lines += ["| check | clean | " + " | ".join(faulty) + " |", "|---|---|" + "---|" * len(faulty)]
    for check in sorted(clean):
        row = [mark.get(clean[check]["outcome"], "?")]
        for fault in faulty:
            record = faulty[fault].get(check)
            row.append(mark.get(record["outcome"], "?") if record else " ")
        lines.append(f"| {check} | " + " | ".join(row) + " |")
    if EXCLUDED_ON_CPU:
        lines += [
            "",
            "Left out of this CPU matrix: "
            + "; ".join(f"{n} (needs {w})" for n, w in EXCLUDED_ON_CPU.items()),
        ]
    cleans = [clean] + [r for (_d, f), r in doubles.items() if f is None]
    required = sorted({(base(c), n) for runs_ in cleans for c, r in runs_.items() for n in preconditions(r)})
    lines += [
        "",
        "Preconditions of the workloads (not measures of the engine: unmet, the check fails as "
        "'could not judge', never passes): " + ", ".join(f"{c}:{n}" for c, n in required),
    ]
    text = "\n".join(lines)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mutation-matrix.md").write_text("Mutation matrix (per measure)\n\n" + text + "\n")
    (out / "mutation-matrix.json").write_text(
        json.dumps(
            {
                "measures_total": len(coverage),
                "preconditions": [{"check": c, "name": n} for c, n in required],
                "measures_killed": killed,
                "measures": [
                    {"check": c, "measure": m, "killed_by": f, "gap": KNOWN_GAPS.get((c, m), "")}
                    for (c, m), f in sorted(coverage.items())
                ],
                "faults": {
                    name: {"killed_by": list(f.killed_by), "violates": list(f.violates), "needs": f.needs}
                    for name, f in FAULTS.items()
                },
                "double_faults": {
                    f"{d}/{n}": {"killed_by": list(f.killed_by), "violates": list(f.violates)}
                    for d, faults in faults_by_double().items()
                    for n, f in faults.items()
                },
                "excluded_on_cpu": EXCLUDED_ON_CPU,
                "made": made,
                "live": sorted(live),
                "evidence": evidence(faulty, doubles),
            },
            indent=1,
        )
    )
    return text


def provenance() -> dict[str, str]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = "+uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": git("rev-parse", "--short", "HEAD") + dirty,
    }


def evidence(
    faulty: dict[str, dict[str, dict]], doubles: dict[tuple[str, str | None], dict[str, dict]]
) -> dict[str, dict]:
    """Each fault run's records (slimmed) with the fingerprint of what it ran."""
    out = {
        f"reference/{name}": {
            "fingerprint": reference_fingerprint(name),
            "records": {c: slim(r) for c, r in records.items()},
        }
        for name, records in faulty.items()
    }
    for (double, fault), records in doubles.items():
        if fault is not None:
            out[f"{double}/{fault}"] = {
                "fingerprint": double_fingerprint(double, fault, PROVES[double][0]),
                "records": {c: slim(r) for c, r in records.items()},
            }
    return out


def test_clean_engine_passes_every_check(matrix) -> None:
    clean, _ = matrix
    bad = {c: r["outcome"] for c, r in clean.items() if r["outcome"] not in ("passed", "skipped")}
    assert not bad, f"checks not passing on the clean reference engine: {bad}"
    assert sum(r["outcome"] == "passed" for r in clean.values()) >= 20, "too few checks ran"


@pytest.mark.parametrize("fault", sorted(f for f in FAULTS if f not in EXCLUDED_ON_CPU))
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
            want = FAULTS[fault].expected_violations(check)
            assert want, f"fault {fault} names no measure it violates in {check}"
            assert violated(record) == want, (
                f"fault {fault} in {check}: VIOLATED {sorted(violated(record))}, declared {sorted(want)}"
            )


def test_every_fault_names_measures_its_checks_record(matrix) -> None:
    """A `violates` entry must name a measure some killed check records (no dead entries)."""
    clean, _ = matrix
    for name, fault in FAULTS.items():
        for entry in fault.violates:
            measure = entry.rpartition(":")[2] if ":" in entry.replace("::", "") else entry
            checks = [c for c in clean if any(matches(c, p) for p in fault.killed_by)]
            assert any(measure in expected(clean[c]) for c in checks) or fault.needs, (
                f"fault {name}: {entry!r} is no measure of {checks} on the clean engine"
            )


def test_every_check_can_fail(matrix) -> None:
    clean, _ = matrix
    killers = [p for f in FAULTS.values() if not f.needs for p in f.killed_by]
    ran = [c for c, r in clean.items() if r["outcome"] == "passed"]
    unkilled = [c for c in ran if not any(matches(c, p) for p in killers)]
    assert not unkilled, f"checks no fault kills (they could be unable to fail): {unkilled}"
    skipped = [c for c, r in clean.items() if r["outcome"] == "skipped"]
    unproved = [c for c in skipped if base(c) not in PROVED_ELSEWHERE]
    assert not unproved, f"checks the reference engine skips and nothing proves can fail: {unproved}"
    for check, test in PROVED_ELSEWHERE.items():
        assert (ROOT / test).exists(), f"{check}: proof {test} is missing"
        if test.startswith("docs/"):  # a recorded real-engine run, not a self-test
            assert f"`{check}`" in (ROOT / test).read_text(), f"{check}: {test} records no run of it"


def test_measure_coverage_has_no_unlisted_gap(coverage) -> None:
    unkilled = {key for key, faults in coverage.items() if not faults}
    unlisted = sorted(unkilled - set(KNOWN_GAPS))
    assert not unlisted, f"measures no fault or double violates (a measure that cannot fail): {unlisted}"
    closed = sorted(set(KNOWN_GAPS) - unkilled)
    assert not closed, f"KNOWN_GAPS lists measures that are killed now (remove them): {closed}"


@pytest.mark.xfail(bool(KNOWN_GAPS), reason=f"{len(KNOWN_GAPS)} measures not killed yet", strict=True)
def test_every_measure_is_killed(coverage) -> None:
    unkilled = sorted(key for key, faults in coverage.items() if not faults)
    killed = len(coverage) - len(unkilled)
    assert not unkilled, f"{killed} of {len(coverage)} measures killed; not killed: {unkilled}"


def test_every_fault_fingerprints_the_suite_modules_of_its_checks() -> None:
    """A fault's committed run is reused only while its fingerprint holds: it must cover the
    module of every check the fault must fail, or an edited check would keep stale evidence."""
    for name, fault in FAULTS.items():
        for pattern in fault.killed_by:
            assert suite_files([pattern]), f"fault {name}: no suite module defines {pattern!r}"
