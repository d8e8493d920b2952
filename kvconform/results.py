"""Results per check, with numbers: what the report, the gate and the matrix read.

A check records measurements through a `Verdict`; each expectation compares an observed
number with a bound computed independently of the engine. `conclude()` fails the check with
every broken expectation and its numbers, so the message alone is enough to act on.
"""

from __future__ import annotations

import json
import math
import operator
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvconform.formatting import value_text

Better = Literal["higher", "lower", "exact"] | None

_OPS: dict[str, Callable[[float, float], bool]] = {
    "==": operator.eq,
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}


@dataclass
class Measure:
    name: str
    value: float | int | str | None
    unit: str = ""
    op: str | None = None
    bound: float | int | str | None = None
    ok: bool | None = None
    better: Better = None  # for the gate: which direction is a regression
    tolerance: float = 0.0  # for the gate: change within this is noise
    note: str = ""
    inconclusive: bool = False  # a noisy estimate whose confidence band straddles the bound
    # A precondition of the workload (it ran, it produced what the check judges), not a claim
    # about the engine: unmet, the check could not judge and fails as such, never passes.
    precondition: bool = False

    def describe(self) -> str:
        unit = f" {self.unit}" if self.unit else ""
        if self.op is None:
            return f"{self.name} = {value_text(self.value)}{unit}"
        mark = (
            "INCONCLUSIVE"
            if self.inconclusive
            else "ok"
            if self.ok
            else "PRECONDITION NOT MET"
            if self.precondition
            else "VIOLATED"
        )
        bound = value_text(self.bound)
        text = f"{self.name} = {value_text(self.value)}{unit}, expected {self.op} {bound}{unit} [{mark}]"
        return f"{text} ({self.note})" if self.note else text


class Inconclusive(AssertionError):
    """A check whose noisy estimate could not be told apart from its bound: never a pass."""


INCONCLUSIVE = "INCONCLUSIVE"


# Measures every check of an engine carries, judged by one code path (the verdict fixture's
# before_conclude judges): one measure of the engine, whichever check it was recorded in.
SELF_CHECK_MEASURE = "engine_self_check_alarms"
ENGINE_WIDE_MEASURES = frozenset({SELF_CHECK_MEASURE})
EVERY_CHECK = "(every check)"


def measure_key(check: str, measure: str) -> str:
    """'check :: measure' as the proof table keys it (engine-wide measures under EVERY_CHECK)."""
    return f"{EVERY_CHECK if measure in ENGINE_WIDE_MEASURES else check} :: {measure}"


