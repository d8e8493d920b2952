"""The Redis server of engine lmcache-redis: Debian's redis-server, launched by the suite on
127.0.0.1 in its own process group, spoken to with the suite's RESP client, stopped with
nothing left (no process, no data dir file). The full stack (LMCache's RESP L2 adapter against
it, across an LMCache restart) runs where the lmcache environment is built.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import psutil
import pytest

from kvconform import envs
from kvconform.adapters.lmcache import redis_server
from kvconform.adapters.lmcache.redis_server import RedisServer, RespClient, RespError
from kvconform.contract import AdapterContext, EngineConfig, ensure, restart
from kvconform.errors import UsageError

pytestmark = pytest.mark.engine_env  # parses/runs in built engine environments (tests/system/engine_envs.py)
needs_redis = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")


def _lmcache_built() -> bool:
    try:
        envs.find("lmcache")
    except UsageError:
        return False
    return True


def test_missing_binary_names_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_server.shutil, "which", lambda _name: None)
    with pytest.raises(UsageError, match=r"apt-get install -y redis-server"):
        redis_server.redis_binary()


@needs_redis
def test_redis_server_round_trip_and_clean_stop(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)
    try:
        pid = server.process.pid
        assert server.process.pgid == pid  # its own process group
        assert server.command("SET", "kvc-model@k", b"\x00\xff" * 10) == "OK"
        assert server.command("STRLEN", "kvc-model@k") == 20
        assert server.command("GET", "kvc-model@k") == b"\x00\xff" * 10
        assert server.keys("kvc-model@*") == ["kvc-model@k"]
        assert server.command("DBSIZE") == 1
        with pytest.raises(RespError):
            server.command("NOSUCHCOMMAND")
        assert server.data_dir.is_dir() and server.data_dir.is_relative_to(tmp_path)
    finally:
        report = server.stop()
    assert report.clean, report.describe()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"
    assert server.left_data_files == []  # --save "" --appendonly no: nothing written
    assert not server.data_dir.exists()
    with pytest.raises(OSError):
        RespClient("127.0.0.1", server.port, timeout_s=1.0)


@needs_redis
@pytest.mark.skipif(not _lmcache_built(), reason="environment lmcache not built")
def test_lmcache_resp_tier_survives_restart_and_stops_clean(tmp_path: Path) -> None:
    from kvconform.adapters.lmcache.adapter import LmcacheRedisAdapter

    adapter = LmcacheRedisAdapter(AdapterContext(workdir=tmp_path, start_timeout_s=120))
    prompt = list(range(5000, 5000 + 2 * 256 + 7))
    try:
        ensure(adapter, EngineConfig(persistent=True))
        assert adapter.serve_prompt(prompt).cached_tokens == 0
        adapter.persistent_tier().flush()
        entries = adapter.remote_tier().entries()
        assert sorted(entries.values()) == [adapter.persistent_tier().block_bytes()] * 2
        redis_pid = adapter.redis.process.pid if adapter.redis else 0
        restart(adapter)
        assert adapter.redis is not None and adapter.redis.process.pid == redis_pid  # Redis kept
        warm = adapter.serve_prompt(prompt)
        assert (warm.cached_tokens, warm.output) == (512, [1])  # from Redis, bytes checked
    finally:
        adapter.close()
    assert adapter.redis is None and adapter.redis_reports and adapter.redis_reports[-1].clean
    assert not (tmp_path / "redis-data").exists()
    assert not psutil.pid_exists(redis_pid) or psutil.Process(redis_pid).status() == "zombie"
