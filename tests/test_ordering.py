"""Checks run grouped by the engine configuration they start in (default first), so an engine
restarts once per configuration; nothing is dropped or duplicated by the reordering."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def collected(*extra: str) -> list[str]:
    argv = [sys.executable, "-m", "pytest", "kvconform/suites", "--engine", "reference"]
    argv += ["--engine", "vllm", "--collect-only", "-q", "-p", "no:cacheprovider", *extra]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


def config_of(nodeid: str) -> str:
    """The configuration each check starts in, as the suites declare it (engine_config)."""
    if "test_partial_block_prefix_hits_match_oracle" in nodeid:
        return "block " + nodeid.rsplit("-", 1)[1].rstrip("]")
    if "test_sweep.py" in nodeid:
        return "block 32"
    for folder, config in (
        ("test_gauges.py", "offload"),
        ("test_tiers.py", "persistent"),
        ("remote_tier.py", "persistent"),
        ("test_persistence.py", "persistent"),
        ("test_disagg.py", "disaggregated"),
    ):
        if folder in nodeid:
            return config
    return "default"


def test_checks_of_one_configuration_run_together() -> None:
    ordered, unordered = collected(), collected("-p", "no:kvconform-ordering")
    assert sorted(ordered) == sorted(unordered) and len(set(ordered)) == len(ordered)
    assert ordered != unordered
    for engine in ("reference", "vllm"):
        run = [n for n in ordered if f"[{engine}" in n]
        # vLLM runs at block 32 by default: its block-32 checks are default-configuration ones
        configs = [config_of(n) for n in run]
        if engine == "vllm":
            configs = [c.replace("block 32", "default") for c in configs]
        groups = [c for i, c in enumerate(configs) if i == 0 or configs[i - 1] != c]
        assert groups[0] == "default", groups
        assert len(groups) == len(set(groups)), f"{engine}: a configuration comes back: {groups}"
        sweep = next(i for i, n in enumerate(run) if "test_sweep.py" in n)
        # the sweep ends its group: it leaves the engine at another block size
        assert configs[sweep + 1 :][:1] != [configs[sweep]], configs
