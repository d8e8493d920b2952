"""The known-failures manifest: real-engine failures recorded as findings, run as strict xfail.

A finding names the engine, its version, the check, the measure(s) that fail with their
direction, the numbers measured when it was found, and its class, decided by the engine's own
contract (its docs, code and tests at that version), never by our policy:

    defect          the engine breaks a promise its own code, docs or tests make (`contract`
                    cites it); it has a standalone reproduction (`repro`, a script that imports
                    nothing of ours and exits non-zero while the bug is there) and a draft
                    upstream report (`report`)
    limitation      the engine does not promise it (`contract` cites where it says so); `closes`
                    names the option or release that does, if any
    known-upstream  a bug already reported upstream (`link` to the open issue or PR)
    unconfirmed     seen, not yet shown to be the engine's (`contract` says what is missing)

A finding applies only to its version: a new release that still fails shows red (update the
manifest), one that now passes shows XPASS(strict) red too (remove the entry).

The xfail is narrower than pytest's: it holds only if the check concluded its verdict with
exactly the finding's measures VIOLATED, each in its direction (`judge`). A crash, a timeout,
a failure before the verdict, or another measure violated (as well or instead) is a plain
failure whose message says what the finding expected and what happened.

    measures = { "server_shm_mapped_bytes.leak_slope" = "above" }   # name (glob) -> direction
    measures = ["server_shm_mapped_bytes.leak_slope"]               # any direction
    numbers = { "server_shm_mapped_bytes.leak_slope" = 4194304.0 }  # measured (optional)
    may_also = { "server_rss_bytes.final_delta" = "above" }           # optional, see below

`may_also` names noisy measures the finding's cause moves too, but not on every run (RSS
grows with each thread an engine keeps, by how much depends on the allocator): violated
alongside the finding's measures they keep the xfail; violated alone they do not, and they
are never required.

Directions: "above" (the value is above its bound: a `<=`/`==` expectation broken upwards),
"below", or "any".

A crash has no measure: a finding whose engine dies in the check names, instead of
`measures`, the text its engine error must contain (the engine's own log line, which the error
quotes). `cpu_flag` limits a finding to hosts whose CPU has that flag (/proc/cpuinfo): a bug of
one instruction set stays a plain failure, never an xfail, on the hosts it cannot reach.

    crash = "Worker proc VllmWorker-0 died unexpectedly"
    cpu_flag = "amx_tile"
"""

from __future__ import annotations

import functools
import math
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, TypeGuard

import pytest

from kvconform.checkids import matches
from kvconform.errors import EngineError, UsageError

MANIFEST_NAME = "known-failures.toml"  # in each adapter's package: the findings on its engine
ENTRY_KEY = pytest.StashKey["Finding"]()
DIRECTIONS = ("above", "below", "any")
CLASSES = ("defect", "limitation", "known-upstream", "unconfirmed")


@dataclass(frozen=True)
class ExpectedMeasure:
    pattern: str  # a measure name, or a glob over measure names
    direction: str = "any"

    def matches(self, name: str, direction: str) -> bool:
        return fnmatchcase(name, self.pattern) and self.direction in ("any", direction)

    def describe(self) -> str:
        return self.pattern if self.direction == "any" else f"{self.pattern} ({self.direction})"


@dataclass(frozen=True)
class Finding:
    engine: str
    version: str
    check: str
    measured: str
    summary: str
    measures: tuple[ExpectedMeasure, ...] = ()
    may_also: tuple[ExpectedMeasure, ...] = ()  # symptoms on noisy measures: allowed, never required
    numbers: dict[str, float] = field(default_factory=dict, hash=False, compare=False)
    link: str = ""
    klass: str = "unconfirmed"  # one of CLASSES (`class` in the manifest)
    contract: str = ""  # the promise broken, cited (or, for a limitation, where none is made)
    closes: str = ""  # a limitation: the option or release that closes it
    repro: Path | None = None  # a defect: its standalone reproduction script
    report: Path | None = None  # a defect: the draft upstream report
    crash: str = ""  # instead of measures: text the check's engine error contains
    cpu_flag: str = ""  # applies only on hosts whose CPU has this flag

    def applies_here(self) -> bool:
        return not self.cpu_flag or self.cpu_flag in cpu_flags()

    @property
    def name(self) -> str:
        """The finding's name for `kvconform repro`: its repro script's stem, else its check."""
        return self.repro.stem if self.repro is not None else self.check

    def reason(self) -> str:
        text = f"{self.klass} on {self.engine} {self.version}: {self.summary} (measured: {self.measured})"
        if self.measures:
            text += "; fails on " + ", ".join(m.describe() for m in self.measures)
        if self.crash:
            text += f"; the engine dies: {self.crash!r}"
        if self.cpu_flag:
            text += f" (hosts with CPU flag {self.cpu_flag})"
        return f"{text} [{self.link}]" if self.link else text

    def measure_names(self) -> list[str]:
        return [m.pattern for m in self.measures]


