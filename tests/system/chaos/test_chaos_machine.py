"""Faults of the machine, through a real suite run: NVML absent, failing at init, failing
mid-sample; /dev/shm full; the results directory not writable, or the disk full while
results.json is written. Mount faults run in a private mount namespace (tmpfs mounts of the
run's own; the machine's /dev/shm is never filled) and are skipped where it cannot be made."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.system.chaos.harness import Row, first_line, run_chaos, summarize

BLOCK = "kvconform/suites/prefix_reuse/test_block_reuse.py"
RESET = ["--check", "prefix_reuse::test_reset_drops_cached_prefix"]
CHURN = "kvconform/suites/memory_reclaim/test_churn.py"
CHURN_CHECK = "test_churn_returns_to_baseline[reference-unregister]"
CHURN_OPTS = ["--check", "memory_reclaim::test_churn_returns_to_baseline?unregister?", "--churn-cycles", "2"]


def can_mount() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run(
        ["unshare", "-m", "--", "mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", "/mnt"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        return f"a private mount namespace with a tmpfs cannot be made here ({probe.stderr.strip()[:120]})"
    return None


@pytest.mark.parametrize("mode", ["absent", "init"])
def test_nvml_absent_or_failing_at_init(mode: str, tmp_path: Path, chaos_table) -> None:
    run = run_chaos(tmp_path, {"fault": f"nvml:{mode}"}, [BLOCK], RESET, 1)
    target = run.records[0] if run.records else {}
    row = Row(
        "NVML absent (no pynvml)" if mode == "absent" else "NVML failing at init (Driver Not Loaded)",
        "reference",
        f"{first_line(target) if target else run.output[-200:]} (platform: {target.get('platform', '?')})",
        "-",
        "-",
        summarize(run.records),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert target["outcome"] == "passed" and target["platform"] == "host", target
    assert not run.orphans and not run.shm_left and run.complete == "yes"


def test_nvml_failing_mid_sample(tmp_path: Path, chaos_table) -> None:
    run = run_chaos(tmp_path, {"fault": "nvml:midsample", "at": 3}, [CHURN], CHURN_OPTS, 1)
    target = run.record(CHURN_CHECK)
    row = Row(
        "NVML failing mid-sample (GPU is lost)",
        "reference (fake NVML: 1 GPU)",
        first_line(target),
        run.time_to_verdict(CHURN_CHECK),
        "the check's scenario",
        summarize(run.later(CHURN_CHECK)),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert target["outcome"] in ("failed", "error"), target
    assert "NVML failed mid-sample (NVMLError: GPU is lost)" in target["message"], target["message"]
    assert not run.orphans and not run.shm_left and run.complete == "yes"


def test_dev_shm_full(tmp_path: Path, chaos_table) -> None:
    why = can_mount()
    if why:
        pytest.skip(f"/dev/shm full not simulated: {why}")
    results = tmp_path / "results"
    run = run_chaos(tmp_path, {"fault": "shm_full"}, [CHURN], CHURN_OPTS, 1, mounts=["/dev/shm:size=1m"])
    from tests.system.chaos.harness import read_results

    run.records, run.complete = read_results(results, 1)
    target = run.record(CHURN_CHECK)
    row = Row(
        "/dev/shm full (1 MiB tmpfs, private mount namespace)",
        "reference",
        first_line(target),
        round(target["duration_s"], 1),
        "the check's scenario",
        summarize(run.later(CHURN_CHECK)),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert target["outcome"] in ("failed", "error"), target
    assert "No space left on device" in target["message"] or "engine reference" in target["message"]
    assert not run.orphans and run.complete == "yes"


@pytest.mark.parametrize("mode", ["not_writable", "disk_full"])
def test_results_dir_unwritable_or_full(mode: str, tmp_path: Path, chaos_table) -> None:
    why = can_mount()
    if why:
        pytest.skip(f"results disk faults not simulated: {why}")
    results = tmp_path / "results"
    results.mkdir()
    opts = "ro,size=64k" if mode == "not_writable" else "size=2m"
    fault = {"fault": mode, "log": str(tmp_path / "chaos.jsonl")}
    run = run_chaos(tmp_path, fault, [BLOCK], RESET, 1, mounts=[f"{results}:{opts}"], results=results)
    # The mount is gone with its namespace: what the run left is the directory underneath,
    # which must hold no results.json (the run wrote none it could finish).
    said = next(
        (ln.strip() for ln in run.output.splitlines() if "results.json" in ln or "Read-only" in ln), ""
    )
    row = Row(
        "results dir not writable (read-only tmpfs)"
        if mode == "not_writable"
        else "disk full while writing results.json",
        "reference",
        f"exit {run.proc.returncode}: {said[:200]}",
        "-",
        "-",
        "-",
        run.orphans,
        run.shm_left,
        "no results.json written (none partial)" if not (results / "results.json").exists() else "PARTIAL",
        run.wall_s,
    )
    chaos_table(row)
    assert run.proc.returncode != 0, run.output
    if mode == "not_writable":
        assert "is not writable (Read-only file system)" in run.output, run.output
    else:
        assert "could not write" in run.output and "NOT written (no partial file)" in run.output, run.output
    assert not (results / "results.json").exists()
    assert not run.orphans and not run.shm_left
    json.dumps(row.__dict__)
