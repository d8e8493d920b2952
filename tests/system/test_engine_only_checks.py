"""Checks only real engines can run today can fail, and pass on a correct implementation.

The reference engine lacks RADIX_CACHE_MODEL, RADIX_INDEX, TRACE_REPLAY, BLOCK_TRACKER and
REMOTE_TIER, so the mutation matrix cannot prove their checks; and it does not say how many KV events its
router applied, so the router check's event measures run only where a router says (Dynamo).
Here each of those checks runs, as a pytest subprocess of the suite, against a test double of
its capability (tests/doubles/, registered only through `-p tests.doubles.plugin`): the correct
double must pass every check, and each of the double's faults (KVCONFORM_DOUBLE_FAULT) must
fail the checks in its `killed_by` with a message that names the violated invariant and its
numbers, and with exactly the measures in its `violates` VIOLATED. Every check (every parameter)
must be killed by at least one fault. The doubles are never a run of an engine.

tests/system/test_mutation_matrix.py lists these checks in PROVED_ELSEWHERE, pointing here; the last
test keeps that list and this file's proofs in step.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvconform import registry
from kvconform.checkids import matches
from tests.doubles import DOUBLES, FAULT_ENV, faults_by_double
from tests.paths import REPO
from tests.system.mutation_runs import doubles_matrix, run_double, violated
from tests.system.suite_runs import run_suites

ROOT = REPO
THIS = "tests/system/test_engine_only_checks.py"

# double -> (suite files it runs, check ids it proves without their parameters)
PROVES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "testdouble_radix_cache": (
        ("kvconform/suites/prefix_reuse/test_radix_cache.py",),
        ("prefix_reuse::test_radix_cache_state_machine",),
    ),
    "testdouble_radix_index": (
        (
            "kvconform/suites/prefix_reuse/test_radix_index.py",
            "kvconform/suites/memory_reclaim/test_index_churn.py",
        ),
        (
            "prefix_reuse::test_radix_index_matches_model",
            "memory_reclaim::test_radix_index_memory_flat_under_eviction_churn",
        ),
    ),
    "testdouble_replay": (
        ("kvconform/suites/prefix_reuse/test_replay.py", "kvconform/suites/transfer/test_handoff.py"),
        (
            "prefix_reuse::test_trace_replay_reuse_matches_oracle",
            "transfer::test_handoff_time_matches_bytes_over_bandwidth",
        ),
    ),
    "testdouble_block_tracker": (
        ("kvconform/suites/transfer/test_block_tracker.py",),
        ("transfer::test_block_tracker_ownership_and_drain",),
    ),
    "testdouble_router": (
        ("kvconform/suites/prefix_reuse/test_router.py",),
        ("prefix_reuse::test_router_prediction_matches_worker",),
    ),
    "testdouble_remote_tier": (
        (
            "kvconform/suites/prefix_reuse/test_remote_tier.py",
            "kvconform/suites/offload_metrics/test_remote_tier.py",
        ),
        (
            "prefix_reuse::test_remote_damaged_entry_recomputed",
            "offload_metrics::test_remote_tier_bytes_reconcile",
            "offload_metrics::test_remote_tier_eviction_within_capacity",
            "offload_metrics::test_remote_server_loss",
            "offload_metrics::test_remote_store_counters_track_pending_writes",
        ),
    ),
}
FAULTS = faults_by_double()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str | None], dict[str, dict]]:
    return doubles_matrix(tmp_path_factory, PROVES)


@pytest.mark.parametrize("double", sorted(DOUBLES))
def test_correct_double_passes_every_check(outcomes, double: str) -> None:
    records = outcomes[(double, None)]
    for check in PROVES[double][1]:
        assert any(c.split("[")[0] == check for c in records), f"{double}: check {check} did not run"
    bad = {c: (r["outcome"], r["message"][:300]) for c, r in records.items() if r["outcome"] != "passed"}
    assert not bad, f"checks not passing on the correct {double}: {bad}"
    for record in records.values():
        assert record["engine"] == double and record["engine_version"] == "test double (no fault)", record


@pytest.mark.parametrize(
    "double, fault",
    [(d, f) for d in sorted(DOUBLES) for f in sorted(FAULTS[d])],
    ids=lambda x: x,
)
def test_fault_fails_its_checks_with_numbers(outcomes, double: str, fault: str) -> None:
    records = outcomes[(double, fault)]
    for pattern in FAULTS[double][fault].killed_by:
        hits = {c: r for c, r in records.items() if matches(c, pattern)}
        assert hits, f"{double} fault {fault}: no check matching {pattern!r} ran"
        for check, record in hits.items():
            assert record["engine_version"] == f"test double ({fault})", f"fault {fault} was not active"
            assert record["outcome"] == "failed", (
                f"{double} fault {fault} survived {check} ({record['outcome']})"
            )
            message = record["message"]
            assert "VIOLATED" in message and "expected" in message and re.search(r"= -?\d", message), (
                f"{double} fault {fault}: {check} failed without naming the violated invariant and its "
                f"numbers:\n{message}"
            )
            want = FAULTS[double][fault].expected_violations(check)
            assert want, f"{double} fault {fault} names no measure it violates in {check}"
            assert violated(record) == want, (
                f"{double} fault {fault} in {check}: VIOLATED {sorted(violated(record))}, "
                f"declared {sorted(want)}"
            )


@pytest.mark.parametrize("double", sorted(DOUBLES))
def test_every_check_is_killed_by_a_fault(outcomes, double: str) -> None:
    clean = outcomes[(double, None)]
    unkilled = [
        check
        for check in clean
        if not any(
            outcomes[(double, f)].get(check, {}).get("outcome") == "failed"
            and any(matches(check, p) for p in FAULTS[double][f].killed_by)
            for f in FAULTS[double]
        )
    ]
    assert not unkilled, f"{double}: checks no fault of the double kills: {unkilled}"


def test_proved_elsewhere_points_here_for_exactly_these_checks() -> None:
    from tests.system.test_mutation_matrix import PROVED_ELSEWHERE

    proved = {c for _, checks in PROVES.values() for c in checks} | {CROSS_STACK_CHECK}
    listed = {c for c, test in PROVED_ELSEWHERE.items() if test == THIS}
    assert listed == proved, (
        f"PROVED_ELSEWHERE -> {THIS} lists {sorted(listed - proved)} that this file does not prove, "
        f"and misses {sorted(proved - listed)}"
    )


def test_doubles_exist_only_with_their_plugin(tmp_path: Path) -> None:
    assert not set(DOUBLES) & set(registry.adapters()), "test doubles registered outside their plugin"
    proc = run_double(
        tmp_path, "testdouble_replay", None, ["*"], PROVES["testdouble_replay"][0], plugin=False
    )
    assert proc.returncode != 0 and "unknown engine 'testdouble_replay'" in proc.stdout + proc.stderr, (
        proc.stdout[-1000:] + proc.stderr[-1000:]
    )


CROSS_STACK = "kvconform/suites/prefix_reuse/test_cross_stack.py"
CROSS_STACK_CHECK = "prefix_reuse::test_events_replayed_into_router_index_match"


def run_cross_stack(results: Path, fault: str | None) -> dict[str, dict]:
    options = [
        "--engine",
        "testdouble_radix_cache",
        "--engine",
        "testdouble_radix_index",
        "-p",
        "tests.doubles.plugin",
    ]
    _proc, records = run_suites(
        [CROSS_STACK],
        options,
        results,
        env={FAULT_ENV: fault or ""},
        timeout=300,
        engine="testdouble_radix_cache",
    )
    return records


@pytest.mark.parametrize("fault", [None, "index_ignores_removed"])
def test_cross_stack_check_passes_clean_and_fails_on_a_stale_index(tmp_path: Path, fault: str | None) -> None:
    """The cross-stack check (events of one stack replayed into another's index) with a
    radix-cache double producing the events and an index double consuming them."""
    records = run_cross_stack(tmp_path, fault)
    record = records[CROSS_STACK_CHECK]
    assert record["engine"] == "testdouble_radix_cache", record
    if fault is None:
        assert record["outcome"] == "passed", record["message"]
    else:
        assert record["outcome"] == "failed", record
        assert "VIOLATED" in record["message"], record["message"]
