"""The runs behind the mutation matrix, shared by its tests: the reference engine clean and
under each fault, and each test double clean and under each of its faults.

A fault's run is evidence that lasts as long as what it ran: the fault's declaration, the
suite modules of the checks it must fail and the engine or double it is injected into. The
full matrix (`make matrix`, KVCONFORM_MATRIX=full) runs every fault and commits the records
with a fingerprint of those files (docs/mutation-matrix.json). Every other self-test run
runs the clean engines and the SMOKE faults live, and every fault whose fingerprint changed
since (a check it kills or its engine was edited, or it is new); the rest is read from the
committed records. Shared harness code (contract, plugin, results) is not fingerprinted: the
smoke faults exercise it on every run, and the file names the commit it was made at.

Each run happens at most once per self-test session: the first xdist worker to need the runs
makes them (two subprocesses at a time) and leaves them where the other worker reads them.
"""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import json
import os
import re
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvconform.engines.reference.faults import FAULTS, Fault
from tests.doubles import DOUBLES, FAULT_ENV, double_class, faults_by_double
from tests.paths import REPO
from tests.system.suite_runs import run_suites

ROOT = REPO
EVIDENCE = ROOT / "docs" / "mutation-matrix.json"
FULL = os.environ.get("KVCONFORM_MATRIX") == "full"
# Run live on every self-test run whatever the evidence says: cheap faults, at least one per
# suite and two doubles, so fault injection and the reading of records stay tested.
SMOKE: dict[str, tuple[str, ...]] = {
    "reference": (
        "full_prompt_matched",
        "double_unregister_crashes",
        "release_guard_asserts",
        "tiered_usage_stale",
        "copy_stored_once_removed_each",
        "session_growth",
    ),
    "testdouble_radix_cache": ("evict_leaks_slots",),
    "testdouble_remote_tier": ("eviction_never_runs",),
}
# Faults the CPU matrix leaves out, with the reason (the fault's `needs`).
EXCLUDED_ON_CPU = {name: f.needs for name, f in FAULTS.items() if f.needs}
_LOCK = threading.Lock()
_CACHE: dict[str, Any] = {}
Key = tuple[str, str | None]  # (engine or double, fault or None for the clean run)


def violated(record: dict) -> set[str]:
    """The measures a stored record (results.json or the matrix's slim copy) has VIOLATED; an
    unmet precondition (Verdict.require) voids the check, it is no measure of the engine."""
    measures = record.get("measures", [])
    return {m["name"] for m in measures if m.get("ok") is False and not m.get("precondition")}


def expected(record: dict) -> set[str]:
    """Every measure the check compared with a bound, whatever the result."""
    return {
        m["name"] for m in record.get("measures", []) if m.get("op") is not None and not m.get("precondition")
    }


def preconditions(record: dict) -> set[str]:
    """The check's preconditions of its workload (Verdict.require)."""
    return {m["name"] for m in record.get("measures", []) if m.get("precondition")}


def slim(record: dict) -> dict:
    """What the matrix's tests read of a record (no series, no plain recorded values)."""
    keep = ("check", "nodeid", "engine", "engine_version", "outcome")
    measures = [
        {k: m.get(k) for k in ("name", "value", "op", "bound", "ok", "precondition")}
        for m in record.get("measures", [])
        if m.get("op") is not None or m.get("precondition")
    ]
    return {
        **{k: record.get(k) for k in keep},
        "message": record.get("message", "")[:4000],
        "measures": measures,
    }


def suite_files(patterns: Iterable[str]) -> set[Path]:
    """The suite modules defining the checks a fault's `killed_by` names."""
    files: set[Path] = set()
    for pattern in patterns:
        suite, _, name = pattern.partition("::")
        name = name.split("[")[0]
        regex = re.compile(r"^def " + re.escape(name).replace(r"\*", r"\w*") + r"\(", re.M)
        for path in sorted((ROOT / "kvconform" / "suites").glob(f"{suite}/test_*.py")):
            if regex.search(path.read_text()):
                files.add(path)
    return files


def fingerprint(fault: Fault, files: Iterable[Path]) -> str:
    digest = hashlib.sha256(repr((fault.killed_by, fault.violates, fault.needs)).encode())
    for path in sorted(set(files)):
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def reference_fingerprint(name: str) -> str:
    engine = [
        *(ROOT / "kvconform/engines/reference").glob("*.py"),
        *(ROOT / "kvconform/adapters/reference").glob("*.py"),
    ]
    return fingerprint(FAULTS[name], [*engine, *suite_files(FAULTS[name].killed_by)])


def double_fingerprint(double: str, name: str, suites: tuple[str, ...]) -> str:
    files = [Path(inspect.getsourcefile(double_class(double)) or ""), ROOT / "tests/doubles/base.py"]
    files += [ROOT / s for s in suites]
    return fingerprint(faults_by_double()[double][name], files)


def committed() -> dict[str, dict]:
    """The committed evidence by "engine/fault": {"fingerprint", "records"}."""
    if not EVIDENCE.exists():
        return {}
    return json.loads(EVIDENCE.read_text()).get("evidence", {})


