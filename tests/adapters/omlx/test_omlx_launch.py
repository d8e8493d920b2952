"""The real `omlx serve` on Linux CPU (environment spec omlx: oMLX code as distributed by
flyto-mlx 0.7.0): one launch with the tiny MLX model, what the adapter relies on, teardown.

- everything oMLX writes stays in the work dir (--base-path; $HOME is a fresh folder here, so
  a ~/.omlx would show), and the generated API key is nowhere in it once the server stopped
  (oMLX writes it into <base>/settings.json; the adapter redacts it);
- the tiny model's tokenizer is word-level (the adapter refuses the numbers otherwise) and
  the SSD tier writes one file per 256-token block;
- an exact block-aligned hit is served from N-1 tokens (oMLX trims the cache by one token,
  omlx/scheduler.py `_trim_prompt_cache_for_generation`), a partial one from whole blocks;
- the admin API of this build has /admin/api/hot-cache/clear and answers the session stats.

Skipped where the environment is not built (kvconform env build omlx).
"""

from __future__ import annotations

from pathlib import Path

import psutil

from kvconform import envs
from kvconform.adapters.omlx.adapter import BLOCK_SIZE, OmlxAdapter
from kvconform.contract import AdapterContext, EngineConfig, ensure
from tests.system.engine_envs import skip_unless_built

pytestmark = skip_unless_built("omlx")


def test_launch_serve_and_teardown_keep_to_the_work_dir(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVCONFORM_ENV_ROOT", str(envs.env_root()))  # found before $HOME moves
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("KVCONFORM_OMLX_API_KEY", raising=False)
    monkeypatch.delenv("KVCONFORM_OMLX_MODEL_DIR", raising=False)
    work = tmp_path / "work"
    adapter = OmlxAdapter(AdapterContext(workdir=work, start_timeout_s=180, request_timeout_s=120))
    key = adapter.api_key
    assert adapter.version.startswith("flyto-mlx ")
    try:
        ensure(adapter, EngineConfig())
        pids = adapter.engine_pids()
        aligned = list(range(100, 100 + 2 * BLOCK_SIZE))
        first = adapter.serve_prompt(aligned)
        adapter.persistent_tier().flush()  # with no hot cache the blocks land on SSD asynchronously
        exact = adapter.serve_prompt(aligned)
        assert (first.cached_tokens, exact.cached_tokens) == (0, 2 * BLOCK_SIZE - 1)
        assert exact.output == first.output
        partial = aligned + list(range(900, 940))
        assert adapter.serve_prompt(partial).cached_tokens == 2 * BLOCK_SIZE
        adapter.persistent_tier().flush()
        files = adapter.persistent_tier().files()
        assert len(files) == 2  # the partial block (40 tokens) is not stored
        block_bytes = adapter.deployment.model.block_bytes(BLOCK_SIZE)
        assert all(block_bytes <= f.stat().st_size < block_bytes + 4096 for f in files)
        assert adapter.clear_hot_cache() == 0  # the route exists; the hot cache is off
        stats = adapter.session_stats()
        assert "api_key" not in stats
        assert stats["runtime_cache"]["effective_block_sizes"] == [BLOCK_SIZE]
    finally:
        reports = adapter.stop()
    assert [r for r in reports if not r.clean] == [], [r.describe() for r in reports]
    assert [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"] == []
    assert list(home.iterdir()) == []  # nothing in ~/.omlx (or anywhere else in $HOME)
    leaked = [p for p in work.rglob("*") if p.is_file() and key.encode() in p.read_bytes()]
    assert leaked == []
