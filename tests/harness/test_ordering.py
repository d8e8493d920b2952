"""Checks run grouped by the engine configuration they start in (default first), so an engine
restarts once per configuration; nothing is dropped or duplicated by the reordering."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvconform.plugin.collection import EngineLanes, starting_config
from tests.paths import REPO

ROOT = REPO


def collected(*extra: str) -> list[str]:
    argv = [sys.executable, "-m", "pytest", "kvconform/suites", "--engine", "reference"]
    argv += ["--collect-only", "-q", "-p", "no:cacheprovider", *extra]
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
        ("test_admission.py", "offload with a store threshold"),
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
    configs = [config_of(n) for n in ordered]
    groups = [c for i, c in enumerate(configs) if i == 0 or configs[i - 1] != c]
    assert groups[0] == "default", groups
    assert len(groups) == len(set(groups)), f"a configuration comes back: {groups}"
    sweep = next(i for i, n in enumerate(ordered) if "test_sweep.py" in n)
    # the sweep ends its group: it leaves the engine at another block size
    assert configs[sweep + 1 :][:1] != [configs[sweep]], configs


class FakeItem:
    def __init__(self, marker: pytest.Mark | None, params: dict[str, object]) -> None:
        self.marker, self.callspec = marker, SimpleNamespace(params=params)

    def get_closest_marker(self, name: str) -> pytest.Mark | None:
        return self.marker if name == "engine_config" else None


def test_engine_default_block_size_is_the_default_configuration() -> None:
    by_param = pytest.mark.engine_config(block_size="param").mark
    assert starting_config(FakeItem(by_param, {"block_size": 32}), default_block_size=32) == ()
    at_128 = FakeItem(by_param, {"block_size": 128})
    assert starting_config(at_128, default_block_size=32) == (("block_size", 128),)
    assert starting_config(FakeItem(None, {}), default_block_size=32) == ()
    off = pytest.mark.engine_config(offload=False, persistent=True).mark
    assert starting_config(FakeItem(off, {}), default_block_size=16) == (("persistent", True),)


class LaneItem:
    def __init__(self, engine: str | None) -> None:
        self.callspec = SimpleNamespace(params={"engine_name": engine}) if engine else None
        self.markers: list[pytest.MarkDecorator] = []

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.markers.append(marker)


@pytest.mark.parametrize("loadgroup", [True, False])
def test_each_engine_is_one_xdist_group_under_loadgroup(loadgroup: bool) -> None:
    """Under `-n N --dist loadgroup` an engine's checks stay in one worker (its servers are
    started once there); otherwise no marker is added."""
    items = [LaneItem("vllm"), LaneItem("lmcache"), LaneItem("vllm"), LaneItem(None)]
    config = SimpleNamespace(option=SimpleNamespace(loadgroup=loadgroup))
    EngineLanes.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    groups = [[m.mark.args for m in item.markers if m.mark.name == "xdist_group"] for item in items]
    if loadgroup:
        assert groups == [[("vllm",)], [("lmcache",)], [("vllm",)], []]
    else:
        assert groups == [[], [], [], []]
