"""Faults of the engine's processes, through a real suite run against the reference engine
(vLLM-CPU where marked): killed mid-check and mid-churn-cycle, hung (SIGSTOP), exiting during
start-up, its port taken before launch, a driver dying or writing garbage; launch mode
relaunches for the next check and says so in its record, attach mode skips the rest."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvconform.processes import free_port
from tests.system.chaos.harness import ROOT, Row, first_line, run_chaos, summarize

BLOCK = "kvconform/suites/prefix_reuse/test_block_reuse.py"
FIRST = "test_repeated_prompt_served_from_cache"
THREE = [
    "--check",
    "prefix_reuse::test_repeated_prompt_served_from_cache",
    "--check",
    "prefix_reuse::test_reset_drops_cached_prefix",
    "--check",
    "prefix_reuse::test_partial_block_prefix_hits_match_oracle?32?",
]
TIMEOUT_S = 4.0  # the adapter's request timeout in these runs (60 s by default)


def assert_clean(run, row: Row) -> None:
    assert not run.orphans, f"orphans: {run.orphans}"
    assert not run.shm_left, f"/dev/shm leftovers: {run.shm_left}"
    assert run.complete == "yes", f"results.json: {run.complete}\n{run.output}"


def relaunched_note(record: dict) -> str:
    return next((m["value"] for m in record["measures"] if m["name"] == "engine_relaunched"), "")


def test_sigkill_mid_check_relaunches_for_the_next(tmp_path: Path, chaos_table) -> None:
    run = run_chaos(tmp_path, {"fault": "kill", "check": FIRST, "at": 2}, [BLOCK], THREE, 3)
    target = run.record(FIRST)
    later = run.later(FIRST)
    row = Row(
        "engine SIGKILLed mid-check (launch mode: relaunched)",
        "reference",
        first_line(target),
        run.time_to_verdict(FIRST),
        TIMEOUT_S + 2,
        summarize(later),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert target["outcome"] == "failed"
    assert "engine reference" in target["message"] and "/v1/completions failed" in target["message"]
    assert row.time_to_verdict_s <= row.bound_s
    assert [r["outcome"] for r in later] == ["passed", "passed"], run.output
    note = relaunched_note(later[0])
    assert "relaunched before this check: its process died" in note and "exit -9" in note, later[0]
    assert not relaunched_note(later[1])
    assert_clean(run, row)


def test_sigstop_hang_has_a_bounded_verdict(tmp_path: Path, chaos_table) -> None:
    fault = {"fault": "stop", "check": FIRST, "at": 2, "timeout_s": TIMEOUT_S}
    run = run_chaos(tmp_path, fault, [BLOCK], THREE[:4], 2)
    target = run.record(FIRST)
    later = run.later(FIRST)
    row = Row(
        "engine tree SIGSTOPped mid-check (hang)",
        "reference",
        first_line(target),
        run.time_to_verdict(FIRST),
        TIMEOUT_S + 3,
        summarize(later),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert target["outcome"] == "failed" and "timed out" in target["message"], target["message"]
    assert row.time_to_verdict_s <= row.bound_s
    assert [r["outcome"] for r in later] == ["passed"], run.output
    assert "stopped answering" in relaunched_note(later[0]), later[0]
    assert_clean(run, row)


def test_sigkill_mid_churn_cycle(tmp_path: Path, chaos_table) -> None:
    churn = "kvconform/suites/memory_reclaim/test_churn.py"
    check = "test_churn_returns_to_baseline[reference-unregister]"
    options = ["--check", "memory_reclaim::test_churn_returns_to_baseline?unregister?"]
    options += ["--check", "prefix_reuse::test_reset_drops_cached_prefix", "--churn-cycles", "4"]
    run = run_chaos(tmp_path, {"fault": "kill_churn", "check": check, "at": 3}, [churn, BLOCK], options, 2)
    target = run.record(check)
    later = run.later(check)
    row = Row(
        "engine SIGKILLed mid churn cycle",
        "reference",
        first_line(target),
        run.time_to_verdict(check),
        TIMEOUT_S + 2,
        summarize(later),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert target["outcome"] == "failed" and "engine reference" in target["message"], target["message"]
    assert row.time_to_verdict_s <= row.bound_s
    assert [r["outcome"] for r in later] == ["passed"], run.output
    assert "its process died" in relaunched_note(later[0])
    assert_clean(run, row)


def test_sigterm_to_the_suite_tears_its_engine_down(tmp_path: Path, chaos_table) -> None:
    """A CI job's timeout or a runner's cancel sends the suite SIGTERM mid-check: the session
    must end as on Ctrl-C (pytest's exit 2), its engine stopped, results written."""
    run = run_chaos(tmp_path, {"fault": "sigterm_suite", "check": FIRST, "at": 2}, [BLOCK], THREE, 0)
    row = Row(
        "suite SIGTERMed mid-check (a CI timeout)",
        "reference",
        f"pytest exit {run.proc.returncode}",
        "n/a",
        "n/a",
        summarize(run.records),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert run.proc.returncode == pytest.ExitCode.INTERRUPTED, run.output
    assert any(e["event"] == "injected" for e in run.log), "the fault never fired"
    assert_clean(run, row)


def test_engine_exits_during_startup(tmp_path: Path, chaos_table) -> None:
    run = run_chaos(tmp_path, {"fault": "startup_exit"}, [BLOCK], THREE[:4], 2)
    target = run.record(FIRST)
    row = Row(
        "engine exits during start-up (every launch)",
        "reference",
        first_line(target),
        run.time_to_verdict(FIRST),
        5.0,
        summarize(run.later(FIRST)),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    for record in run.records:
        assert record["outcome"] == "error", record
        assert "exited with code 3 before" in record["message"] and "out of memory" in record["message"]
    assert row.time_to_verdict_s <= row.bound_s
    assert_clean(run, row)


def test_port_taken_before_launch(tmp_path: Path, chaos_table) -> None:
    run = run_chaos(tmp_path, {"fault": "port_taken"}, [BLOCK], THREE[:4], 2)
    target = run.record(FIRST)
    later = run.later(FIRST)
    row = Row(
        "engine's port taken before launch",
        "reference",
        first_line(target),
        run.time_to_verdict(FIRST),
        15.0,
        summarize(later),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert target["outcome"] == "error" and "port it was given was taken" in target["message"]
    assert row.time_to_verdict_s <= row.bound_s
    assert [r["outcome"] for r in later] == ["passed"], run.output
    assert_clean(run, row)


@pytest.mark.parametrize("kind", ["crash", "garbage"])
def test_driver_dies_or_writes_garbage(kind: str, tmp_path: Path, chaos_table) -> None:
    options = ["--adapter", "chaos-driver=tests.system.chaos.driver_adapter:ChaosDriverAdapter", *THREE[:4]]
    env = {"KVCONFORM_CHAOS_DRIVER": kind, "KVCONFORM_CHAOS_AT": "2"}
    run = run_chaos(tmp_path, {"fault": f"driver:{kind}", "check": FIRST}, [BLOCK], options, 2, env=env)
    target = run.record(FIRST)
    later = run.later(FIRST)
    what = "dies mid-request" if kind == "crash" else "writes garbage on its JSON-lines pipe"
    row = Row(
        f"driver process {what}",
        "chaos-driver (reference + fake driver)",
        first_line(target),
        "-",
        "op timeout",
        summarize(later),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    expected = "driver exited with code 11 during op 'store'" if kind == "crash" else "non-protocol line"
    assert target["outcome"] == "failed" and expected in target["message"], target["message"]
    row.time_to_verdict_s = round(target["duration_s"], 1)
    chaos_table(row)
    assert [r["outcome"] for r in later] == ["passed"], run.output
    assert "its process died" in relaunched_note(later[0])
    assert_clean(run, row)


def test_attach_mode_engine_killed_skips_the_rest(tmp_path: Path, chaos_table) -> None:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "kvconform.engines.reference.server", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        options = ["--engine-url", f"http://127.0.0.1:{port}", *THREE]
        fault = {"fault": "kill_attached", "check": FIRST, "at": 2, "pid": server.pid}
        # wait for health inside the run: preflight's reachability check retries nothing
        import requests

        for _ in range(100):
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            import time

            time.sleep(0.1)
        run = run_chaos(tmp_path, fault, [BLOCK], options, 3)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)  # the attached server is the test's, tree and all
        server.wait(timeout=10)
        for leftover in Path("/dev/shm").glob(f"*-{server.pid}-*"):
            leftover.unlink(missing_ok=True)  # its helper's page: SIGKILL left it no time to
    # what the SIGKILLed attached server left is the test's to clean (done by run_chaos), not
    # the suite's: the suite owns nothing in attach mode
    run.shm_left = [name for name in run.shm_left if f"-{server.pid}-" not in name]
    target = run.record(FIRST)
    later = run.later(FIRST)
    row = Row(
        "engine killed mid-check (attach mode: rest skipped)",
        "reference (attached)",
        first_line(target),
        run.time_to_verdict(FIRST),
        TIMEOUT_S + 2,
        summarize(later) + (f" ({later[0]['message'][:90]})" if later else ""),
        run.orphans,
        run.shm_left,
        run.complete,
        run.wall_s,
    )
    chaos_table(row)
    assert target["outcome"] == "failed"
    assert [r["outcome"] for r in later] == ["skipped", "skipped"], run.output
    assert "went away during the session" in later[0]["message"], later[0]
    # the third lacks block_size_config in attach mode: skipped at collection for that reason
    assert_clean(run, row)
