"""lmcache-redis's Redis as the REMOTE_TIER facet, read with the suite's own RESP client."""

from __future__ import annotations

from typing import Protocol

from kvconform.adapters.lmcache.redis_server import REDIS_MAXMEMORY, RedisServer
from kvconform.contract import RemoteStore
from kvconform.errors import EngineError
from kvconform.processes import TeardownReport

REDIS_L2_CAPACITY_BYTES = 8 * 2**20  # 32 chunks of 256 tokens: the L2 eviction check fills it twice over
MODEL_NAME = "kvc-model"  # what our client registers; LMCache's keys start "kvc-model@"


class RedisOwner(Protocol):
    """What the store needs of the adapter that runs Redis beside its engine."""

    @property
    def name(self) -> str: ...

    def running_redis(self) -> RedisServer: ...
    def ensure_redis(self) -> RedisServer: ...
    def stop_remote(self) -> TeardownReport: ...
    def stop(self) -> list[TeardownReport]: ...


class RedisStore(RemoteStore):
    """The adapter's Redis, alive or not: every call finds the server that runs now."""

    def __init__(self, adapter: RedisOwner) -> None:
        self.adapter = adapter

    def _redis(self) -> RedisServer:
        return self.adapter.running_redis()

    def entries(self) -> dict[str, int]:
        """LMCache's keys in Redis -> the bytes each holds (STRLEN)."""
        redis = self._redis()
        client = redis.client()
        try:
            return {key: int(client.call("STRLEN", key)) for key in redis.keys(f"{MODEL_NAME}@*")}
        finally:
            client.close()

    def objects_total(self) -> int:
        return int(self._redis().command("DBSIZE"))

    def memory_usage(self, key: str) -> int:
        return int(self._redis().command("MEMORY", "USAGE", key) or 0)

    def read(self, key: str) -> bytes:
        return bytes(self._redis().command("GET", key) or b"")

    def write(self, key: str, data: bytes) -> None:
        self._redis().command("SET", key, data)

    def capacity_bytes(self) -> int:
        return REDIS_L2_CAPACITY_BYTES

    def wipe(self) -> None:
        """FLUSHALL, with LMCache stopped."""
        self.adapter.stop()
        self.adapter.ensure_redis().command("FLUSHALL")

    def down(self) -> TeardownReport:
        return self.adapter.stop_remote()

    def pause_writes(self, seconds: float) -> None:
        # CLIENT PAUSE ... WRITE (Redis >= 6.2): write commands block, reads are served
        self._redis().command("CLIENT", "PAUSE", int(seconds * 1000), "WRITE")

    def refuse_writes(self, refuse: bool) -> None:
        """Redis under `noeviction` answers every write with an OOM error once its memory is over
        maxmemory: 1 byte refuses all, the launch value (REDIS_MAXMEMORY) restores it."""
        value = "1" if refuse else REDIS_MAXMEMORY
        self._redis().command("CONFIG", "SET", "maxmemory", value)

    def refused_writes(self) -> int:
        """Redis's own count of OOM replies (INFO errorstats: errorstat_OOM:count=N). Redis
        lists an error type only once it has replied with one, so no line is a true 0; no
        Errorstats section at all (Redis < 6.2) is an error."""
        info = self._redis().command("INFO", "errorstats")
        text = info.decode() if isinstance(info, bytes) else str(info)
        if "# Errorstats" not in text:
            raise EngineError(
                self.adapter.name, f"redis INFO errorstats has no Errorstats section: {text[:200]!r}"
            )
        for line in text.splitlines():
            if line.startswith("errorstat_OOM:"):
                return int(line.split("count=", 1)[1].split(",", 1)[0])
        return 0
