"""Check records read back from a run, as typed values: the one reader the gate, the dashboard,
the report, bisect, the proof table and the release history share.

A results folder holds results.json (merged at the end of a session) or, for a session that
never merged, its records-*.jsonl. Files come from other machines and older versions, so the
reader is lenient about fields and strict about what every record must have (a check id and
an outcome): anything else is a RecordsError naming the file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvconform.errors import KvconformError
from kvconform.formatting import first_line
from kvconform.results import Measure


class RecordsError(KvconformError):
    """A results folder or file that holds no readable records."""


_MEASURE_FIELDS = {f.name for f in fields(Measure)}


def measure_of(raw: Mapping[str, Any]) -> Measure | None:
    """One measure as written by Verdict (None for a malformed entry)."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("name"), str):
        return None
    kept = {k: v for k, v in raw.items() if k in _MEASURE_FIELDS}
    kept["unit"] = str(kept.get("unit") or "")
    kept["note"] = str(kept.get("note") or "")
    kept["tolerance"] = number(kept.get("tolerance")) or 0.0
    return Measure(**kept)


def number(value: Any) -> float | None:
    """A numeric value as a float (None for text, booleans, NaN, absent)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return None if math.isnan(value) else value


@dataclass(frozen=True)
class CheckResult:
    """One check's record of one run, read back."""

    check: str
    outcome: str  # passed / failed / error / xfailed / xpassed / skipped / inconclusive
    nodeid: str = ""
    engine: str = "-"
    engine_version: str = "-"
    platform: str = ""
    message: str = ""
    finding: str = ""  # the known-failure entry that expected this outcome
    finding_class: str = ""
    measures: tuple[Measure, ...] = ()
    listed_violations: tuple[str, ...] | None = None  # the record's own `violated` list
    written_at: float = 0.0
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, raw: Any, where: str = "record") -> CheckResult:
        if not isinstance(raw, Mapping) or not all(isinstance(raw.get(k), str) for k in ("check", "outcome")):
            raise RecordsError(f"{where} lacks a check id or an outcome")
        listed = raw.get("violated")
        return cls(
            check=raw["check"],
            outcome=raw["outcome"],
            nodeid=str(raw.get("nodeid") or ""),
            engine=str(raw.get("engine") or "-"),
            engine_version=str(raw.get("engine_version") or "-"),
            platform=str(raw.get("platform") or ""),
            message=str(raw.get("message") or ""),
            finding=str(raw.get("finding") or ""),
            finding_class=str(raw.get("finding_class") or ""),
            measures=tuple(m for m in map(measure_of, raw.get("measures") or []) if m is not None),
            listed_violations=tuple(str(n) for n in listed) if isinstance(listed, list) else None,
            written_at=number(raw.get("written_at")) or 0.0,
            raw=raw,
        )

    @property
    def key(self) -> tuple[str, str]:
        return (self.engine, self.check)

    @property
    def violated(self) -> set[str]:
        """The measures this run violated: the record's own list, else its measures' verdicts."""
        if self.listed_violations is not None:
            return set(self.listed_violations)
        return {m.name for m in self.measures if m.ok is False}

    @property
    def violated_measures(self) -> list[Measure]:
        return [m for m in self.measures if m.ok is False]

    @property
    def judged(self) -> dict[str, Measure]:
        """Measures compared with a bound (expect/equal), by name, whatever the result;
        preconditions of the workload (Verdict.require) are not measures of the engine."""
        return {m.name: m for m in self.measures if m.op is not None and not m.precondition}

    def measures_by_name(self) -> dict[str, Measure]:
        """Every measure by name; repeated names keep their order: x, x#2, x#3."""
        out: dict[str, Measure] = {}
        for m in self.measures:
            name, n = m.name, 2
            while name in out:
                name = f"{m.name}#{n}"
                n += 1
            out[name] = m
        return out

    def first_line(self, limit: int = 160) -> str:
        return first_line(self.message, limit)


@dataclass(frozen=True)
class Run:
    """A run's session (engines, platform, ...) and its records."""

    source: Path
    session: Mapping[str, Any]
    records: tuple[CheckResult, ...]

    @classmethod
    def from_data(cls, data: Any, source: str | Path = "-") -> Run:
        """From a results.json's content ({"session", "records"}, or a bare list of records)."""
        session: Any
        raws: Any
        if isinstance(data, list):
            session, raws = {}, data
        elif isinstance(data, Mapping) and isinstance(data.get("records"), list):
            session, raws = data.get("session") or {}, data["records"]
        else:
            raise RecordsError(f"{source}: not a kvconform results file (no 'records' list)")
        records = tuple(CheckResult.from_dict(raw, f"{source}: record {i}") for i, raw in enumerate(raws))
        return cls(Path(source), session if isinstance(session, Mapping) else {}, records)


def read(path: str | Path) -> Run:
    """A results folder (results.json, else records-*.jsonl) or a results.json file."""
    path = Path(path)
    if not path.exists():
        raise RecordsError(f"{path}: no such file or directory")
    try:
        if path.is_dir() and not (path / "results.json").is_file():
            raws: list[Any] = []
            for part in sorted(path.glob("records-*.jsonl")):
                raws += [json.loads(line) for line in part.read_text().splitlines() if line.strip()]
            if not raws:
                raise RecordsError(f"{path}: no results.json and no records-*.jsonl in this directory")
            return Run.from_data(raws, path)
        file = path / "results.json" if path.is_dir() else path
        return Run.from_data(json.loads(file.read_text()), path)
    except json.JSONDecodeError as exc:
        raise RecordsError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordsError(f"{path}: cannot read ({exc})") from None


def read_records(path: str | Path) -> list[CheckResult]:
    """The records of a run; [] for a folder that holds none yet."""
    path = Path(path)
    if path.is_dir() and not (path / "results.json").is_file() and not any(path.glob("records-*.jsonl")):
        return []
    return list(read(path).records)
