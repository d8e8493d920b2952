"""Run a command in a private mount namespace with tmpfs mounts of its own (the machine's real
/dev/shm and disks are never touched):

    unshare -m -- python tests/system/chaos/in_mounts.py DIR:OPTS [DIR:OPTS ...] -- COMMAND...

e.g. /dev/shm:size=1m (a full /dev/shm) or RESULTS:ro,size=64k (a results dir not writable)."""

from __future__ import annotations

import os
import subprocess
import sys

if __name__ == "__main__":
    split = sys.argv.index("--")
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    for spec in sys.argv[1:split]:
        target, _, opts = spec.partition(":")
        os.makedirs(target, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", target], check=True)
    command = sys.argv[split + 1 :]
    os.execvp(command[0], command)
