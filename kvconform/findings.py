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

MANIFEST_NAME = "known-failures.toml"  # in each adapter's package: the findings on its engine
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
        from kvconform.errors import UsageError

        raise UsageError(f"known-failures manifest {source} does not exist")
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
    return entries
