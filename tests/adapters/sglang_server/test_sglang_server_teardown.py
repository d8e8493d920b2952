"""The real SGLang server on CPU (environment spec sglang-server): one launch, one prompt served
twice, then teardown must leave nothing behind -- no process of the tree, no /dev/shm file, no
ipc:// socket file in the launch's TMPDIR.

SGLang 0.5.23 never unlinks its load-snapshot file (/dev/shm/sglang_loads_<id>_<digest>.shm,
srt/managers/load_snapshot.py): the harness removes it, and the teardown report names it as
the engine's leftover, never hides it. Skipped where the environment is not built.
"""

from __future__ import annotations

from pathlib import Path

import psutil

from kvconform.adapters.sglang_server.adapter import SglangServerAdapter
from kvconform.contract import AdapterContext, EngineConfig, ensure
from kvconform.processes import SHM_DIR
from tests.system.engine_envs import skip_unless_built

pytestmark = skip_unless_built("sglang-server")


def test_launch_serve_and_teardown_leave_nothing(tmp_path: Path) -> None:
    adapter = SglangServerAdapter(AdapterContext(workdir=tmp_path, start_timeout_s=300))
    try:
        ensure(adapter, EngineConfig())
        pids = adapter.engine_pids()
        tmpdir = adapter._tmpdir
        assert tmpdir is not None and tmpdir.is_dir()
        held = adapter.server.process.held_shm() if adapter.server else set()
        prompt = list(range(100, 180))  # 80 tokens = 5 pages of 16
        first, second = adapter.serve_prompt(prompt), adapter.serve_prompt(prompt)
        assert (first.cached_tokens, second.cached_tokens) == (0, 64)  # the last token is computed
    finally:
        reports = adapter.stop()
    assert len(pids) >= 3  # the HTTP server, scheduler and detokenizer (at least)
    assert [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"] == []
    assert not tmpdir.exists()
    (report,) = reports
    assert report.leftover_processes == []
    assert set(report.leftover_shm) <= {n for n in held if n.startswith("sglang_loads_")}
    assert all(not (SHM_DIR / name).exists() for name in report.leftover_shm)
    assert not (tmp_path / "logs" / "sgl_kernel-standin-calls.log").exists()  # no kernel was called