class Verdict:
    """Collects one check's measurements and expectations."""

    def __init__(self, check: str, engine: str) -> None:
        self.check = check
        self.engine = engine
        self.measures: list[Measure] = []
        self.series: dict[str, list[tuple[float, float]]] = {}
        self.concluded = False
        # The AssertionError conclude() raised: a known finding's xfail holds only for it.
        self.concluded_failure: AssertionError | None = None
        # judged at conclude(), before the verdict: measures every check of an engine carries
        self.before_conclude: list[Callable[[Verdict], None]] = []

    def record(
        self,
        name: str,
        value: Any,
        unit: str = "",
        better: Better = None,
        tolerance: float = 0.0,
        note: str = "",
    ) -> Any:
        self.measures.append(
            Measure(name, _plain(value), unit, better=better, tolerance=tolerance, note=note)
        )
        return value

    def expect(
        self,
        name: str,
        observed: float,
        op: str,
        bound: float,
        unit: str = "",
        better: Better = None,
        tolerance: float = 0.0,
        abs_tol: float = 0.0,
        note: str = "",
    ) -> bool:
        if op not in _OPS:
            raise ValueError(f"unknown comparison {op!r}")
        if op == "==" and abs_tol:
            ok = abs(observed - bound) <= abs_tol
        elif op in ("<=", "<") and abs_tol:
            ok = _OPS[op](observed, bound + abs_tol)
        elif op in (">=", ">") and abs_tol:
            ok = _OPS[op](observed, bound - abs_tol)
        else:
            ok = bool(_OPS[op](observed, bound))
        if isinstance(observed, float) and math.isnan(observed):
            ok = False
        self.measures.append(
            Measure(name, _plain(observed), unit, op, _plain(bound), ok, better, tolerance, note)
        )
        return ok

    def require(
        self, name: str, observed: float, op: str, bound: float, unit: str = "", note: str = ""
    ) -> bool:
        """A precondition of the check's workload (the failure path ran, entries were damaged,
        the machine took its steps). Unmet, the check fails as 'could not judge': the measures
        it would have judged are void, not passed. Not a measure of the engine, so the
        mutation matrix does not count it."""
        ok = self.expect(name, observed, op, bound, unit, note=note)
        self.measures[-1].precondition = True
        return ok

    def expect_banded(
        self,
        name: str,
        estimate: float,
        band: tuple[float, float],
        op: str,
        bound: float,
        unit: str = "",
        better: Better = None,
        tolerance: float = 0.0,
        note: str = "",
    ) -> bool | None:
        """A noisy estimate with a confidence band: it holds when the whole band satisfies the
        bound, is VIOLATED when the whole band breaks it, and is INCONCLUSIVE (never a pass)
        when the band straddles it. Returns True / False / None accordingly."""
        if op not in ("<=", "<", ">=", ">"):
            raise ValueError(f"a banded expectation needs an order comparison, not {op!r}")
        low, high = sorted(band)
        if any(math.isnan(x) for x in (estimate, low, high)):
            state: bool | None = False
        else:
            holds_all = _OPS[op](high, bound) if op in ("<=", "<") else _OPS[op](low, bound)
            breaks_all = not _OPS[op](low, bound) if op in ("<=", "<") else not _OPS[op](high, bound)
            state = True if holds_all else False if breaks_all else None
        text = f"band [{value_text(low)}, {value_text(high)}]" + (f"; {note}" if note else "")
        self.measures.append(
            Measure(
                name,
                _plain(estimate),
                unit,
                op,
                _plain(bound),
                state,
                better,
                tolerance,
                text,
                inconclusive=state is None,
            )
        )
        return state

    @property
    def undecided(self) -> list[Measure]:
        return [m for m in self.measures if m.inconclusive]

    def equal(self, name: str, observed: float, expected: float, unit: str = "", **kw: Any) -> bool:
        return self.expect(name, observed, "==", expected, unit, better=kw.pop("better", "exact"), **kw)

    def add_series(self, name: str, points: list[tuple[float, float]]) -> None:
        self.series[name] = points

    @property
    def failures(self) -> list[Measure]:
        return [m for m in self.measures if m.ok is False]

    @property
    def unmet(self) -> list[Measure]:
        return [m for m in self.measures if m.precondition and m.ok is False]

    def summary(self) -> str:
        return "\n".join(m.describe() for m in self.measures)

    def conclude(self, context: str = "") -> None:
        """Fail with every violated expectation; pass only if at least one was checked."""
        self.concluded = True
        if not any(m.op is not None and not m.precondition for m in self.measures):
            raise AssertionError(f"{self.check}: no expectation was checked (a check must be able to fail)")
        for judge in self.before_conclude:  # after the test above: they never make a check non-vacuous
            judge(self)
        if self.failures:
            judged = "could not judge (a precondition is not met): " if self.unmet else ""
            head = f"[{self.engine}] {self.check}: {judged}" + "; ".join(m.describe() for m in self.failures)
            body = "\nall measurements:\n" + self.summary()
            if self.undecided:
                body = "\n" + INCONCLUSIVE + " as well: " + ", ".join(m.name for m in self.undecided) + body
            self.concluded_failure = AssertionError(head + (f"\n{context}" if context else "") + body)
            raise self.concluded_failure
        if self.undecided:
            head = f"{INCONCLUSIVE} [{self.engine}] {self.check}: " + "; ".join(
                m.describe() for m in self.undecided
            )
            body = "\nall measurements:\n" + self.summary()
            raise Inconclusive(head + (f"\n{context}" if context else "") + body)

    def as_dict(self) -> dict[str, Any]:
        return {"measures": [asdict(m) for m in self.measures]}


@dataclass
class CheckRecord:
    check: str
    nodeid: str
    engine: str
    engine_version: str
    platform: str
    outcome: str
    duration_s: float
    measures: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""
    finding: str = ""  # known-failure manifest entry that expected this
    finding_measures: list[str] = field(default_factory=list)  # the measures it expects VIOLATED
    finding_class: str = ""  # defect | limitation | known-upstream | unconfirmed (kvconform.findings)
    violated: list[str] = field(default_factory=list)  # the measures this run violated
    # starts, teardowns and waits on each engine during this check (kvconform.timing)
    engine_time: dict[str, dict[str, float]] = field(default_factory=dict)
    written_at: float = field(default_factory=time.time)


class RecordWriter:
    """Appends one JSON line per check, flushed at once: a crash loses nothing written."""

    def __init__(self, results_dir: Path) -> None:
        self.results_dir = results_dir
        results_dir.mkdir(parents=True, exist_ok=True)
        self.path = results_dir / f"records-{os.getpid()}.jsonl"

    def write(self, record: CheckRecord) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(asdict(record)) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def merge(results_dir: Path, session: dict[str, Any]) -> Path:
    """results.json, written atomically (a temporary file renamed over it): a full disk or a
    directory that is not writable leaves no results.json rather than a partial one, and the
    error says where the per-check records still are."""
    records = _read_jsonl(results_dir)
    out = results_dir / "results.json"
    write_atomic(out, json.dumps({"session": session, "records": records}, indent=1))
    return out


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(
            exc.errno,
            f"kvconform: could not write {path} ({exc.strerror or exc}); it was NOT written "
            f"(no partial file); the per-check records are in {path.parent}/records-*.jsonl",
        ) from exc


def _read_jsonl(results_dir: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(results_dir.glob("records-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                records.append(json.loads(line))
    return records


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return value


def source_commit() -> str:
    """The checkout's commit (short), for tables written from a run; "unknown" outside git."""
    import subprocess

    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
