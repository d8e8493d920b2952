"""Option errors of `python -m pytest suites ...`: each fails fast, with exactly one clear line
naming what is wrong (engine, URL, fault, environment) and a non-zero exit; no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from tests.paths import REPO

ROOT = REPO
URL = "http://127.0.0.1:9"  # the discard port: nothing answers there

CASES: dict[str, tuple[list[str], str]] = {
    "unknown-engine": (["--engine", "nosuch"], "unknown engine 'nosuch' (known: reference, vllm"),
    "unreachable-url": (["--engine-url", URL], f"engine reference at {URL} is unreachable"),
    "unknown-fault": (["--fault", "nosuch"], "unknown fault(s) ['nosuch'] (known: "),
    "fault-on-real-engine": (
        ["--fault", "event_seq_gap", "--engine", "vllm"],
        "--fault applies to the reference engine only",
    ),
    "url-with-two-engines": (
        ["--engine-url", URL, "--engine", "reference", "--engine", "vllm"],
        "--engine-url attaches to one engine; give exactly one --engine",
    ),
    "missing-env": (["--engine", "vllm"], "build it with: kvconform env build vllm"),
    "missing-env-xdist": (["--engine", "vllm", "-n", "2"], "build it with: kvconform env build vllm"),
}


@dataclass
class Run:
    returncode: int
    output: str
    seconds: float


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """Every case, two at a time (they are independent; more at once only thrashes 2 cores)."""
    base = tmp_path_factory.mktemp("options")
    empty_envs = base / "no-envs"
    empty_envs.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "KVCONFORM_"))}
    env["KVCONFORM_ENV_ROOT"] = str(empty_envs)

    def run(case: str) -> Run:
        args, _ = CASES[case]
        argv = [sys.executable, "-m", "pytest", "kvconform/suites", *args, "-p", "no:cacheprovider"]
        argv += ["--results-dir", str(base / case)]
        t0 = time.monotonic()
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        return Run(done.returncode, done.stdout + done.stderr, time.monotonic() - t0)

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(CASES, pool.map(run, CASES), strict=True))


@pytest.mark.parametrize("case", list(CASES))
def test_option_error_is_one_clear_line(case: str, runs: dict[str, Run]) -> None:
    run = runs[case]
    _, expected = CASES[case]
    lines = [line for line in run.output.splitlines() if line.strip()]
    assert run.returncode != 0
    assert len(lines) == 1, f"expected one line, got:\n{run.output}"
    assert lines[0].startswith("ERROR: kvconform: ")
    assert expected in lines[0]
    assert "Traceback" not in run.output
    # Alone, each takes 0.5-3 s (the reference adapter imports torch); two run at once on a
    # small shared machine. A hang on the unreachable URL (or an engine start) takes minutes.
    assert run.seconds < 30
