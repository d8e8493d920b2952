"""Every defect has a standalone reproduction that fails on its engine here, and a draft report.

A repro imports nothing of ours (it is what a maintainer runs), so this reads its imports; then
it runs each repro whose engine environment is built, through `kvconform repro`, and expects
exit 1 (the defect reproduced) on the version the manifest names.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys

import pytest

from kvconform import envs, repro
from kvconform.findings import Finding
from tests.system.engine_envs import built

pytestmark = pytest.mark.engine_env  # parses/runs in built engine environments (tests/system/engine_envs.py)
DEFECTS = repro.all_defects()


def test_there_are_defects_and_each_has_a_report() -> None:
    assert DEFECTS, "the shipped manifests name no defect"
    for entry in DEFECTS:
        assert entry.report is not None and entry.report.read_text().startswith("# [Bug]"), entry.report
        text = entry.report.read_text()
        for section in ("**Version:**", "## Reproduce", "## Expected", "## Actual", "## Where"):
            assert section in text, f"{entry.report.name} lacks {section}"


@pytest.mark.parametrize("entry", DEFECTS, ids=lambda e: f"{e.engine}-{e.version}-{e.name}")
def test_a_repro_imports_nothing_of_ours(entry: Finding) -> None:
    assert entry.repro is not None
    tree = ast.parse(entry.repro.read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert "kvconform" not in imported and "tests" not in imported, imported


def _env_for(entry: Finding) -> str | None:
    """A built environment holding the version the defect was recorded on: the engine's own
    spec, or a release's (`<spec>-<version>`, as for the gates)."""
    spec = repro.env_spec(entry.engine)
    for name in (spec, f"{spec}-{entry.version}"):
        if built(name) and envs.find(name).version == entry.version:
            return name
    return None


@pytest.mark.parametrize("entry", DEFECTS, ids=lambda e: f"{e.engine}-{e.version}-{e.name}")
def test_a_repro_fails_on_its_engine(entry: Finding) -> None:
    env = _env_for(entry)
    if env is None:
        pytest.skip(f"no built environment holds {entry.engine} {entry.version} (kvconform env build)")
    if not entry.applies_here():
        pytest.skip(f"this host's CPU lacks {entry.cpu_flag}, which the defect needs")
    if "redis" in entry.engine and shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian package redis-server)")
    done = subprocess.run(
        [sys.executable, "-m", "kvconform.cli", "repro", entry.engine, entry.name, "--env", env],
        capture_output=True,
        text=True,
        timeout=660,
        check=False,
    )
    tail = f"{done.stdout[-3000:]}\n{done.stderr[-2000:]}"
    assert done.returncode == 1, f"repro exit {done.returncode}:\n{tail}"
    assert "BUG: " in done.stdout and "exit 1: reproduced" in done.stdout, done.stdout[-2000:]


def test_repro_names_an_unknown_defect() -> None:
    with pytest.raises(Exception, match="has no defect named 'nope'"):
        repro.find("lmcache", "nope")