def needs_live_run(engine: str, fault: str, print_: str, evidence: dict[str, dict]) -> bool:
    if FULL or fault in SMOKE.get(engine, ()):
        return True
    return evidence.get(f"{engine}/{fault}", {}).get("fingerprint") != print_


def shared(factory: pytest.TempPathFactory, name: str, make: Callable[[], Any]) -> Any:
    """`make()` once per self-test session: under xdist the workers share the base temporary
    directory's parent, and the first to take the lock writes the result there as JSON."""
    base = factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    path = root / f"mutation-runs-{name}.json"
    with open(root / f"mutation-runs-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return json.loads(path.read_text())
        value = make()
        path.write_text(json.dumps(value))
        return value


def run_reference(results: Path, faults: list[str], checks: list[str]) -> dict[str, dict]:
    options = ["--engine", "reference"]
    options += [arg for fault in faults for arg in ("--fault", fault)]
    options += [arg for check in checks for arg in ("--check", check)]
    proc, records = run_suites([str(ROOT / "kvconform" / "suites")], options, results)
    if not records:
        raise AssertionError(f"no results for faults={faults}: exit {proc.returncode}\n{proc.stdout[-3000:]}")
    return records


def reference_matrix(
    factory: pytest.TempPathFactory,
) -> tuple[dict[str, dict], dict[str, dict[str, dict]], set[str]]:
    """(clean records, {fault: records}, the faults run live) of the reference engine, faults
    of the CPU matrix only; the others' records are the committed evidence."""

    def make() -> dict[str, Any]:
        base = factory.mktemp("matrix")
        evidence = committed()
        jobs: dict[str, tuple[list[str], list[str]]] = {"clean": ([], ["*"])}
        kept: dict[str, dict] = {}
        for name, fault in FAULTS.items():
            if name in EXCLUDED_ON_CPU:
                continue
            if needs_live_run("reference", name, reference_fingerprint(name), evidence):
                jobs[name] = ([name], list(fault.killed_by))
            else:
                kept[name] = evidence[f"reference/{name}"]["records"]
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {n: pool.submit(run_reference, base / n, *job) for n, job in jobs.items()}
            outcomes = {n: f.result() for n, f in futures.items()}
        clean = outcomes.pop("clean")
        return {"clean": clean, "faulty": {**kept, **outcomes}, "live": sorted(outcomes)}

    with _LOCK:
        if "reference" not in _CACHE:
            _CACHE["reference"] = shared(factory, "reference", make)
        runs = _CACHE["reference"]
    faulty = {name: runs["faulty"][name] for name in FAULTS if name in runs["faulty"]}
    return runs["clean"], faulty, set(runs["live"])


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
    factory: pytest.TempPathFactory, proves: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]
) -> dict[Key, dict[str, dict]]:
    """{(double, fault or None): records} for every double clean and under each of its faults
    (live or committed, as for the reference engine)."""

    def make() -> dict[str, Any]:
        base = factory.mktemp("doubles")
        evidence = committed()
        faults = faults_by_double()
        jobs: dict[Key, list[str]] = {}
        kept: dict[str, dict] = {}
        for double in DOUBLES:
            jobs[(double, None)] = ["*"]
            for name, fault in faults[double].items():
                if needs_live_run(
                    double, name, double_fingerprint(double, name, proves[double][0]), evidence
                ):
                    jobs[(double, name)] = list(fault.killed_by)
                else:
                    kept[f"{double}/{name}"] = evidence[f"{double}/{name}"]["records"]
        # Longest first (Hypothesis shrinking a counterexample, a fault that waits out a
        # timeout: a double's `slow_faults`), so two workers finish together.
        slow = {d for d in DOUBLES if any("hypothesis" in (ROOT / s).read_text() for s in proves[d][0])}
        slow_faults = {(d, f) for d in DOUBLES for f in getattr(double_class(d), "slow_faults", ())}
        order = sorted(jobs, key=lambda j: (j not in slow_faults, j[0] not in slow, j[1] is None))
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {
                job: pool.submit(
                    run_double,
                    base / f"{job[0]}-{job[1] or 'clean'}",
                    job[0],
                    job[1],
                    jobs[job],
                    proves[job[0]][0],
                )
                for job in order
            }
            live = {f"{d}/{f or ''}": future.result() for (d, f), future in futures.items()}
        return {"runs": {**kept, **live}, "live": sorted(k for k in live if not k.endswith("/"))}

    with _LOCK:
        if "doubles" not in _CACHE:
            _CACHE["doubles"] = shared(factory, "doubles", make)
        runs = _CACHE["doubles"]
    out: dict[Key, dict[str, dict]] = {}
    for key, records in runs["runs"].items():
        double, _, fault = key.partition("/")
        out[(double, fault or None)] = records
    return out


def doubles_live() -> set[str]:
    """The double faults ("double/fault") run live this session, once doubles_matrix ran."""
    return set(_CACHE["doubles"]["live"]) if "doubles" in _CACHE else set()
