"""Switch a mutant on for every engine process a run launches: the hook's folder leads
PYTHONPATH (so the engine's Python loads it as `sitecustomize`) and the patches are handed over
in a file. Nothing of this is set in a run without --mutant."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvconform.mutants.catalog import Mutant

HOOK_DIR = Path(__file__).resolve().parent / "hook"
SPEC_ENV = "KVCONFORM_MUTANT_SPEC"
APPLIED_ENV = "KVCONFORM_MUTANT_APPLIED"
HOOK_ENV = "KVCONFORM_MUTANT_HOOK"  # kvconform.processes keeps it first on an engine's PYTHONPATH


def activate(mutant: Mutant, workdir: Path) -> Path:
    """Set the environment engine processes inherit; returns the file the hook appends to."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = workdir / f"mutant-{mutant.name}.json"
    spec.write_text(json.dumps(mutant.hook_spec()))
    applied = workdir / f"mutant-{mutant.name}-applied.jsonl"
    applied.unlink(missing_ok=True)
    os.environ[SPEC_ENV] = str(spec)
    os.environ[APPLIED_ENV] = str(applied)
    os.environ[HOOK_ENV] = str(HOOK_DIR)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HOOK_DIR), os.environ.get("PYTHONPATH")) if p)
    return applied


def applied_modules(applied: Path) -> list[str]:
    """The modules the hook patched, in any engine process of the run."""
    if not applied.exists():
        return []
    lines = [json.loads(line) for line in applied.read_text().splitlines() if line.strip()]
    return sorted({line["module"] for line in lines})
