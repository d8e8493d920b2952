"""The corpus of shipped bugs, read from `defects.toml` beside this module.

    [[defect]]
    id = "lmcache-4103"                      # engine-upstream number, unique
    engine = "lmcache"                       # a registered engine
    upstream = "https://github.com/..."      # the fix (PR) or the issue
    title = "what the bug does, in one line"
    bad = "0.5.2"                            # last release with the bug
    fixed = "0.5.3"                          # first release with the fix
    check = "offload_metrics::test_..."      # check id pattern (checkids: * and ? only)
    measure = "l2_usage_bytes_delta"         # must be VIOLATED on `bad`, hold on `fixed`
    config = "what the check runs (the engine's configuration the bug needs)"
    evidence = "the upstream diff, file:function, read in both releases' wheels"

A bug that cannot be reached here carries `unreachable = "why"` instead of check/measure (its
releases stay named where known): the corpus lists what was tried, not only what was caught.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvconform.errors import UsageError

CORPUS = Path(__file__).with_name("defects.toml")
_REQUIRED = ("id", "engine", "upstream", "title", "evidence")
_RUNNABLE = ("bad", "fixed", "check", "measure", "config")


@dataclass(frozen=True)
class Defect:
    id: str
    engine: str
    upstream: str
    title: str
    evidence: str
    bad: str = ""
    fixed: str = ""
    check: str = ""
    measure: str = ""
    config: str = ""
    unreachable: str = ""

    @property
    def runnable(self) -> bool:
        return not self.unreachable


def load(path: Path = CORPUS) -> list[Defect]:
    with path.open("rb") as fh:
        raw = tomllib.load(fh).get("defect", [])
    defects: list[Defect] = []
    seen: set[str] = set()
    for entry in raw:
        where = f"{path.name}: defect {entry.get('id', '?')!r}"
        missing = [k for k in _REQUIRED if not entry.get(k)]
        if not entry.get("unreachable"):
            missing += [k for k in _RUNNABLE if not entry.get(k)]
        if missing:
            raise UsageError(f"{where}: missing {', '.join(missing)}")
        unknown = set(entry) - set(Defect.__dataclass_fields__)
        if unknown:
            raise UsageError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
        if entry["id"] in seen:
            raise UsageError(f"{where}: id used twice")
        seen.add(entry["id"])
        defects.append(Defect(**{k: " ".join(str(v).split()) for k, v in entry.items()}))
    return defects


def find(defect_id: str, path: Path = CORPUS) -> Defect:
    for defect in load(path):
        if defect.id == defect_id:
            return defect
    raise UsageError(f"no defect {defect_id!r} in {path.name}")
