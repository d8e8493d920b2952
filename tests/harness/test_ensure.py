"""The contract's relaunch policy, ensure(engine, config): one place decides when an engine is
kept, restarted for another config, or relaunched (died, stopped answering, left changed by a
check), and the next check's record says why it was relaunched."""

from __future__ import annotations

from pathlib import Path

from kvconform.contract import AdapterContext, Deployment, EngineAdapter, EngineConfig, ensure
from kvconform.processes import TeardownReport


class Counted(EngineAdapter):
    name = "counted"
    deployment = Deployment(block_size=16)

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.starts: list[EngineConfig] = []
        self.stops = 0
        self.alive = False

    def start(self, config: EngineConfig) -> None:
        self.starts.append(config)
        self.alive = True

    def stop(self) -> list[TeardownReport]:
        self.stops += 1
        self.alive = False
        return super().stop()

    def running(self) -> bool:
        return self.alive


def engine(tmp_path: Path) -> Counted:
    adapter = Counted(AdapterContext(workdir=tmp_path))
    ensure(adapter)
    return adapter


def test_a_running_engine_in_the_same_config_is_kept(tmp_path: Path) -> None:
    adapter = engine(tmp_path)
    ensure(adapter, EngineConfig())
    ensure(adapter, EngineConfig(block_size=16))  # the deployment's own block size: the same server
    assert (len(adapter.starts), adapter.stops, adapter.relaunch_notes) == (1, 0, [])


def test_another_config_stops_the_running_engine_first_without_a_note(tmp_path: Path) -> None:
    adapter = engine(tmp_path)
    ensure(adapter, EngineConfig(block_size=32))
    assert adapter.starts == [EngineConfig(), EngineConfig(block_size=32)]
    assert adapter.stops == 1 and adapter.relaunch_notes == []


def test_a_dead_engine_is_relaunched_and_the_record_says_so(tmp_path: Path) -> None:
    adapter = engine(tmp_path)
    adapter.alive = False
    ensure(adapter)
    assert len(adapter.starts) == 2
    assert adapter.relaunch_notes == [
        "engine counted relaunched before this check: its process died; teardown: nothing to tear down"
    ]


def test_an_engine_a_check_left_changed_is_relaunched_once_with_the_reason(tmp_path: Path) -> None:
    adapter = engine(tmp_path)
    adapter.stale = "a check stopped one of its workers"
    ensure(adapter)
    ensure(adapter)
    assert (len(adapter.starts), adapter.stops, adapter.stale) == (2, 1, None)
    assert len(adapter.relaunch_notes) == 1
    assert "relaunched before this check: a check stopped one of its workers" in adapter.relaunch_notes[0]
