"""The machinery of real-engine mutants, without an engine: the import hook rewrites a module's
source in a fresh interpreter (as in an engine process) and says so; a patch that does not match
stops the import naming the mutant; the catalog refuses incomplete entries; a mutant is judged
killed only where the clean run had the measure ok and the mutant run had it VIOLATED."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvconform.errors import UsageError
from kvconform.mutants import activation, catalog
from kvconform.mutants.proof import judge_mutant
from kvconform.records import CheckResult, Run

MODULE = "def freed(blocks):\n    returned = list(blocks)\n    return returned\n"


def mutant(old: str, new: str, measures: tuple[str, ...] = ("leaked_blocks",)) -> catalog.Mutant:
    return catalog.Mutant(
        name="keeps_last_block",
        engine="toy",
        bug="toy engine: the last block of a request is never returned",
        patches=(catalog.Patch("toy_engine.pool", old, new),),
        violates=(catalog.Expectation("suite::test_release", measures),),
        source=Path("mutants.toml"),
    )


def run_engine_python(tmp_path: Path, m: catalog.Mutant) -> tuple[subprocess.CompletedProcess[str], Path]:
    package = tmp_path / "site" / "toy_engine"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "pool.py").write_text(MODULE)
    saved = dict(os.environ)
    try:
        applied = activation.activate(m, tmp_path / "work")
        env = dict(os.environ)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(tmp_path / "site")])
    code = "from toy_engine.pool import freed; print(freed([1, 2, 3]))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    return proc, applied


def test_hook_rewrites_the_engine_module_and_records_it(tmp_path: Path) -> None:
    proc, applied = run_engine_python(
        tmp_path, mutant("    returned = list(blocks)\n", "    returned = list(blocks)[:-1]\n")
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[1, 2]"
    assert "[kvconform mutant keeps_last_block] toy_engine.pool patched" in proc.stderr
    assert activation.applied_modules(applied) == ["toy_engine.pool"]


def test_patch_that_does_not_match_stops_the_import(tmp_path: Path) -> None:
    proc, applied = run_engine_python(
        tmp_path, mutant("    returned = tuple(blocks)\n", "    returned = ()\n")
    )
    assert proc.returncode != 0
    assert "kvconform mutant keeps_last_block: patch 0 of toy_engine.pool matches 0 time(s)" in proc.stderr
    assert activation.applied_modules(applied) == []


def test_without_a_mutant_nothing_is_set(tmp_path: Path) -> None:
    assert activation.SPEC_ENV not in os.environ
    assert str(activation.HOOK_DIR) not in os.environ.get("PYTHONPATH", "")


def test_catalog_refuses_an_entry_without_what_it_needs(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="lacks bug, violates"):
        catalog._parse({"name": "x", "patch": [{"module": "m", "old": "a", "new": "b"}]}, "toy", tmp_path)


def test_a_borrowed_mutant_keeps_its_patches_with_its_own_measures(tmp_path: Path) -> None:
    vllm = catalog.find("vllm", "shm_ring_not_unlinked")
    stack = catalog.find("vllm-lmcache", "shm_ring_not_unlinked")
    assert stack.engine == "vllm-lmcache" and stack.patches == vllm.patches
    assert stack.bug.startswith(vllm.bug) and "The mutant of vllm" in stack.bug
    raw = {"name": "shm_ring_not_unlinked", "from": "vllm", "bug": "mine"}
    with pytest.raises(UsageError, match="takes its patches and bug from there"):
        catalog._borrowed(raw, "vllm-lmcache", tmp_path)


def test_shipped_catalogs_parse() -> None:
    from kvconform import registry

    found = {name: catalog.mutants_of(name) for name in registry.BUILTIN}
    assert found["vllm"], "vLLM ships mutants"
    for mutants in found.values():
        for m in mutants.values():
            assert m.violates and m.patches and m.bug


def record(check: str, ok: bool | None, value: float) -> CheckResult:
    measures = [{"name": "leaked_blocks", "value": value, "op": "==", "ok": ok}]
    return CheckResult.from_dict(
        {"check": check, "outcome": "passed" if ok else "failed", "measures": measures}
    )


@pytest.mark.parametrize(
    ("clean_ok", "mutant_ok", "applied", "status"),
    [
        (True, False, ["toy_engine.pool"], "killed"),
        (True, True, ["toy_engine.pool"], "survived"),
        (False, False, ["toy_engine.pool"], "clean fails"),
        (True, False, [], "not applied"),
    ],
)
def test_judged_killed_only_against_a_passing_clean_run(
    clean_ok: bool, mutant_ok: bool, applied: list[str], status: str
) -> None:
    m = mutant("a", "b")
    clean = Run(Path("clean"), {}, (record("suite::test_release", clean_ok, 0),))
    mutated = Run(
        Path("mutant"), {"mutant": {"applied": applied}}, (record("suite::test_release", mutant_ok, 1),)
    )
    (outcome,) = judge_mutant("toy", m, clean, mutated)
    assert outcome.status == status


def test_a_pattern_skips_the_cases_the_engine_skips() -> None:
    """`[mla-4-*]` on an engine without page size 32: that case is skipped, not "clean fails"."""
    m = mutant("a", "b")
    m = catalog.Mutant(
        m.name,
        m.engine,
        m.bug,
        m.patches,
        (catalog.Expectation("suite::t[*]", ("leaked_blocks",)),),
        m.source,
    )
    skipped = CheckResult.from_dict({"check": "suite::t[32]", "outcome": "skipped", "measures": []})
    clean = Run(Path("clean"), {}, (record("suite::t[16]", True, 0), skipped))
    mutated = Run(
        Path("mutant"),
        {"mutant": {"applied": ["toy_engine.pool"]}},
        (record("suite::t[16]", False, 1), skipped),
    )
    assert [(o.check, o.status) for o in judge_mutant("toy", m, clean, mutated)] == [
        ("suite::t[16]", "killed")
    ]


def test_no_record_is_said_as_such() -> None:
    (outcome,) = judge_mutant("toy", mutant("a", "b"), Run(Path("c"), {}, ()), Run(Path("m"), {}, ()))
    assert outcome.status == "no record"
    assert json.dumps(outcome.__dict__)


def test_merge_replaces_rerun_mutants_and_keeps_the_rest() -> None:
    from kvconform.mutants.proof import EngineProof, MutantOutcome, merge

    def outcome(mutant: str, status: str) -> MutantOutcome:
        return MutantOutcome("e", mutant, "s::test_x", "m", status, 0, 1)

    old = EngineProof(
        "e",
        "1",
        [outcome("a", "killed"), outcome("b", "killed")],
        {"s::test_x :: m": ["mutant a", "mutant b", "finding (defect)"], "s::test_y :: n": []},
        written="2026-12-02 at commit abc",
    )
    new = EngineProof("e", "1", [outcome("b", "survived")], {"s::test_x :: m": [], "s::test_z :: k": []})
    merged = merge(old, new, "def")
    assert [(o.mutant, o.status) for o in merged.outcomes] == [("a", "killed"), ("b", "survived")]
    assert merged.measures["s::test_x :: m"] == ["mutant a", "finding (defect)"]  # b no longer kills
    assert set(merged.measures) == {"s::test_x :: m", "s::test_y :: n", "s::test_z :: k"}
    assert merged.written == "2026-12-02 at commit abc" and "b re-run on" in merged.merged[0]


def test_merge_drops_a_measure_the_new_runs_only_record() -> None:
    """A measure the code now records without judging (a workload that cannot exercise it)
    leaves the table at the next merge that ran its check, kills and all."""
    from kvconform.mutants.proof import EngineProof, merge

    old = EngineProof("e", "1", [], {"s::test_x :: m": ["mutant a"], "s::test_x :: n": []})
    new = EngineProof("e", "1", [], {"s::test_x :: n": []}, recorded_only={"s::test_x :: m"})
    assert set(merge(old, new, "def").measures) == {"s::test_x :: n"}


def test_engine_wide_measures_are_one_row_whatever_the_check() -> None:
    from kvconform.results import SELF_CHECK_MEASURE, measure_key

    assert measure_key("s::test_x", SELF_CHECK_MEASURE) == measure_key("s::test_y", SELF_CHECK_MEASURE)
    assert measure_key("s::test_x", "hits") == "s::test_x :: hits"


def test_a_caught_shipped_bug_proves_its_measure_on_its_engine_only(tmp_path: Path) -> None:
    from kvconform.mutants.proof import EngineProof, credit_releases

    def row(bug: str, engine: str, status: str) -> dict:
        return {"id": bug, "engine": engine, "bad": "1.0", "fixed": "1.1", "status": status,
                "check": "s::test_x[p-1]", "measure": "m"}  # fmt: skip

    history = tmp_path / "history.json"
    rows = [row("caught-1", "e", "caught"), row("missed-1", "e", "missed"), row("other-1", "f", "caught")]
    history.write_text(json.dumps({"rows": rows}))
    proof = EngineProof("e", "1", [], {"s::test_x :: m": []})
    credit_releases([proof], history)
    credit_releases([proof], history)  # idempotent: the table is rewritten on every merge
    assert proof.measures == {"s::test_x :: m": ["release 1.0 (caught-1, fixed in 1.1)"]}


def test_reasons_are_rewritten_from_the_catalog_without_a_session(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvconform.mutants import runner
    from kvconform.mutants.proof import EngineProof, load, write

    out = tmp_path / "mutants.md"
    write([EngineProof("e", "1", [], {"s::test_x :: m": []}, written="2026-12-02 at commit abc")], out, "abc")
    assert "unproven on e: no mutant, release or finding" in out.read_text()
    monkeypatch.setattr(runner, "unproven_reasons", lambda engine: {"s::test_x :: m": f"{engine}: by design"})
    assert runner.rewrite_reasons(out) == 0
    assert "unproven on e: e: by design" in out.read_text()
    (proof,) = load(out.with_suffix(".json"))
    assert proof.written == "2026-12-02 at commit abc" and proof.measures == {"s::test_x :: m": []}
    assert runner.rewrite_reasons(tmp_path / "none.md") == 1


def test_a_mutant_runs_with_the_engines_its_checks_need_beside_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cross-stack check needs a router index beside the patched engine: both sessions, clean
    and mutated, start it, and only the patched engine's records are judged."""
    from kvconform.mutants import proof

    shipped = catalog.find("sglang", "removal_namespaced_apart")
    assert shipped.beside == ("dynamo",)
    argvs: list[list[str]] = []

    def fake_child(argv: list[str], _log: object, timeout_s: float) -> int:
        argvs.append(argv)
        results = Path(argv[argv.index("--results-dir") + 1])
        records = [
            {"check": "suite::test_x", "engine": engine, "outcome": "passed", "measures": []}
            for engine in ("sglang", "dynamo")
        ]
        (results / "results.json").write_text(json.dumps({"session": {}, "records": records}))
        return 0

    monkeypatch.setattr(proof, "run_child_session", fake_child)
    run = proof.run_session("sglang", ["suite::test_x"], tmp_path / "s", "m", 60, beside=("dynamo",))
    argv = argvs[0]
    assert [argv[i + 1] for i, arg in enumerate(argv) if arg == "--engine"] == ["sglang", "dynamo"]
    assert argv[argv.index("--mutant") + 1] == "m"
    assert [r.engine for r in run.records] == ["sglang"]
