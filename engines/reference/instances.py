"""Instances that register and unregister imported KV memory.

On hosts, a client exports KV memory as a POSIX shared-memory file and the engine imports it
by mapping the file; unregister drops the mapping. As with CUDA IPC (where the importer must
call torch.cuda.ipc_collect() once the last reference is gone, LMCache #4015), released
imports are closed by a collect step after the release batch.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")


@dataclass
class Imported:
    instance_id: str
    shm_name: str
    nbytes: int
    mapping: mmap.mmap


class InstanceRegistry:
    def __init__(self, faults: frozenset[str]) -> None:
        self.faults = faults
        self.instances: dict[str, Imported] = {}
        self.pending_release: list[Imported] = []
        self.leaked: list[Imported] = []
        self.lock = threading.Lock()
        self.registered_total = 0
        self.unregistered_total = 0
        self.duplicate_unregisters = 0
        self.released_ids: set[str] = set()

    def register(self, instance_id: str, shm_name: str, nbytes: int) -> None:
        if "/" in shm_name or not shm_name:
            raise ValueError(f"bad shm name {shm_name!r}")
        with self.lock:
            if instance_id in self.instances:
                raise KeyError(f"instance {instance_id} already registered")
            fd = os.open(SHM_DIR / shm_name, os.O_RDWR)
            try:
                mapping = mmap.mmap(fd, nbytes)
            finally:
                os.close(fd)
            # Touch every page: imported KV is resident while the instance lives.
            for offset in range(0, nbytes, mmap.PAGESIZE):
                mapping[offset] = mapping[offset]
            self.instances[instance_id] = Imported(instance_id, shm_name, nbytes, mapping)
            self.registered_total += 1

    def write(self, instance_id: str, payload: bytes) -> int:
        """Copy KV into the instance's memory, repeating it to fill the region."""
        with self.lock:
            imported = self.instances[instance_id]
            for offset in range(0, imported.nbytes, len(payload)):
                n = min(len(payload), imported.nbytes - offset)
                imported.mapping[offset : offset + n] = payload[:n]
            return imported.nbytes

    def unregister(self, instance_id: str) -> bool:
        """Release one instance; False (harmless) if it is not registered."""
        with self.lock:
            imported = self.instances.pop(instance_id, None)
            if imported is None:
                self.duplicate_unregisters += 1
                if instance_id in self.released_ids and "double_unregister_crashes" in self.faults:
                    os._exit(3)
                return False
            self.released_ids.add(instance_id)
            self.unregistered_total += 1
            if "leak_on_unregister" in self.faults:
                self.leaked.append(imported)
            else:
                self.pending_release.append(imported)
        if "no_ipc_collect" not in self.faults:
            self.collect()
        return True

    def collect(self) -> int:
        """Close released imports (the host analogue of torch.cuda.ipc_collect())."""
        with self.lock:
            released, self.pending_release = self.pending_release, []
        for imported in released:
            imported.mapping.close()
        return len(released)

    def mapped_bytes(self) -> int:
        with self.lock:
            live = self.instances.values()
            return sum(i.nbytes for i in [*live, *self.pending_release, *self.leaked])

    def close(self) -> None:
        with self.lock:
            everything = [*self.instances.values(), *self.pending_release, *self.leaked]
            self.instances.clear()
            self.pending_release.clear()
            self.leaked.clear()
        for imported in everything:
            imported.mapping.close()
