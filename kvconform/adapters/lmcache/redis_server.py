"""A real Redis server the suite owns (Debian's `redis-server`), and a minimal RESP client.

The server runs on 127.0.0.1 on a reserved free port, in its own process group (EngineProcess:
teardown signals the group and audits leftovers), with its data dir under the session's work
dir, no RDB snapshots and no AOF: it outlives LMCache restarts because it is a separate
process, not because it writes to disk. The client speaks RESP2 over a socket from the suite
process, so damaging entries, counting keys and measuring bytes never go through LMCache.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
from pathlib import Path
from typing import Any

from kvconform.errors import EngineError, UsageError
from kvconform.processes import EngineProcess, TeardownReport, free_port, wait_until_ready

REDIS_PACKAGE = "redis-server"  # the Debian package that ships /usr/bin/redis-server
REDIS_MAXMEMORY = "256mb"


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise UsageError(
            f"redis-server not found on PATH: install the Debian package {REDIS_PACKAGE} "
            f"(apt-get install -y {REDIS_PACKAGE})"
        )
    return found


class RespError(Exception):
    pass


class RespClient:
    """Just enough RESP2 for the suite: commands out as arrays of bulk strings, replies parsed."""

    def __init__(self, host: str, port: int, timeout_s: float = 10.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.buf = self.sock.makefile("rb")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.buf.close()
            self.sock.close()

    def call(self, *args: str | bytes | int) -> Any:
        out = [f"*{len(args)}\r\n".encode()]
        for arg in args:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            out += [f"${len(data)}\r\n".encode(), data, b"\r\n"]
        self.sock.sendall(b"".join(out))
        return self._reply()

    def _reply(self) -> Any:
        line = self.buf.readline()
        if not line.endswith(b"\r\n"):
            raise RespError(f"connection closed mid-reply ({line!r})")
        kind, body = line[:1], line[1:-2]
        if kind == b"+":
            return body.decode()
        if kind == b"-":
            raise RespError(body.decode())
        if kind == b":":
            return int(body)
        if kind == b"$":
            n = int(body)
            if n < 0:
                return None
            data = self.buf.read(n + 2)
            return data[:-2]
        if kind == b"*":
            n = int(body)
            return None if n < 0 else [self._reply() for _ in range(n)]
        raise RespError(f"unknown RESP reply {line!r}")


class RedisServer:
    """One redis-server process: started, pinged, stopped with its data dir removed."""

    def __init__(self, workdir: Path, name: str = "redis-server") -> None:
        self.workdir = workdir
        self.name = name
        self.port = free_port()
        self.data_dir = workdir / "redis-data"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            redis_binary(),
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dir",
            str(self.data_dir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--protected-mode",
            "yes",
            "--maxmemory",
            REDIS_MAXMEMORY,  # a runaway tier fails with OOM errors instead of eating the runner
            "--maxmemory-policy",
            "noeviction",  # Redis must not evict on its own: what LMCache deletes is under test
            "--loglevel",
            "notice",
        ]
        self.left_data_files: list[str] = []  # what stop() found in the data dir (then removed)
        self.process = EngineProcess(name, argv, workdir / "logs" / f"{name}.log")
        self.ready_after_s = wait_until_ready(
            self.process, "redis", self._ping, 30.0, what=f"PING on 127.0.0.1:{self.port}"
        )

    def _ping(self) -> bool:
        client = RespClient("127.0.0.1", self.port, timeout_s=1.0)
        try:
            return client.call("PING") == "PONG"
        finally:
            client.close()

    def alive(self) -> bool:
        return self.process.alive()

    def client(self) -> RespClient:
        if not self.alive():
            raise EngineError("redis", "redis-server is not running", self.process.log_tail())
        return RespClient("127.0.0.1", self.port)

    def command(self, *args: str | bytes | int) -> Any:
        client = self.client()
        try:
            return client.call(*args)
        finally:
            client.close()

    def keys(self, pattern: str = "*") -> list[str]:
        client = self.client()
        try:
            cursor, found = "0", []
            while True:
                cursor_b, batch = client.call("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
                found += [k.decode() for k in batch]
                cursor = cursor_b.decode()
                if cursor == "0":
                    return sorted(set(found))
        finally:
            client.close()

    def pids(self) -> list[int]:
        return self.process.pids()

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines)

    def stop(self) -> TeardownReport:
        """SIGTERM the group (redis-server exits without saving: --save ''), audit it, and
        remove the data dir; a file left in it is reported as a leftover."""
        report = self.process.stop(grace_s=10)
        self.left_data_files = (
            sorted(str(p.relative_to(self.data_dir)) for p in self.data_dir.rglob("*"))
            if self.data_dir.exists()
            else []
        )
        shutil.rmtree(self.data_dir, ignore_errors=True)
        return report
