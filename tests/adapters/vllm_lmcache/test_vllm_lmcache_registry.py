"""The vllm-lmcache churn measure `server_registered_instances` can fail, on the real stack.

A churn cycle judges the instances the LMCache server still holds registered after a vLLM
instance left (GET /status). A restart given its stop grace unregisters (0 every cycle), so
the churn sees the measure hold; here a vLLM killed with SIGKILL, which never unregisters, must
read as still registered (LMCache's reaper drops it only after its >= 30 s timeout). vLLM's
default grace of 0 lands between the two, a race (vllm/adapter.py SHUTDOWN_GRACE_S).

Skipped where the environment is not built (kvconform env build vllm-lmcache).
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import psutil

from kvconform.adapters.vllm_lmcache.adapter import VllmLmcacheAdapter
from kvconform.contract import AdapterContext, EngineConfig, ensure
from tests.system.engine_envs import skip_unless_built

pytestmark = skip_unless_built("vllm-lmcache", "lmcache")


def test_a_vllm_killed_before_unregistering_reads_as_registered(tmp_path: Path) -> None:
    adapter = VllmLmcacheAdapter(AdapterContext(workdir=tmp_path / "work", start_timeout_s=300))
    try:
        ensure(adapter, EngineConfig())
        assert adapter.reclaim_probe()["server_registered_instances"].value == 1  # vLLM serving
        assert adapter.server is not None
        pids = adapter.server.pids()
        # vLLM's whole tree at once, as a node failure would: no unregister. Stopped first, so
        # none runs between two kills (a worker that outlived its engine core by a moment, on a
        # loaded runner, noticed "Parent process exited" and unregistered cleanly).
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=10)[1]
        assert not alive, f"vLLM processes survived SIGKILL: {alive}"
        left = adapter.reclaim_probe()["server_registered_instances"].value
        assert left == 1, f"a vLLM gone without unregistering reads {left} registered instances"
    finally:
        adapter.stop()
    assert [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"] == []
