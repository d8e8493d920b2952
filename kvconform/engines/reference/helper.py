"""The reference engine's side process: a flusher that shares a status page with the server.

    python -m kvconform.engines.reference.helper --segment NAME [--detach]

The server starts it and it lives in the server's process group, so the group's SIGTERM ends
it; on SIGTERM it unlinks its /dev/shm page and exits. With --detach (the
orphan_after_restart fault) it starts a session of its own, as a daemonised worker does:
the group's signal never reaches it, it outlives a restart, and when it is finally killed
its page is left behind.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

SHM_DIR = Path("/dev/shm")
PAGE_BYTES = 64 * 1024


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--segment", required=True)
    p.add_argument("--detach", action="store_true")
    args = p.parse_args(argv)
    if args.detach:
        os.setsid()
    path = SHM_DIR / args.segment
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
    os.ftruncate(fd, PAGE_BYTES)
    page = mmap.mmap(fd, PAGE_BYTES)
    os.close(fd)

    def stop(_signum: int, _frame: Any) -> None:
        page.close()
        path.unlink(missing_ok=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    beat = 0
    while True:
        beat += 1
        page[:8] = beat.to_bytes(8, "little")
        time.sleep(0.2)


if __name__ == "__main__":
    main()
