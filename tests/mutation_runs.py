"""The runs behind the mutation matrix, shared by its tests: the reference engine clean and
under each fault, and each test double clean and under each of its faults. Each is run at
most once per test process (both tests/test_mutation_matrix.py and
tests/test_engine_only_checks.py read them), two subprocesses at a time."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kvconform.engines.reference.faults import FAULTS
from kvconform.results import judged_measures
from tests.doubles import DOUBLES, FAULT_ENV, double_class, faults_by_double
from tests.suite_runs import run_suites

ROOT = Path(__file__).resolve().parent.parent
# Faults the CPU matrix leaves out, with the reason (the fault's `needs`).
EXCLUDED_ON_CPU = {name: f.needs for name, f in FAULTS.items() if f.needs}
_LOCK = threading.Lock()
_CACHE: dict[str, object] = {}


def expected(record: dict) -> set[str]:
    """Every measure the check compared with a bound, whatever the result."""
    return set(judged_measures(record))


def preconditions(record: dict) -> set[str]:
    """The check's preconditions of its workload (Verdict.require)."""
    return {m["name"] for m in record.get("measures", []) if m.get("precondition")}


def run_reference(results: Path, faults: list[str], checks: list[str]) -> dict[str, dict]:
    options = ["--engine", "reference"]
    options += [arg for fault in faults for arg in ("--fault", fault)]
    options += [arg for check in checks for arg in ("--check", check)]
    proc, records = run_suites([str(ROOT / "kvconform" / "suites")], options, results)
    if not records:
        raise AssertionError(f"no results for faults={faults}: exit {proc.returncode}\n{proc.stdout[-3000:]}")
    return records


def reference_matrix(base_dir: Path) -> tuple[dict[str, dict], dict[str, dict[str, dict]]]:
    """(clean records, {fault: records}) of the reference engine, faults of the CPU matrix only."""
    with _LOCK:
        if "reference" not in _CACHE:
            jobs = {"clean": ([], ["*"])}
            for name, fault in FAULTS.items():
                if name not in EXCLUDED_ON_CPU:
                    jobs[name] = ([name], list(fault.killed_by))
            with ThreadPoolExecutor(max_workers=2) as pool:
                futures = {n: pool.submit(run_reference, base_dir / n, *job) for n, job in jobs.items()}
                outcomes = {n: f.result() for n, f in futures.items()}
            _CACHE["reference"] = (outcomes.pop("clean"), outcomes)
        return _CACHE["reference"]  # type: ignore[return-value]


def run_double(
    results: Path,
    double: str,
    fault: str | None,
    checks: list[str],
    suites: tuple[str, ...],
    plugin: bool = True,
):
    options = ["--engine", double]
    if not any("hypothesis" in (ROOT / s).read_text() for s in suites):
        options += ["-p", "no:hypothesispytest"]  # a second less per run where no check uses it
    if plugin:
        options += ["-p", "tests.doubles.plugin"]
    options += [arg for check in checks for arg in ("--check", check)]
    proc, records = run_suites(list(suites), options, results, env={FAULT_ENV: fault or ""}, timeout=300)
    if not plugin:
        return proc
    if not records:
        raise AssertionError(
            f"no results for {double} fault={fault}: exit {proc.returncode}\n{proc.stdout[-3000:]}"
        )
    return records


def doubles_matrix(
    base_dir: Path, proves: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
) -> dict[tuple[str, str | None], dict[str, dict]]:
    """{(double, fault or None): records} for every double and each of its faults."""
    with _LOCK:
        if "doubles" not in _CACHE:
            faults = faults_by_double()
            jobs: dict[tuple[str, str | None], list[str]] = {}
            for double in DOUBLES:
                jobs[(double, None)] = ["*"]
                for name, fault in faults[double].items():
                    jobs[(double, name)] = list(fault.killed_by)
            # Longest first (Hypothesis shrinking a counterexample, a fault that waits out a
            # timeout: a double's `slow_faults`), so two workers finish together.
            slow = {d for d in DOUBLES if any("hypothesis" in (ROOT / s).read_text() for s in proves[d][0])}
            slow_faults = {(d, f) for d in DOUBLES for f in getattr(double_class(d), "slow_faults", ())}
            jobs = dict(
                sorted(
                    jobs.items(),
                    key=lambda j: (j[0] not in slow_faults, j[0][0] not in slow, j[0][1] is None),
                )
            )
            with ThreadPoolExecutor(max_workers=2) as pool:
                futures = {
                    job: pool.submit(
                        run_double,
                        base_dir / f"{job[0]}-{job[1] or 'clean'}",
                        job[0],
                        job[1],
                        checks,
                        proves[job[0]][0],
                    )
                    for job, checks in jobs.items()
                }
                _CACHE["doubles"] = {job: f.result() for job, f in futures.items()}
        return _CACHE["doubles"]  # type: ignore[return-value]
