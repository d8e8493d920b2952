"""results.json says where a run's time went (kvconform.timing): engine starts and teardowns
per check and per session, and the waits on the engine, read by benchmarks/verdict_profile.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.paths import REPO

ROOT = REPO
CHECKS = (
    "prefix_reuse::test_repeated_prompt_served_from_cache",
    "offload_metrics::test_gauges_drain_after_load",
)


def test_starts_teardowns_and_waits_are_recorded(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "pytest", "kvconform/suites", "--engine", "reference", "-q"]
    argv += [a for c in CHECKS for a in ("--check", c)]
    argv += ["-p", "no:cacheprovider", "--results-dir", str(tmp_path)]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    data = json.loads((tmp_path / "results.json").read_text())
    by_check = {r["check"]: r["engine_time"]["reference"] for r in data["records"]}
    # two configurations (default, then offload): one start each, the second after a teardown;
    # the last check's teardown is the session's too (the engine's close)
    first, second = by_check[CHECKS[0]], by_check[CHECKS[1]]
    assert (first["starts"], first["stops"]) == (1, 0), first
    assert (second["starts"], second["stops"]) == (1, 2), second
    assert first["calls"] >= 2 and first["call_s"] > 0  # the prompt served twice, at least
    whole = data["session"]["engine_time"]["reference"]
    assert (whole["starts"], whole["stops"]) == (2, 2), whole  # the session's close included
    # three values rounded to 3 decimals: up to 1.5 ms apart from rounding alone
    assert whole["start_s"] >= first["start_s"] + second["start_s"] - 2e-3
    bench = [sys.executable, "benchmarks/verdict_profile.py", "--from", str(tmp_path)]
    profile = subprocess.run(
        [*bench, "--out", str(tmp_path / "p")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert profile.returncode == 0, profile.stderr
    row = json.loads((tmp_path / "p" / "profile.json").read_text())[f"{tmp_path.name}/reference"]
    assert row["starts"] == 2 and row["harness_s"] >= 0 and row["engine_wait_s"] > 0, row
