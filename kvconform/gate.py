"""The release gate: a candidate's results against a baseline's, check by check.

    kvconform gate BASELINE CANDIDATE [--markdown]

BASELINE and CANDIDATE are results directories (holding results.json, or the records-*.jsonl of a
run that never merged them) or results.json files. Checks are keyed by engine + check id.

What blocks (exit 1):
  new failure        the candidate fails (failed/error) or carries a known finding (xfailed) of a
                     blocking class (default: defect, known-upstream; `--block-on`) for a check
                     that the baseline did not fail (passed, skipped, or absent)
  missing            a check the baseline ran (passed/failed/...) has no record in the candidate
  no longer run      passed in the baseline, skipped in the candidate: coverage was lost
  measure regression a numeric measure moved beyond its tolerance in the wrong direction
                     (`better`: higher / lower / exact), or an expectation that held is violated
  fails otherwise    a check failing (or a known finding) in both, where the candidate violates
                     a measure the baseline did not, or fails with no violated measure at all
                     (a crash, a timeout, INCONCLUSIVE) where the baseline failed on measures
What does not: a new known finding of a non-blocking class (default: limitation, unconfirmed:
listed apart as "new limitation" / "new unconfirmed", with the finding's text), fixed checks,
improvements, checks still failing in both on the same measures,
new or newly run checks that pass, checks that failed in the baseline and are skipped in the
candidate.

Known findings (xfailed) and checks failing in both are compared number by number like any
other: a known leak whose slope doubles is a measure regression.
An `inconclusive` outcome (a noisy measure that could not be decided) counts as failing.
Exit 0 when nothing blocks, 2 on unreadable input (one line on stderr).

Tolerance is absolute, in the measure's unit. For `exact` measures with a numeric bound, the
distance from the bound is compared; without a bound, any change beyond the tolerance counts.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvconform.errors import KvconformError
from kvconform.formatting import md_cell, value_text
from kvconform.records import CheckResult, RecordsError, number, read
from kvconform.results import Measure

FAILING = frozenset({"failed", "error", "inconclusive"})
# Finding classes (kvconform.findings.CLASSES) whose appearance blocks a release by default; the
# others are listed apart. A record without a class (written before classes) blocks.
BLOCKING_CLASSES = frozenset({"defect", "known-upstream", "unclassified"})
PASSING = frozenset({"passed", "xpassed"})
KNOWN = "xfailed"
NOT_RUN = frozenset({"skipped", "deselected"})

Key = tuple[str, str]  # (engine, check)


class GateInputError(KvconformError):
    """A results file the gate cannot read."""


@dataclass
class Results:
    source: Path
    session: Mapping[str, Any]
    records: dict[Key, CheckResult]
    duplicates: int = 0


@dataclass
class Row:
    verdict: str  # "new failure", "missing", "no longer run", "regression", "fixed", "improvement", ...
    engine: str
    check: str
    detail: str
    blocking: bool


@dataclass
class GateResult:
    baseline: Results
    candidate: Results
    rows: list[Row] = field(default_factory=list)
    unchanged: int = 0
    compared_measures: int = 0

    @property
    def blocking(self) -> list[Row]:
        return [r for r in self.rows if r.blocking]

    @property
    def passed(self) -> bool:
        return not self.blocking

    def count(self, verdict: str) -> int:
        return sum(1 for r in self.rows if r.verdict == verdict)


# --------------------------------------------------------------------------------------- loading


def load(path_text: str) -> Results:
    try:
        run = read(path_text)
    except RecordsError as exc:
        raise GateInputError(str(exc)) from None
    if not run.records:
        raise GateInputError(f"{run.source}: holds no check records (did the run collect any checks?)")
    records: dict[Key, CheckResult] = {}
    duplicates = 0
    for rec in run.records:
        if rec.key in records:
            duplicates += 1
            # the same check twice in one run (reruns): the last written is the run's answer
            if rec.written_at < records[rec.key].written_at:
                continue
        records[rec.key] = rec
    return Results(run.source, run.session, records, duplicates)


# ------------------------------------------------------------------------------------- comparing


def compare(baseline: Results, candidate: Results, block_on: frozenset[str] = BLOCKING_CLASSES) -> GateResult:
    """`block_on`: the finding classes whose new appearance in the candidate blocks."""
    result = GateResult(baseline, candidate)
    keys = sorted(set(baseline.records) | set(candidate.records))
    for key in keys:
        base = baseline.records.get(key)
        cand = candidate.records.get(key)
        engine, check = key
        rows = _compare_outcomes(engine, check, base, cand, block_on)
        if base is not None and cand is not None:
            measure_rows, n = _compare_measures(engine, check, base, cand)
            rows += measure_rows
            result.compared_measures += n
        if rows:
            result.rows += rows
        else:
            result.unchanged += 1
    order = {"new failure": 0, "fails otherwise": 1, "missing": 2, "no longer run": 3, "regression": 4}
    result.rows.sort(key=lambda r: (not r.blocking, order.get(r.verdict, 9), r.engine, r.check))
    return result


def _outcome(rec: CheckResult | None) -> str:
    return "absent" if rec is None else rec.outcome


def _first_line(rec: CheckResult | None) -> str:
    return rec.first_line() if rec is not None else ""


def _compare_outcomes(
    engine: str,
    check: str,
    base: CheckResult | None,
    cand: CheckResult | None,
    block_on: frozenset[str] = BLOCKING_CLASSES,
) -> list[Row]:
    b, c = _outcome(base), _outcome(cand)
    transition = f"{b} -> {c}"
    if cand is None:
        if b in NOT_RUN:
            return []  # it never ran in the baseline either
        return [Row("missing", engine, check, f"{b} in baseline, no record in candidate", True)]
    if base is not None and (c in FAILING or c == KNOWN) and (b in FAILING or b == KNOWN):
        otherwise = _fails_otherwise(base, cand)
        if otherwise:
            return [Row("fails otherwise", engine, check, f"{transition}: {otherwise}", True)]
        if b == KNOWN and c == KNOWN:
            return []
        why = " (known finding in baseline, fails in candidate)" if b == KNOWN else ""
        return [Row("still failing", engine, check, transition + why, False)]
    if c in FAILING:
        detail = transition + (f": {_first_line(cand)}" if _first_line(cand) else "")
        return [Row("new failure", engine, check, detail, True)]
    if c == KNOWN:
        finding = cand.finding.strip()
        detail = transition + (f": {finding}" if finding else "")
        klass = cand.finding_class or "unclassified"
        if klass in block_on:
            return [Row("new failure", engine, check, detail, True)]
        return [Row(f"new {klass}", engine, check, detail, False)]
    if c in PASSING:
        if b in FAILING or b == KNOWN:
            return [Row("fixed", engine, check, transition, False)]
        if base is None:
            return [Row("new check", engine, check, transition, False)]
        if b in NOT_RUN:
            return [Row("now runs", engine, check, transition, False)]
        return []
    if c in NOT_RUN:
        if b in PASSING:
            why = _first_line(cand)
            return [Row("no longer run", engine, check, transition + (f": {why}" if why else ""), True)]
        if b in FAILING or b == KNOWN:
            return [Row("not run", engine, check, transition, False)]
        return []
    return [Row("changed", engine, check, transition, b != c and b in PASSING)]


def _fails_otherwise(base: CheckResult, cand: CheckResult) -> str:
    """Why a check failing in both fails differently in the candidate ('' if it does not)."""
    was, now = base.violated, cand.violated
    if was and not now:
        outcome = _outcome(cand)
        line = _first_line(cand)
        return f"failed on {', '.join(sorted(was))} in baseline, now {outcome} on no measure" + (
            f" ({line})" if line else ""
        )
    new = now - was
    if new:
        return (
            "violates "
            + ", ".join(sorted(new))
            + " as well"
            + (f" (baseline: {', '.join(sorted(was))})" if was else " (baseline failed on no measure)")
        )
    return ""


def _compare_measures(engine: str, check: str, base: CheckResult, cand: CheckResult) -> tuple[list[Row], int]:
    rows: list[Row] = []
    compared = 0
    base_m = base.measures_by_name()
    for name, cm in cand.measures_by_name().items():
        bm = base_m.get(name)
        if bm is None:
            continue
        label = f"{check} :: {name}"
        if bm.ok is True and cm.ok is False:
            detail = f"expectation now violated: {_describe(cm)} (was {value_text(bm.value)})"
            rows.append(Row("regression", engine, label, detail, True))
            continue
        better = cm.better or bm.better
        bv, cv = number(bm.value), number(cm.value)
        if better not in ("higher", "lower", "exact") or bv is None or cv is None:
            continue
        compared += 1
        tol = abs(cm.tolerance or bm.tolerance or 0.0)
        unit = cm.unit or bm.unit
        if better == "exact":
            worse = _exact_worsening(bv, cv, number(bm.bound), number(cm.bound))
        else:
            delta = cv - bv
            worse = delta if better == "lower" else -delta
        unit_text = f" {unit}" if unit else ""
        change = (
            f"{value_text(bv)} -> {value_text(cv)}{unit_text} "
            f"({better} is better, tolerance {value_text(tol)})"
        )
        if worse > tol:
            rows.append(Row("regression", engine, label, change, True))
        elif worse < -tol:
            rows.append(Row("improvement", engine, label, change, False))
    return rows, compared


def _exact_worsening(bv: float, cv: float, b_bound: float | None, c_bound: float | None) -> float:
    """How much further the candidate is from what it should be than the baseline was."""
    if b_bound is not None and c_bound is not None:
        return abs(cv - c_bound) - abs(bv - b_bound)
    return abs(cv - bv)  # no bound to aim at: any change is a move away from the baseline


def _describe(m: Measure) -> str:
    unit = f" {m.unit}" if m.unit else ""
    text = f"{value_text(m.value)}{unit}"
    if m.op:
        text += f", expected {m.op} {value_text(m.bound)}{unit}"
    return text


# -------------------------------------------------------------------------------------- printing


def _session_line(label: str, res: Results) -> str:
    engines = res.session.get("engines") or {}
    if not engines:
        seen: dict[str, str] = {}
        for (engine, _check), rec in res.records.items():
            seen.setdefault(engine, rec.engine_version)
        engines = seen
    versions = ", ".join(f"{e} {v}" for e, v in sorted(engines.items())) or "-"
    platform = res.session.get("platform") or next(
        (r.platform for r in res.records.values() if r.platform), "?"
    )
    extra = f", {res.duplicates} duplicate records (last kept)" if res.duplicates else ""
    return f"{label}: {res.source} — {versions}; platform {platform}; {len(res.records)} checks{extra}"


_PLURAL = {"new failure", "regression", "improvement", "new check"}


def summary(result: GateResult) -> str:
    verdicts = (
        "new failure",
        "fails otherwise",
        "missing",
        "no longer run",
        "regression",
        "fixed",
        "improvement",
    )
    pieces = []
    for verdict in (*verdicts, "new check", "now runs", "still failing", "not run", "changed"):
        n = result.count(verdict)
        if n:
            pieces.append(f"{n} {verdict}{'s' if n > 1 and verdict in _PLURAL else ''}")
    pieces.append(f"{result.unchanged} unchanged")
    head = "FAIL" if not result.passed else "PASS"
    return f"gate: {head} — " + ", ".join(pieces) + f" ({result.compared_measures} measures compared)"


def render_plain(result: GateResult) -> str:
    lines = [_session_line("baseline ", result.baseline), _session_line("candidate", result.candidate)]
    warn = _platform_warning(result)
    if warn:
        lines.append(f"warning: {warn}")
    lines.append("")
    if result.rows:
        header = ("", "VERDICT", "ENGINE", "CHECK", "DETAIL")
        table = [header] + [
            ("!!" if r.blocking else "", r.verdict, r.engine, r.check, r.detail) for r in result.rows
        ]
        widths = [max(len(row[i]) for row in table) for i in range(4)]
        for row in table:
            cells = [row[i].ljust(widths[i]) for i in range(4)] + [row[4]]
            lines.append("  ".join(cells).rstrip())
        lines.append("")
    else:
        lines.append("no differences")
        lines.append("")
    lines.append(summary(result))
    return "\n".join(lines)


def render_markdown(result: GateResult) -> str:
    head = "FAIL" if not result.passed else "PASS"
    icon = ":x:" if not result.passed else ":white_check_mark:"
    lines = [f"### kvconform gate: {icon} {head}", ""]
    lines.append(f"- {md_cell(_session_line('baseline', result.baseline))}")
    lines.append(f"- {md_cell(_session_line('candidate', result.candidate))}")
    warn = _platform_warning(result)
    if warn:
        lines.append(f"- **warning:** {md_cell(warn)}")
    lines.append("")
    if result.rows:
        lines.append("| | Verdict | Engine | Check | Detail |")
        lines.append("|---|---|---|---|---|")
        for r in result.rows:
            mark = ":x:" if r.blocking else ""
            lines.append(
                f"| {mark} | {r.verdict} | {md_cell(r.engine)} | `{md_cell(r.check)}` | {md_cell(r.detail)} |"
            )
        lines.append("")
    lines.append(md_cell(summary(result)))
    return "\n".join(lines)


def _platform_warning(result: GateResult) -> str:
    bp = result.baseline.session.get("platform")
    cp = result.candidate.session.get("platform")
    if bp and cp and bp != cp:
        return f"platforms differ ({bp} vs {cp}): memory and timing measures may not be comparable"
    return ""


def run_gate(
    baseline: str,
    candidate: str,
    markdown: bool = False,
    out: TextIO | None = None,
    block_on: frozenset[str] = BLOCKING_CLASSES,
) -> int:
    """Print the comparison; 1 if anything blocks, 0 if not, 2 on unreadable input."""
    out = out or sys.stdout
    try:
        base = load(baseline)
        cand = load(candidate)
    except GateInputError as exc:
        print(f"kvconform gate: {exc}", file=sys.stderr)
        return 2
    result = compare(base, cand, block_on)
    print(render_markdown(result) if markdown else render_plain(result), file=out)
    return 0 if result.passed else 1
