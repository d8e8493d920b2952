"""`kvconform mutants`: each engine's mutants run against the same checks as the clean engine,
and the per-engine proof table.

For each engine: one clean session of the checks its mutants name, then one session per mutant
(`--mutant NAME`, the same checks). A mutant KILLS a measure when, in its session, the check's
record has that measure VIOLATED while the clean session compared it and found it ok. Anything
else is said as it is: survived (not violated), clean fails, not applied (the engine never
imported the patched module), no record.

The proof table lists every measure an engine's run judged (a results directory of a full run,
`--judged`, plus the clean sessions here) with what was seen to violate it on that engine: a
mutant from this run, or a known finding whose record has it VIOLATED. Everything else is
"unproven on ENGINE". Only recorded VIOLATED measures count, never a file's existence.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvconform.checkids import base_check, matches
from kvconform.mutants.catalog import Mutant, mutants_of, unproven_reasons
from kvconform.processes import run_child_session
from kvconform.records import CheckResult, Run, read
from kvconform.results import measure_key, write_atomic

SUITES = Path(__file__).resolve().parent.parent / "suites"


@dataclass
class MutantOutcome:
    engine: str
    mutant: str
    check: str
    measure: str
    status: str  # killed | survived | clean fails | not applied | no record
    clean: Any = None
    mutated: Any = None


@dataclass
class EngineProof:
    engine: str
    version: str = "unknown"
    outcomes: list[MutantOutcome] = field(default_factory=list)
    # (check, measure) -> what violated it on this engine ("mutant NAME", "finding: ...")
    measures: dict[str, list[str]] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)  # why unproven, where the catalog says
    merged: list[str] = field(default_factory=list)  # runs merged in after the table was written
    written: str = ""  # "DATE at commit X": when this engine's table was run
    # Measures this table's runs recorded and nowhere judged (not kept in the JSON): a merge
    # drops them from the older table, whose runs judged what the code no longer judges.
    recorded_only: set[str] = field(default_factory=set)

    def why_unproven(self, key: str) -> str:
        reason = self.reasons.get(key) or self.reasons.get("*")
        return reason or "no mutant, release or finding has violated it on this engine yet"


def run_session(
    engine: str,
    checks: list[str],
    results: Path,
    mutant: str | None,
    timeout_s: float,
    reuse: bool = False,
    beside: tuple[str, ...] = (),
) -> Run:
    """One pytest session of `checks` on `engine` (and the engines `beside` it, unpatched);
    its results.json (session + `engine`'s records). `reuse`: a session already recorded in
    `results` stands (a table rewritten from earlier runs)."""
    if reuse and (results / "results.json").exists():
        return engine_run(results, engine)
    argv = [sys.executable, "-m", "pytest", str(SUITES), "--engine", engine, "--results-dir", str(results)]
    argv += [arg for other in beside for arg in ("--engine", other)]
    argv += [arg for check in checks for arg in ("--check", check)]
    argv += ["-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    if mutant:
        argv += ["--mutant", mutant]
    results.mkdir(parents=True, exist_ok=True)
    with open(results / "pytest.log", "w") as log:
        if run_child_session(argv, log, timeout_s=timeout_s) is None:
            log.write(f"\nkvconform mutants: session timed out after {timeout_s:.0f} s\n")
    return engine_run(results, engine) if (results / "results.json").exists() else Run(results, {}, ())


def records_for(run: Run, pattern: str) -> list[CheckResult]:
    return [r for r in run.records if matches(r.check, pattern)]


def judge_mutant(engine: str, mutant: Mutant, clean: Run, mutated: Run) -> list[MutantOutcome]:
    applied = (mutated.session.get("mutant") or {}).get("applied") or []
    outcomes = []
    for expectation in mutant.violates:
        cleans = records_for(clean, expectation.check)
        if "*" in expectation.check:  # a pattern names the cases this engine runs, not those it skips
            cleans = [c for c in cleans if c.outcome != "skipped"]
        pairs = [(c, m) for c in cleans for m in records_for(mutated, c.check)]
        for measure in expectation.measures:
            if not pairs:
                outcomes.append(MutantOutcome(engine, mutant.name, expectation.check, measure, "no record"))
                continue
            for clean_rec, mut_rec in pairs:
                before = clean_rec.judged.get(measure)
                after = mut_rec.judged.get(measure)
                if not applied:
                    status = "not applied"
                elif before is None or before.ok is not True:
                    status = "clean fails"
                elif after is not None and after.ok is False:
                    status = "killed"
                else:
                    status = "survived"
                outcomes.append(
                    MutantOutcome(
                        engine,
                        mutant.name,
                        clean_rec.check,
                        measure,
                        status,
                        None if before is None else before.value,
                        None if after is None else after.value,
                    )
                )
    return outcomes


def engine_run(results: Path, engine: str) -> Run:
    """A finished run's session and its records of `engine`."""
    run = read(results)
    return Run(run.source, run.session, tuple(r for r in run.records if r.engine == engine))


def prove_engine(
    engine: str,
    work: Path,
    only: list[str] | None = None,
    judged: Sequence[Path] = (),
    timeout_s: float = 1800,
    clean_from: Path | None = None,
    reuse: bool = False,
) -> EngineProof:
    """`clean_from`: a finished run of the clean engine whose records stand for the clean session
    (CI's engines run), so only the mutant sessions are run."""
    mutants = [m for name, m in mutants_of(engine).items() if not only or name in only]
    proof = EngineProof(engine, reasons=unproven_reasons(engine))
    checks = list(dict.fromkeys(c for m in mutants for c in m.checks()))
    runs: list[Run] = []
    runs += [engine_run(path, engine) for path in judged]
    for run in runs:
        proof.version = str(run.session.get("engines", {}).get(engine, proof.version))
    if mutants:
        if clean_from is not None:
            clean = engine_run(clean_from, engine)
        else:
            clean = run_session(engine, checks, work / engine / "clean", None, timeout_s, reuse)
        proof.version = str(clean.session.get("engines", {}).get(engine, "unknown"))
        runs.append(clean)
        for mutant in mutants:
            beside_clean = clean
            if mutant.beside:  # its own clean session, with the same engines beside it
                beside_clean = run_session(
                    engine,
                    mutant.checks(),
                    work / engine / f"clean-{mutant.name}",
                    None,
                    timeout_s,
                    reuse,
                    mutant.beside,
                )
                runs.append(beside_clean)
            mutated = run_session(
                engine,
                mutant.checks(),
                work / engine / mutant.name,
                mutant.name,
                timeout_s,
                reuse,
                mutant.beside,
            )
            proof.outcomes += judge_mutant(engine, mutant, beside_clean, mutated)
    recorded: set[str] = set()
    for run in runs:
        for record in run.records:
            recorded |= {measure_key(base_check(record.check), m.name) for m in record.measures}
            for name, measure in record.judged.items():
                killers = proof.measures.setdefault(measure_key(base_check(record.check), name), [])
                if record.finding and measure.ok is False:
                    label = f"finding ({record.finding_class or 'unclassified'})"
                    if label not in killers:
                        killers.append(label)
    for outcome in proof.outcomes:
        key = measure_key(base_check(outcome.check), outcome.measure)
        if outcome.status == "killed" and f"mutant {outcome.mutant}" not in proof.measures.setdefault(
            key, []
        ):
            proof.measures[key].append(f"mutant {outcome.mutant}")
    proof.recorded_only = recorded - set(proof.measures)
    return proof


def credit_releases(proofs: list[EngineProof], history: Path) -> None:
    """Each caught shipped bug (docs/history.json of `kvconform history`) proves its measure on
    its engine: its bad release had it VIOLATED, its fixed release held it."""
    if not history.exists():
        return
    by_engine = {p.engine: p for p in proofs}
    for row in json.loads(history.read_text()).get("rows", []):
        proof = by_engine.get(row.get("engine", ""))
        if proof is None or row.get("status") != "caught":
            continue
        key = measure_key(base_check(row["check"]), row["measure"])
        label = f"release {row['bad']} ({row['id']}, fixed in {row['fixed']})"
        killers = proof.measures.setdefault(key, [])
        if label not in killers:
            killers.append(label)


def load(path: Path) -> list[EngineProof]:
    """A proof table's JSON (write()) back as EngineProofs; [] where there is none. Tables
    from before per-engine stamps take the stamp of their markdown's first line."""
    if not path.exists():
        return []
    md = path.with_suffix(".md")
    stamp = re.search(r"on (\S+) at commit (\w+)", md.read_text()) if md.exists() else None
    written = f"{stamp[1]} at commit {stamp[2]}" if stamp else "unknown"
    return [
        EngineProof(
            p["engine"],
            p.get("version", "unknown"),
            [MutantOutcome(**o) for o in p.get("outcomes", [])],
            dict(p.get("measures", {})),
            dict(p.get("unproven_reasons", {})),
            list(p.get("merged", [])),
            p.get("written") or written,
        )
        for p in json.loads(path.read_text())
    ]


def merge(old: EngineProof, new: EngineProof, commit: str) -> EngineProof:
    """`new` (some mutants re-run) into `old` (the full run's table): the re-run mutants'
    outcomes replace theirs, every other outcome and every judged measure is kept, and each
    measure's killers are the union (a re-run mutant's kill only where it killed now). A
    measure the new runs recorded without judging it anywhere leaves the table: the code
    judges it no more (its old kills are old news)."""
    rerun = {o.mutant for o in new.outcomes}
    outcomes = [o for o in old.outcomes if o.mutant not in rerun] + new.outcomes
    measures: dict[str, list[str]] = {}
    for key in {**old.measures, **new.measures}:
        if key in new.recorded_only:
            continue
        kept = [k for k in old.measures.get(key, []) if k.removeprefix("mutant ") not in rerun]
        measures[key] = list(dict.fromkeys(kept + new.measures.get(key, [])))
    when = f"{', '.join(sorted(rerun))} re-run on {dt.date.today().isoformat()} at commit {commit}"
    return EngineProof(
        new.engine,
        new.version,
        outcomes,
        measures,
        new.reasons,
        [*dict.fromkeys([*old.merged, when])],
        old.written,
    )


def render(proofs: list[EngineProof], commit: str) -> str:
    today = dt.date.today().isoformat()
    lines = [
        "# Mutants of the real engines and the per-engine proof table",
        "",
        f"Written by `make mutants` (`kvconform mutants`) on {today} at commit {commit}; each engine's "
        "section says when its mutants ran where that differs. A measure counts "
        "as proven on an engine only where a recorded run on that engine had it VIOLATED: a mutant of the "
        "engine's own code (clean passing in the same run), a release that shipped the bug (docs/history.md: "
        "its bad release violated the measure, its fixed release held it), or a known finding. Mutants: each "
        "adapter's `mutants.toml`.",
        "",
        "## Mutants",
        "",
        "| engine | mutant | check | measure | clean | mutant | status |",
        "|---|---|---|---|---|---|---|",
    ]
    for proof in proofs:
        for o in proof.outcomes:
            cells = [o.engine, o.mutant, f"`{o.check}`", f"`{o.measure}`", o.clean, o.mutated, o.status]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    lines += ["", "## Proof table", ""]
    for proof in proofs:
        proven = sum(1 for k in proof.measures.values() if k)
        lines += [
            f"### {proof.engine} ({proof.version}): {proven} of {len(proof.measures)} judged measures proven",
            "",
            *([f"Run on {proof.written}."] if proof.written else []),
            *(f"Merged in (`kvconform mutants --merge`): {m}." for m in proof.merged),
            *([""] if proof.merged or proof.written else []),
            "| check :: measure | violated on this engine by |",
            "|---|---|",
        ]
        for key in sorted(proof.measures):
            killers = proof.measures[key]
            said = ", ".join(killers) if killers else f"unproven on {proof.engine}: {proof.why_unproven(key)}"
            lines.append(f"| `{key}` | {said} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def write(proofs: list[EngineProof], out: Path, commit: str) -> None:
    write_atomic(out, render(proofs, commit))
    data = [
        {
            "engine": p.engine,
            "version": p.version,
            "outcomes": [asdict(o) for o in p.outcomes],
            "measures": p.measures,
            "unproven_reasons": p.reasons,
            "merged": p.merged,
            "written": p.written or f"{dt.date.today().isoformat()} at commit {commit}",
        }
        for p in proofs
    ]
    write_atomic(out.with_suffix(".json"), json.dumps(data, indent=1))
