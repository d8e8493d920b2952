"""`kvconform repro ENGINE [FINDING]`: a defect's standalone reproduction, run in its engine's
environment.

Every defect in an adapter's known-failures manifest names a script beside the manifest
(`repro`) that uses only the engine's public interface (its CLI, HTTP API or public Python API),
imports nothing of kvconform, prints its numbers and exits non-zero while the bug is there; and a
draft upstream report (`report`). This runs the script with the interpreter of the engine's
environment (its console scripts first on PATH) and returns the script's exit code: 1 = the
defect reproduced, 0 = it did not (fixed, or the repro is wrong).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvconform import envs, findings, registry
from kvconform.errors import UsageError

DEFAULT_TIMEOUT_S = 600.0


def defects(engine: str) -> list[findings.Finding]:
    """The defects of `engine`'s shipped manifest, every version."""
    manifest = findings.load(None, engines=[engine])
    return [f for f in manifest.entries if f.engine == engine and f.klass == "defect"]


def all_defects() -> list[findings.Finding]:
    """One entry per engine, version and repro (a repro serves every check of its root cause)."""
    seen: dict[tuple[str, str, Path | None], findings.Finding] = {}
    for engine in registry.names():
        for entry in defects(engine):
            seen.setdefault((entry.engine, entry.version, entry.repro), entry)
    return list(seen.values())


def find(engine: str, name: str, version: str | None = None) -> findings.Finding:
    found = [d for d in defects(engine) if d.name == name and version in (None, d.version)]
    if not found:
        known = ", ".join(sorted({f"{d.name} ({d.version})" for d in defects(engine)})) or "none"
        at = f" recorded on {version}" if version else ""
        raise UsageError(f"engine {engine!r} has no defect named {name!r}{at} (its defects: {known})")
    return found[0]


def env_spec(engine: str) -> str:
    """The engine's default environment spec (its adapter's)."""
    spec = getattr(registry.adapter_class(engine), "env_spec", None)
    if spec is None:
        raise UsageError(f"engine {engine!r} has no environment spec to run a repro in")
    return str(spec)


def run(engine: str, name: str, timeout_s: float = DEFAULT_TIMEOUT_S, env: str | None = None) -> int:
    """Run one defect's repro in `env` (default: the engine's own spec), on the finding recorded
    for the version that environment holds; its output goes to our stdout. Returns its exit code."""
    built = envs.find(env or env_spec(engine))
    entry = find(engine, name, built.version)
    assert entry.repro is not None  # a defect always has one (findings._check_class_fields)
    python = built.python
    child_env = dict(os.environ, PATH=f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    child_env.pop("PYTHONPATH", None)  # nothing of ours on its path
    print(f"[repro] {engine} {entry.version}: {entry.summary}", flush=True)
    print(f"[repro] {python} {entry.repro}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kvconform-repro-") as workdir:
        try:
            done = subprocess.run(
                [str(python), str(entry.repro)], cwd=workdir, env=child_env, timeout=timeout_s, check=False
            )
        except subprocess.TimeoutExpired:
            print(f"[repro] {entry.repro.name} did not finish in {timeout_s:.0f} s", file=sys.stderr)
            return 124
    verdict = "reproduced" if done.returncode == 1 else "NOT reproduced" if done.returncode == 0 else "error"
    print(f"[repro] exit {done.returncode}: {verdict}", flush=True)
    return done.returncode


def list_defects(engine: str | None) -> str:
    rows = []
    for entry in all_defects() if engine is None else defects(engine):
        report = entry.report.name if entry.report else "-"
        rows.append(f"{entry.engine:14s} {entry.version:10s} {entry.name:34s} {report}  {entry.summary}")
    return "\n".join(rows) or "no defects"
