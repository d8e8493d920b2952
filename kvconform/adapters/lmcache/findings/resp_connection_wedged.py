"""LMCache's RESP (Redis) L2 fails every store after Redis refused one write (-OOM).

Standalone: LMCache's own CLI (`lmcache server`, `lmcache bench server`) and Debian's
`redis-server`, run with the interpreter of an environment that has `lmcache` installed. Starts
a Redis and one LMCache server with the RESP L2 adapter (one worker connection), then runs the
bench client three times, each with fresh token sequences:
  1. Redis takes writes: the bench's chunks land in Redis (the keys Redis holds grow by N);
  2. Redis refuses writes (CONFIG SET maxmemory 1, noeviction): LMCache's stores get -OOM;
  3. Redis takes writes again (CONFIG SET maxmemory 0; a plain SET succeeds): the new chunks
     should be stored as in 1.
LMCache's side is what decides: in step 3 its server logs 'Store task N to adapter 0 failed'
for every store task. Redis's key count understates the loss: each failed task still sends its
first SET (Redis stores it) before it misreads the reply, so step 3 lands one key per task.
Exit 1 while the bug is there (step 3 logs failed stores, or lands fewer keys than step 1),
0 if step 3 stores everything, 2 if the setup failed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

SHAPE = "(2,64,16,2,64):float16:2"  # K/V, 64 blocks x 16 tokens, 2 heads x 64, fp16, 2 layers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis(port: int, *args: str) -> bytes:
    """One command over a plain RESP connection; the raw first reply line (and bulk)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        parts = [f"*{len(args)}\r\n".encode()]
        for arg in args:
            parts.append(f"${len(arg.encode())}\r\n{arg}\r\n".encode())
        conn.sendall(b"".join(parts))
        return conn.recv(65536)


def dbsize(port: int) -> int:
    return int(redis(port, "DBSIZE").strip()[1:])


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s")


def healthy(url: str) -> bool:
    with urllib.request.urlopen(url + "/healthcheck", timeout=2) as r:
        return r.status == 200


def settled_dbsize(port: int, quiet_s: float = 3.0, timeout_s: float = 30.0) -> int:
    """Redis's key count once it has stopped changing (LMCache writes L2 behind L1)."""
    last, since, deadline = dbsize(port), time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.5)
        now = dbsize(port)
        if now != last:
            last, since = now, time.monotonic()
    return last


def failed_stores(work: Path) -> int:
    """Store tasks the LMCache server logged as failed so far."""
    text = (work / "lmcache.log").read_text(errors="replace")
    return sum("Store task" in line and "failed" in line for line in text.splitlines())


def main() -> int:
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        print("setup failed: redis-server is not on PATH (Debian package redis-server)")
        return 2
    lmcache = str(Path(sys.executable).with_name("lmcache"))
    work = Path(tempfile.mkdtemp(prefix="lmcache-resp-"))
    rport, rpc, http = free_port(), free_port(), free_port()
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    procs: list[subprocess.Popen] = []
    log = (work / "lmcache.log").open("w")
    try:
        procs.append(
            subprocess.Popen(
                [
                    redis_server,
                    "--port",
                    str(rport),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    str(work),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
            )
        )
        wait_for(lambda: redis(rport, "PING").startswith(b"+PONG"), 30, "redis-server")
        l2 = {"type": "resp", "host": "127.0.0.1", "port": rport, "num_workers": 1}
        procs.append(
            subprocess.Popen(
                [
                    lmcache,
                    "server",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(rpc),
                    "--http-host",
                    "127.0.0.1",
                    "--http-port",
                    str(http),
                    "--chunk-size",
                    "256",
                    "--l1-size-gb",
                    "0.25",
                    "--eviction-policy",
                    "LRU",
                    "--l2-adapter",
                    json.dumps(l2),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        )
        wait_for(lambda: healthy(f"http://127.0.0.1:{http}"), 120, "lmcache server")

        def bench(start: int) -> None:
            run = subprocess.run(
                [
                    lmcache,
                    "bench",
                    "server",
                    "--mode",
                    "cpu",
                    "--transfer-mode",
                    "lmcache_driven",
                    "--rpc-url",
                    f"tcp://127.0.0.1:{rpc}",
                    "--url",
                    f"http://127.0.0.1:{http}",
                    "--kvcache-shape-spec",
                    SHAPE,
                    "--num-blocks",
                    "64",
                    "--block-size",
                    "16",
                    "--num-tokens",
                    "512",
                    "--start",
                    str(start),
                    "--end",
                    str(start + 4),
                    "--interval",
                    "0.1",
                    "--quiet",
                ],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            print(f"  bench --start {start}: exit {run.returncode}")

        before = dbsize(rport)
        bench(0)
        landed_first = settled_dbsize(rport) - before
        print(f"1. Redis takes writes: {landed_first} new keys in Redis")
        if landed_first == 0:
            print("setup failed: nothing reached Redis even before any refusal")
            return 2

        redis(rport, "CONFIG", "SET", "maxmemory-policy", "noeviction")
        redis(rport, "CONFIG", "SET", "maxmemory", "1")
        before = dbsize(rport)
        bench(100)
        refused = settled_dbsize(rport) - before
        oom = redis(rport, "SET", "kvconform-probe", "x")
        print(f"2. Redis refuses writes: {refused} new keys; a plain SET answers {oom.strip()[:60]!r}")

        redis(rport, "CONFIG", "SET", "maxmemory", "0")
        probe = redis(rport, "SET", "kvconform-probe", "x")
        redis(rport, "DEL", "kvconform-probe")
        before = dbsize(rport)
        failed_before = failed_stores(work)
        bench(200)
        landed_again = settled_dbsize(rport) - before
        failed_again = failed_stores(work) - failed_before
        print(
            f"3. Redis takes writes again (a plain SET answers {probe.strip()!r}): "
            f"{landed_again} new keys in Redis, expected {landed_first}"
        )
        print(f"   LMCache store tasks logged as failed in step 3: {failed_again}")
        wedged = failed_again > 0 or landed_again < landed_first
        verdict = "BUG: " if wedged else "ok: "
        print(
            f"{verdict}{failed_again} store tasks failed after the refusal; "
            f"{landed_again} of {landed_first} keys landed"
        )
        return 1 if wedged else 0
    except Exception as exc:  # setup problems are not the bug
        print(f"setup failed: {type(exc).__name__}: {exc}")
        print((work / "lmcache.log").read_text()[-3000:])
        return 2
    finally:
        for proc in reversed(procs):
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
