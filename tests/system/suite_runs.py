"""Running the suites in a pytest subprocess, as a user would, and reading what it recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO

ROOT = REPO


def run_suites(
    targets: list[str],
    options: list[str],
    results: Path,
    env: dict[str, str] | None = None,
    timeout: float = 900,
    engine: str | None = None,
) -> tuple[subprocess.CompletedProcess[str], dict[str, dict]]:
    """`python -m pytest TARGETS OPTIONS` in the repository root, outside any xdist worker;
    returns the process and results.json's records by check id ({} if none was written),
    only those of `engine` when given (a session of several engines repeats every check id)."""
    args = [
        sys.executable,
        "-m",
        "pytest",
        *targets,
        *options,
        "--results-dir",
        str(results),
        "-q",
        "-p",
        "no:cacheprovider",
        "-p",
        "no:xdist",
    ]
    base = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    proc = subprocess.run(
        args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**base, **(env or {})}
    )
    path = results / "results.json"
    records = json.loads(path.read_text())["records"] if path.exists() else []
    return proc, {r["check"]: r for r in records if engine is None or r["engine"] == engine}