@dataclass(frozen=True)
class Judgement:
    """Whether a finding's check failed the way the finding says (then it is xfailed)."""

    expected: bool
    explanation: str  # why not, for the failure message; empty when expected
    violated: tuple[str, ...] = ()  # "name (direction)" of every violated measure seen


def violation_direction(measure: Any) -> str:
    """ "above" / "below" the bound for a violated numeric expectation; "any" if not numeric."""
    value, bound = getattr(measure, "value", None), getattr(measure, "bound", None)
    if not _is_number(value) or not _is_number(bound):
        return "any"
    if math.isnan(float(value)):
        return "any"
    if float(value) > float(bound):
        return "above"
    if float(value) < float(bound):
        return "below"
    return "below" if getattr(measure, "op", None) in (">", "!=") else "above"  # strict op at the bound


def judge(entry: Finding, failed: BaseException | None, verdict: Any) -> Judgement:
    """Did the check fail exactly on the finding's measures, in their directions?

    `failed` is the exception the check raised (None if it passed); `verdict` its Verdict
    (None if it used none). Only an AssertionError raised by `Verdict.conclude()` counts.
    """
    if failed is None:
        return Judgement(False, "the check passed (XPASS(strict)): remove the finding from the manifest")
    if entry.crash:
        if isinstance(failed, EngineError) and entry.crash in str(failed):
            return Judgement(True, "")
        first = (str(failed).strip().splitlines() or [""])[0][:300]
        return Judgement(
            False,
            f"the finding expects the engine to die with {entry.crash!r} in its error, but the "
            f"check failed otherwise: {type(failed).__name__}: {first}",
        )
    concluded_with = getattr(verdict, "concluded_failure", None) if verdict is not None else None
    if concluded_with is None or concluded_with is not failed:
        kind = type(failed).__name__
        first = (str(failed).strip().splitlines() or [""])[0][:300]
        return Judgement(
            False,
            f"the finding expects {_names(entry)} VIOLATED, but the check failed otherwise "
            f"(not on its verdict): {kind}: {first}",
        )
    seen = [(m.name, violation_direction(m)) for m in verdict.failures]
    labels = tuple(f"{n} ({d})" if d != "any" else n for n, d in seen)
    if not entry.measures:
        return Judgement(False, "the finding names no measures: add `measures` to its manifest entry", labels)
    unexpected = [
        label
        for (n, d), label in zip(seen, labels, strict=True)
        if not any(e.matches(n, d) for e in (*entry.measures, *entry.may_also))
    ]
    unseen = [e.describe() for e in entry.measures if not any(e.matches(n, d) for n, d in seen)]
    if not unexpected and not unseen:
        return Judgement(True, "", labels)
    parts = []
    if unexpected:
        parts.append("violated beyond the finding: " + ", ".join(unexpected))
    if unseen:
        parts.append("the finding's measures not violated so: " + ", ".join(unseen))
    return Judgement(
        False, f"the finding expects exactly {_names(entry)} VIOLATED; " + "; ".join(parts), labels
    )


def _names(entry: Finding) -> str:
    return ", ".join(m.describe() for m in entry.measures) or "(no measures named)"


def _is_number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class Manifest:
    entries: list[Finding]

    def match(self, engine: str, version: str, check: str) -> Finding | None:
        for entry in self.entries:
            if (
                entry.engine == engine
                and fnmatchcase(version, entry.version)
                and matches(check, entry.check)
                and entry.applies_here()
            ):
                return entry
        return None


