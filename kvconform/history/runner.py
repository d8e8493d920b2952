"""Run the corpus: each bug's bad and fixed release, the named check on both, one verdict.

A bug is *caught* when its measure is VIOLATED on the bad release and judged and held on the
fixed one. Anything else is said as it is: *missed* (the bad release passes the measure),
*fixed fails* (the fix does not pass: the check or the corpus entry is wrong), or *not judged*
(an environment that did not build, a check that erred or skipped before measuring), with the
reason. Releases run through the bisect machinery: the spec ENGINE-VERSION when one exists,
else one generated from the engine's default spec.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kvconform import bisect
from kvconform.checkids import matches
from kvconform.errors import UsageError
from kvconform.history.corpus import Defect, load
from kvconform.history.verdict import Side, Verdict
from kvconform.records import CheckResult


def judge_side(defect: Defect, step: bisect.Step) -> Side:
    side = Side(step.version)
    if step.results is None:
        side.why = step.error or "no results"
        return side
    records = [
        rec
        for (engine, check), rec in step.results.records.items()
        if engine == defect.engine and matches(check, defect.check)
    ]
    if not records:
        side.why = f"no record of {defect.check} on {defect.engine}"
        return side
    found = []
    for rec in records:
        side.outcomes.append(rec.outcome)
        measure = rec.judged.get(defect.measure)
        if measure is None:
            continue
        found.append(measure)
        side.values.append(measure.value)
    if not found:
        cause = next((c for c in map(_cause, records) if c), "")
        side.why = f"{defect.measure} not judged ({', '.join(side.outcomes)}){': ' + cause if cause else ''}"
        return side
    side.held = all(m.ok is True for m in found)
    return side


def _cause(record: CheckResult) -> str:
    """The first line of a record's message, and the innermost exception its log tail shows."""
    lines = [ln.strip() for ln in record.message.splitlines() if ln.strip()]
    if not lines:
        return ""
    inner = [ln for ln in lines[1:] if re.match(r"^[\w.]+(Error|Exception): ", ln)]
    return lines[0] + (f" ... {inner[-1]}" if inner and inner[-1] != lines[0] else "")


def run_defect(defect: Defect, out: Path, say: Callable[[str], None]) -> Verdict:
    _package, default = bisect.default_version(defect.engine)
    run = bisect.pytest_runner(defect.engine, [defect.check], out / defect.id, default, say=say)
    sides = []
    for version in (defect.bad, defect.fixed):
        say(f"[history {defect.id}] {defect.engine} {version}: {defect.check}")
        side = judge_side(defect, run(version))
        say(f"[history {defect.id}] {version}: {defect.measure} = {side.values} held={side.held} {side.why}")
        sides.append(side)
    return Verdict(defect, sides[0], sides[1])


def run_corpus(defects: Sequence[Defect], out: Path, say: Callable[[str], None]) -> list[Verdict]:
    return [run_defect(d, out, say) for d in defects if d.runnable]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", action="append", default=[], metavar="ID", help="only these bugs")
    parser.add_argument("--work", default="results/history", help="each release's results")
    parser.add_argument("--out", default="docs/history.md", help="the table (and .json beside it)")
    parser.add_argument(
        "--merge", action="store_true", help="keep the verdicts already in --out's .json for bugs not run now"
    )


def run_cli(args: argparse.Namespace) -> int:
    from kvconform.history import table

    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    defects = load()
    unknown = set(args.only) - {d.id for d in defects}
    if unknown:
        raise UsageError(f"no such bugs in the corpus: {', '.join(sorted(unknown))}")
    chosen = [d for d in defects if not args.only or d.id in args.only]
    verdicts = run_corpus(chosen, Path(args.work), say)
    out = Path(args.out)
    rows = table.rows(verdicts, defects, previous=table.read(out) if args.merge else {})
    table.write(rows, out)
    print(table.recall_line(rows))
    print(f"[history] table: {out}")
    return 0 if all(v.status == "caught" for v in verdicts) else 1
