"""The mutants shipped with each adapter, in its package's `mutants.toml`:

    [[mutant]]
    name = "eviction_unannounced"            # unique per engine
    engines = ["vllm"]                       # optional: default every engine served by the package
    beside = ["dynamo"]                      # optional: engines its checks need beside it (unpatched)
    bug = "what the mutant re-creates, from the engine's history, cited (issue/PR, file:function)"
    [[mutant.patch]]
    module = "vllm.v1.core.block_pool"       # a module of the engine's own code
    old = "..."                              # text that must occur exactly `count` (default 1) times
    new = "..."
    [[mutant.violates]]
    check = "transfer::test_event_ledger_consistent"   # check id (glob, as in results.json)
    measures = ["resident_blocks_ledger"]    # the measures that must be VIOLATED under the mutant

The clean engine must pass the same measures in the same run (`kvconform mutants`).

A stack that runs another engine's code (vLLM inside vllm-lmcache) reuses that engine's mutant,
patches and bug as written there, with the measures it must violate in this stack:

    [[mutant]]
    name = "shm_ring_not_unlinked"
    from = "vllm"                            # the engine whose catalog holds it
    [[mutant.violates]]
    ...

Why a measure is not proven on the engine, where that is known (the proof table prints it):

    [[unproven]]
    check = "memory_reclaim::test_long_session_bounded"
    measure = "rss_slope_per_turn"
    reason = "..."
    engines = ["lmcache-redis"]              # optional: where the catalog serves several engines

and, for an engine with no mutants at all, a top-level `no_mutants = "why"`.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvconform import registry
from kvconform.errors import UsageError

CATALOG_NAME = "mutants.toml"


@dataclass(frozen=True)
class Patch:
    module: str
    old: str
    new: str
    count: int = 1


@dataclass(frozen=True)
class Expectation:
    check: str
    measures: tuple[str, ...]


@dataclass(frozen=True)
class Mutant:
    name: str
    engine: str
    bug: str
    patches: tuple[Patch, ...]
    violates: tuple[Expectation, ...]
    source: Path
    # Engines its checks need beside it (a cross-stack check's router index), run unpatched in
    # the same sessions, clean and mutated.
    beside: tuple[str, ...] = ()

    def checks(self) -> list[str]:
        return list(dict.fromkeys(e.check for e in self.violates))

    def hook_spec(self) -> dict:
        modules: dict[str, list[dict]] = {}
        for patch in self.patches:
            modules.setdefault(patch.module, []).append(
                {"old": patch.old, "new": patch.new, "count": patch.count}
            )
        return {"name": self.name, "modules": modules}


def catalog_path(engine: str) -> Path | None:
    folder = registry.package_resources(engine)
    if folder is None or not (folder / CATALOG_NAME).is_file():
        return None
    return Path(str(folder / CATALOG_NAME))


def mutants_of(engine: str) -> dict[str, Mutant]:
    path = catalog_path(engine)
    if path is None:
        return {}
    found: dict[str, Mutant] = {}
    for raw in tomllib.loads(path.read_text()).get("mutant", []):
        if engine not in raw.get("engines", [engine]):
            continue
        mutant = _borrowed(raw, engine, path) if raw.get("from") else _parse(raw, engine, path)
        if mutant.name in found:
            raise UsageError(f"{path}: two mutants named {mutant.name!r}")
        found[mutant.name] = mutant
    return found


def unproven_reasons(engine: str) -> dict[str, str]:
    """'check :: measure' -> why no mutant of this engine violates it (from its mutants.toml)."""
    path = catalog_path(engine)
    if path is None:
        return {}
    data = tomllib.loads(path.read_text())
    reasons = {
        f"{u['check']} :: {u['measure']}": str(u["reason"])
        for u in data.get("unproven", [])
        if engine in u.get("engines", [engine])
    }
    if data.get("no_mutants"):
        reasons["*"] = str(data["no_mutants"])
    return reasons


def find(engine: str, name: str) -> Mutant:
    known = mutants_of(engine)
    if name not in known:
        raise UsageError(
            f"engine {engine!r} has no mutant {name!r} (known: {', '.join(sorted(known)) or 'none'})"
        )
    return known[name]


def _borrowed(raw: dict, engine: str, path: Path) -> Mutant:
    where = f"{path}: mutant {raw.get('name', '?')!r}"
    if raw["from"] == engine or raw.get("patch") or raw.get("bug"):
        raise UsageError(f"{where}: a mutant `from` another engine takes its patches and bug from there")
    source = find(raw["from"], raw.get("name", ""))
    bug = f"{source.bug}\n(The mutant of {raw['from']}, {source.source.parent.name}/{CATALOG_NAME}.)"
    beside = tuple(raw.get("beside", source.beside))
    return Mutant(source.name, engine, bug, source.patches, _violates(raw, where), path, beside)


def _violates(raw: dict, where: str) -> tuple[Expectation, ...]:
    if not raw.get("violates"):
        raise UsageError(f"{where} lacks violates")
    violates = []
    for item in raw["violates"]:
        if not item.get("check") or not item.get("measures"):
            raise UsageError(f"{where}: each `violates` needs a check and its measures")
        violates.append(Expectation(item["check"], tuple(item["measures"])))
    return tuple(violates)


def _parse(raw: dict, engine: str, path: Path) -> Mutant:
    where = f"{path}: mutant {raw.get('name', '?')!r}"
    missing = [key for key in ("name", "bug", "patch", "violates") if not raw.get(key)]
    if missing:
        raise UsageError(f"{where} lacks {', '.join(missing)}")
    patches = []
    for item in raw["patch"]:
        if not all(item.get(k) for k in ("module", "old")) or "new" not in item:
            raise UsageError(f"{where}: a patch needs module, old and new")
        patches.append(Patch(item["module"], item["old"], item["new"], int(item.get("count", 1))))
    beside = tuple(raw.get("beside", ()))
    return Mutant(raw["name"], engine, raw["bug"], tuple(patches), _violates(raw, where), path, beside)
