"""Loaded as `sitecustomize` by every Python process of an engine that kvconform runs under a
mutant (its folder leads PYTHONPATH only then): rewrites the named modules' source as the
mutant says, before they are compiled. Standard library only: it runs in the engine's own
environment, where kvconform is not installed.

A patch that does not match its module exactly `count` times stops the import with an
ImportError naming the mutant: a mutant written for another release never runs silently clean.
Every module patched is appended to $KVCONFORM_MUTANT_APPLIED (one JSON line per process), so
the run can prove the mutant was live in the engine it judged.
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import sys

SPEC_ENV = "KVCONFORM_MUTANT_SPEC"
APPLIED_ENV = "KVCONFORM_MUTANT_APPLIED"


class MutatedSourceLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname: str, path: str, mutant: str, patches: list[dict]) -> None:
        super().__init__(fullname, path)
        self.mutant = mutant
        self.patches = patches

    def get_code(self, fullname: str):  # no bytecode cache: the mutated source is compiled each time
        source = self.get_data(self.path).decode("utf-8")
        for index, patch in enumerate(self.patches):
            found = source.count(patch["old"])
            wanted = int(patch.get("count", 1))
            if found != wanted:
                raise ImportError(
                    f"kvconform mutant {self.mutant}: patch {index} of {fullname} matches {found} "
                    f"time(s), expected {wanted}: this release's code differs from the mutant's"
                )
            source = source.replace(patch["old"], patch["new"])
        applied = os.environ.get(APPLIED_ENV)
        if applied:
            with open(applied, "a") as fh:
                fh.write(json.dumps({"mutant": self.mutant, "module": fullname, "pid": os.getpid()}) + "\n")
        sys.stderr.write(f"[kvconform mutant {self.mutant}] {fullname} patched in pid {os.getpid()}\n")
        return compile(source, self.path, "exec", dont_inherit=True)


class MutantFinder:
    def __init__(self, mutant: str, modules: dict[str, list[dict]]) -> None:
        self.mutant = mutant
        self.modules = modules

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.modules:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is None:
                continue
            if not (spec.origin or "").endswith(".py"):
                raise ImportError(
                    f"kvconform mutant {self.mutant}: {fullname} is not Python source ({spec.origin})"
                )
            spec.loader = MutatedSourceLoader(fullname, spec.origin, self.mutant, self.modules[fullname])
            spec.cached = None
            return spec
        return None


def install() -> None:
    path = os.environ.get(SPEC_ENV)
    if not path:
        return
    with open(path) as fh:
        spec = json.load(fh)
    sys.meta_path.insert(0, MutantFinder(spec["name"], spec["modules"]))


install()
