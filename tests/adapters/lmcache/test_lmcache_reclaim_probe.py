"""LMCache's reclaim probe reads what the churn path it is asked about leaves behind, and the
server's own measures outside churn: a check after a `close` or `destroy` churn is judged on
the server's measures (the long session once read the closed-server leftover count as its
exact memory measure, when the probe followed the last churn check's path)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconform.adapters.lmcache import adapter as lmcache_adapter
from kvconform.adapters.lmcache.adapter import LmcacheAdapter
from kvconform.contract import AdapterContext
from kvconform.errors import EngineError


def test_the_probe_reads_the_path_it_is_asked_about(tmp_path: Path) -> None:
    engine = LmcacheAdapter(AdapterContext(workdir=tmp_path))  # nothing launched
    server = ["server_rss_bytes", "server_shm_mapped_bytes"]
    assert sorted(engine.reclaim_probe()) == server
    assert sorted(engine.reclaim_probe("unregister")) == server
    assert sorted(engine.reclaim_probe("close")) == [
        "closed_server_leftover_processes",
        "closed_server_leftover_shm_bytes",
    ]
    assert sorted(engine.reclaim_probe("destroy")) == ["inproc_engine_rss_bytes", "inproc_engine_threads"]
    assert sorted(engine.reclaim_probe()) == server, "asking about one path leaves no state behind"


def status(*managers: dict[str, int]) -> dict[str, object]:
    return {
        "storage_manager": {
            "l1_managers": {f"l1-{i}": m for i, m in enumerate(managers)},
            "store_controllers": {"l1-0": {"pending_keys_count": 0, "in_flight_task_count": 0}},
        }
    }


def test_a_running_server_adds_the_l1_bytes_requests_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LmcacheAdapter(AdapterContext(workdir=tmp_path))
    monkeypatch.setattr(engine, "running", lambda: True)
    monkeypatch.setattr(engine, "engine_pids", lambda: [])
    monkeypatch.setattr(lmcache_adapter, "LOCK_SETTLE_S", 0.1)
    held = status(
        {"read_locked_count": 2, "write_locked_count": 1}, {"read_locked_count": 1, "write_locked_count": 0}
    )
    monkeypatch.setattr(engine, "get_json", lambda path: held)
    probe = engine.reclaim_probe()
    chunk = engine.deployment.model.block_bytes(engine.deployment.block_size)
    assert probe["l1_bytes_locked_by_requests"].value == 4 * chunk
    assert probe["l1_bytes_locked_by_requests"].exact
    assert "l1_bytes_locked_by_requests" not in engine.reclaim_probe("unregister"), "the long session's alone"


def test_an_absent_lock_count_is_an_error_not_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LmcacheAdapter(AdapterContext(workdir=tmp_path))
    monkeypatch.setattr(engine, "get_json", lambda path: status({"write_locked_count": 0}))
    with pytest.raises(EngineError, match="read_locked_count"):
        engine.l1_objects_locked()
