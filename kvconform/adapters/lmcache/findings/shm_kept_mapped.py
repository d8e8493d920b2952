"""LMCache MP server keeps an unregistered instance's KV shared memory mapped (lmcache_driven, CPU).

Standalone: LMCache's own CLI only (`lmcache server`, `lmcache bench server`), run with the
interpreter of an environment that has `lmcache` installed. Starts one server, runs the bench
client CYCLES times in lmcache_driven transfer mode (each run registers one instance, stores and
retrieves, then unregisters it and exits), and after each run sums the /dev/shm mappings in the
server's /proc/<pid>/maps. Once every client has unregistered and exited, the server should map
none of their KV. Exit 1 while the bug is there (the mapped bytes grow by one instance's KV per
run), 0 if not, 2 if the setup failed.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CYCLES = 3
SHAPE = "(2,64,16,2,64):float16:2"  # K/V, 64 blocks x 16 tokens, 2 heads x 64, fp16, 2 layers
INSTANCE_KV_BYTES = 2 * 64 * 16 * 2 * 64 * 2 * 2  # 1 MiB


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lmcache() -> str:
    return str(Path(sys.executable).with_name("lmcache"))


def shm_mapped_bytes(pid: int) -> int:
    """Bytes of /dev/shm files (unlinked ones too) mapped into the process."""
    total = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith("/dev/shm/"):
            start, end = (int(x, 16) for x in parts[0].split("-"))
            total += end - start
    return total


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"lmcache server exited with {server.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/healthcheck", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"lmcache server not healthy after {timeout_s:.0f} s")


def main() -> int:
    rpc, http = free_port(), free_port()
    log = tempfile.NamedTemporaryFile(prefix="lmcache-server-", suffix=".log", delete=False)  # noqa: SIM115
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    server = subprocess.Popen(
        [
            lmcache(),
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
            "--supported-transfer-mode",
            "lmcache_driven",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        wait_healthy(f"http://127.0.0.1:{http}", server)
        baseline = shm_mapped_bytes(server.pid)
        print(f"server pid {server.pid}: /dev/shm mapped at start {baseline} bytes")
        mapped = []
        for cycle in range(CYCLES):
            bench = subprocess.run(
                [
                    lmcache(),
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
                    str(10 * cycle),
                    "--end",
                    str(10 * cycle + 2),
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
            if bench.returncode != 0:
                print(f"bench client failed ({bench.returncode}):")
                print(bench.stdout[-2000:] + bench.stderr[-2000:])
                return 2
            time.sleep(2.0)  # unregister is processed by the server after the client's last call
            mapped.append(shm_mapped_bytes(server.pid) - baseline)
            print(
                f"after client {cycle + 1} registered, used and unregistered its instance and exited: "
                f"server maps {mapped[-1]} bytes of /dev/shm beyond its start "
                f"(one instance's KV is {INSTANCE_KV_BYTES})"
            )
        leaked = mapped[-1] >= CYCLES * INSTANCE_KV_BYTES
        verdict = "BUG: " if leaked else "ok: "
        print(f"{verdict}{mapped[-1]} bytes of {CYCLES} gone instances' KV still mapped")
        return 1 if leaked else 0
    except Exception as exc:  # setup problems are not the bug
        print(f"setup failed: {type(exc).__name__}: {exc}")
        print(Path(log.name).read_text()[-3000:])
        return 2
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        for leftover in Path("/dev/shm").glob("lmcache_kv_*"):
            try:
                if leftover.stat().st_uid == os.getuid():
                    leftover.unlink()
            except OSError:
                pass
        os.unlink(log.name)


if __name__ == "__main__":
    sys.exit(main())
