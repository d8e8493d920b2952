"""LMCache's reclaim probe follows the churn path of the check that set it, and only that
check: a check after a `close` or `destroy` churn is judged on the server's own measures again
(the long session once read the closed-server leftover count as its exact memory measure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconform.adapters.lmcache.adapter import LmcacheAdapter
from kvconform.contract import AdapterContext, EngineAdapter, EngineConfig


@pytest.mark.parametrize("path", ["close", "destroy"])
def test_ensure_returns_the_probe_to_the_server(
    path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(EngineAdapter, "ensure", lambda self, config=None: None)  # nothing launched
    engine = LmcacheAdapter(AdapterContext(workdir=tmp_path))
    engine.churn_path = path
    engine.ensure(EngineConfig())
    assert sorted(engine.reclaim_probe()) == ["server_rss_bytes", "server_shm_mapped_bytes"]
