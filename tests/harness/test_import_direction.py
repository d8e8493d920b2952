"""Imports run one way: suites and adapters depend on the harness's contract; the harness never
imports an adapter or an engine, and suites never import either."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

PACKAGE = REPO / "kvconform"
OWNED = ("adapters", "engines", "suites")  # folders of kvconform/ that are not the harness


# Scripts that run inside an engine's environment (its torch, its packages), never imported here.
ENGINE_SIDE = {"drivers", "engine_side"}


def _modules(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.py") if not ENGINE_SIDE & set(p.relative_to(PACKAGE).parts))


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports, at any depth (function-level imports count too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for path in files:
        for line, module in _imports(path):
            if module.startswith(forbidden):
                out.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {module}")
    return out


def harness_files() -> list[Path]:
    return [p for p in _modules(PACKAGE) if p.relative_to(PACKAGE).parts[0] not in OWNED]


def test_the_harness_imports_no_adapter_engine_or_suite() -> None:
    files = harness_files()
    assert len(files) > 20, "the harness was found"
    forbidden = ("kvconform.adapters", "kvconform.engines", "kvconform.suites", "torch")
    assert _violations(files, forbidden) == []


def test_suites_import_no_adapter_or_engine() -> None:
    files = _modules(PACKAGE / "suites")
    assert len(files) > 10
    assert _violations(files, ("kvconform.adapters", "kvconform.engines", "kvconform.plugin")) == []


def test_adapters_import_no_suite() -> None:
    files = _modules(PACKAGE / "adapters")
    assert _violations(files, ("kvconform.suites",)) == []


def test_the_self_test_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kvconform.adapters.vllm.adapter import VllmAdapter\n")
    found = [m for _, m in _imports(bad) if m.startswith("kvconform.adapters")]
    assert found == ["kvconform.adapters.vllm.adapter"], "function-level imports are seen"


@pytest.mark.parametrize(
    "module",
    ["kvconform.plugin", "kvconform.cli", "kvconform.gate", "kvconform.registry", "kvconform.contract"],
)
def test_loading_the_harness_loads_no_engine_and_no_torch(module: str) -> None:
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('kvconform.adapters.', "
        "'kvconform.engines'))); print(bad)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", f"{module} loaded {out.stdout.strip()}"
