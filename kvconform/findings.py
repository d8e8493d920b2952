"""The known-failures manifest: real-engine failures recorded as findings, run as strict xfail.

A finding names the engine, its version, the check and the numbers measured when it was
found. It applies only to that version: a new release that still fails shows red (update the
manifest), one that now passes shows XPASS(strict) red too (remove the entry).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import pytest

from kvconform.checkids import matches

DEFAULT_MANIFEST = Path(__file__).resolve().parent.parent / "ci" / "known-failures.toml"
ENTRY_KEY = pytest.StashKey["Finding"]()


@dataclass(frozen=True)
class Finding:
    engine: str
    version: str
    check: str
    measured: str
    summary: str
    link: str = ""

    def reason(self) -> str:
        text = f"finding on {self.engine} {self.version}: {self.summary} (measured: {self.measured})"
        return f"{text} [{self.link}]" if self.link else text


@dataclass
class Manifest:
    entries: list[Finding]

    def match(self, engine: str, version: str, check: str) -> Finding | None:
        for entry in self.entries:
            if entry.engine == engine and fnmatchcase(version, entry.version) and matches(check, entry.check):
                return entry
        return None


def load(path: str | None) -> Manifest:
    source = Path(path) if path else DEFAULT_MANIFEST
    if not source.exists():
        return Manifest([])
    with source.open("rb") as fh:
        data = tomllib.load(fh)
    entries = []
    for raw in data.get("finding", []):
        entries.append(
            Finding(
                engine=raw["engine"],
                version=raw["version"],
                check=raw["check"],
                measured=raw["measured"],
                summary=raw["summary"],
                link=raw.get("link", ""),
            )
        )
    return Manifest(entries)
