"""kvconform as a platform team installs it: the wheel and an out-of-tree adapter package in a
fresh virtual environment outside the checkout, suites run with `pytest --pyargs`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

ROOT = REPO
EXAMPLE = ROOT / "examples" / "out_of_tree_adapter"


def _run(argv: list[str], cwd: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH", "VIRTUAL_ENV"))}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(argv)} -> {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv with kvconform's wheel (+ reference extra) and the example adapter, no checkout."""
    work = tmp_path_factory.mktemp("install")
    dist = work / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(ROOT)], work)
    wheel = next(dist.glob("kvconform-*.whl"))
    venv = work / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], work)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--progress-bar", "off"]
    import torch  # the suite's own torch (the CPU build): the same one, never a CUDA download

    _run([*pip, f"torch=={torch.__version__}"], work)
    _run([*pip, f"kvconform[reference] @ {wheel.as_uri()}", str(EXAMPLE)], work)
    return venv


def test_wheel_ships_suites_adapters_specs_drivers_and_findings(installed: Path) -> None:
    code = (
        "import importlib.resources as r, json; k = r.files('kvconform'); print(json.dumps({"
        "'suites': sorted(p.name for p in (k / 'suites').iterdir() if p.is_dir() and p.name[0] != '_'),"
        "'vllm_spec': (k / 'adapters' / 'vllm' / 'envs' / 'vllm.toml').is_file(),"
        "'lmcache_driver': (k / 'adapters' / 'lmcache' / 'drivers' / 'lmcache_mp_client.py').is_file(),"
        "'jsonl_loop': (k / 'kit' / 'engine_side' / 'jsonl_loop.py').is_file(),"
        "'findings': (k / 'adapters' / 'dynamo' / 'known-failures.toml').is_file()}))"
    )
    out = _run([str(installed / "bin" / "python"), "-c", code], installed.parent)
    shipped = json.loads(out.stdout)
    assert shipped == {
        "suites": ["memory_reclaim", "offload_metrics", "prefix_reuse", "transfer"],
        "vllm_spec": True,
        "lmcache_driver": True,
        "jsonl_loop": True,
        "findings": True,
    }


def test_a_suite_runs_against_the_out_of_tree_adapter_with_pyargs(installed: Path, tmp_path: Path) -> None:
    results = tmp_path / "results"
    argv = [str(installed / "bin" / "python"), "-m", "pytest", "--pyargs", "kvconform.suites.prefix_reuse"]
    argv += ["-k", "block_reuse", "--engine", "example-ref", "--results-dir", str(results), "-q"]
    argv += ["-p", "no:cacheprovider"]
    proc = _run(argv, tmp_path)
    assert "passed" in proc.stdout
    records = json.loads((results / "results.json").read_text())["records"]
    assert records and {r["engine"] for r in records} == {"example-ref"}
    assert all(r["check"].startswith("prefix_reuse::") for r in records), "check ids from the module path"
    passed = [r for r in records if r["outcome"] == "passed"]
    assert len(passed) >= 3, records
    where = _run(
        [str(installed / "bin" / "python"), "-c", "import kvconform; print(kvconform.__file__)"], tmp_path
    )
    assert str(installed) in where.stdout and str(ROOT) not in where.stdout, "the wheel, not the checkout"


def test_installed_plugin_is_inert_on_a_foreign_test_suite(installed: Path, tmp_path: Path) -> None:
    (tmp_path / "test_other.py").write_text("def test_nothing_to_do_with_kv():\n    assert 1 + 1 == 2\n")
    proc = _run([str(installed / "bin" / "python"), "-m", "pytest", "-q", "-p", "no:cacheprovider"], tmp_path)
    assert "1 passed" in proc.stdout
    assert not (tmp_path / "results").exists(), "an inactive plugin writes no results"
    modules = (
        "import sys, pytest; pytest.main(['-q', '-p', 'no:cacheprovider']); print('torch' in sys.modules)"
    )
    proc = _run([str(installed / "bin" / "python"), "-c", modules], tmp_path)
    assert proc.stdout.strip().endswith("False"), "the plugin loads no engine (and no torch) when inactive"
