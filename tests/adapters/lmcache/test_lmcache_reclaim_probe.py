"""LMCache's reclaim probe reads what the churn path it is asked about leaves behind, and the
server's own measures outside churn: a check after a `close` or `destroy` churn is judged on
the server's measures (the long session once read the closed-server leftover count as its
exact memory measure, when the probe followed the last churn check's path)."""

from __future__ import annotations

from pathlib import Path

from kvconform.adapters.lmcache.adapter import LmcacheAdapter
from kvconform.contract import AdapterContext


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