def default_manifests(engines: list[str]) -> list[Path]:
    """The manifests shipped with the selected engines' adapters."""
    from kvconform import registry

    found = []
    for name in engines:
        folder = registry.package_resources(name)
        if folder is not None and (folder / MANIFEST_NAME).is_file():
            found.append(Path(str(folder / MANIFEST_NAME)))
    return list(dict.fromkeys(found))


def load(paths: str | Path | list[str | Path] | None, engines: list[str] | None = None) -> Manifest:
    """The given manifest(s); none given: those shipped with `engines`' adapters."""
    if paths is None or paths == []:
        sources = default_manifests(engines or [])
    elif isinstance(paths, str | Path):
        sources = [Path(paths)]
    else:
        sources = [Path(p) for p in paths]
    entries: list[Finding] = []
    for source in sources:
        entries += _load_one(source)
    return Manifest(entries)


def _load_one(source: Path) -> list[Finding]:
    if not source.exists():
        raise UsageError(f"known-failures manifest {source} does not exist")
    with source.open("rb") as fh:
        data = tomllib.load(fh)
    entries = []
    for i, raw in enumerate(data.get("finding", [])):
        where = f"{source}: finding {i + 1} ({raw.get('check', '?')})"
        klass = raw.get("class")
        if klass not in CLASSES:
            raise UsageError(f"{where}: `class` is {klass!r}; want one of {', '.join(CLASSES)}")
        entry = Finding(
            engine=raw["engine"],
            version=raw["version"],
            check=raw["check"],
            measured=raw["measured"],
            summary=raw["summary"],
            measures=() if raw.get("crash") else _expected_measures(raw.get("measures"), where),
            may_also=_expected_measures(raw["may_also"], where) if "may_also" in raw else (),
            numbers=_numbers(raw.get("numbers", {}), where),
            link=raw.get("link", ""),
            klass=klass,
            contract=raw.get("contract", ""),
            closes=raw.get("closes", ""),
            repro=source.parent / raw["repro"] if raw.get("repro") else None,
            report=source.parent / raw["report"] if raw.get("report") else None,
            crash=str(raw.get("crash", "")),
            cpu_flag=str(raw.get("cpu_flag", "")),
        )
        if entry.crash and "measures" in raw:
            raise UsageError(
                f"{where}: names both `crash` and `measures`: a crash is judged by its error only"
            )
        _check_class_fields(entry, where)
        entries.append(entry)
    return entries


def _check_class_fields(entry: Finding, where: str) -> None:
    """Each class carries what a maintainer needs to accept it."""
    missing = []
    if not entry.contract:
        missing.append("`contract` (the promise it breaks, cited; for a limitation, where none is made)")
    if entry.klass == "known-upstream" and not entry.link:
        missing.append("`link` (the upstream issue or PR)")
    if entry.klass == "defect":
        for label, path in (("repro", entry.repro), ("report", entry.report)):
            if path is None or not path.is_file():
                missing.append(f"`{label}` (an existing file beside the manifest; got {path})")
    if missing:
        raise UsageError(f"{where}: a {entry.klass} needs " + "; ".join(missing))


def _expected_measures(raw: Any, where: str) -> tuple[ExpectedMeasure, ...]:
    if not raw:
        raise UsageError(f"{where}: names no `measures` (the measure(s) that fail, and their direction)")
    if isinstance(raw, dict):
        items: Sequence[tuple[Any, Any]] = list(raw.items())
    elif isinstance(raw, list):
        items = [(name, "any") for name in raw]
    else:
        raise UsageError(f"{where}: `measures` must be a list of names or a table name -> direction")
    out = []
    for name, direction in items:
        if not isinstance(name, str) or not name or direction not in DIRECTIONS:
            choices = ", ".join(DIRECTIONS)
            raise UsageError(f"{where}: measure {name!r} -> {direction!r}: want a name and one of {choices}")
        out.append(ExpectedMeasure(name, direction))
    return tuple(out)


def _numbers(raw: Any, where: str) -> dict[str, float]:
    if not isinstance(raw, dict) or not all(_is_number(v) for v in raw.values()):
        raise UsageError(f"{where}: `numbers` must be a table measure name -> measured number")
    return {str(k): float(v) for k, v in raw.items()}


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This host's CPU flags (the first processor's, /proc/cpuinfo); empty where unreadable."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()
