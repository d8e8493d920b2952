"""Instances that register and unregister imported KV memory.

On hosts, a client exports KV memory as a POSIX shared-memory file and the engine imports it
by mapping the file. On GPUs, the client exports a CUDA tensor over CUDA IPC (torch's own
tensor reduction) and the engine imports it. Unregister moves the import to a release batch;
the collect step closes mappings and drops tensors, then calls torch.cuda.ipc_collect() so the
exporter can really free its memory (LMCache #4015 is that last step missing).

The CUDA handle arrives pickled (torch's reduction is a rebuild function plus arguments); the
engine listens on 127.0.0.1 only, for the suite that launched it.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHM_DIR = Path("/dev/shm")


@dataclass
class Imported:
    instance_id: str
    shm_name: str
    nbytes: int
    mapping: mmap.mmap | None = None
    tensor: Any = None  # a CUDA tensor imported over IPC

    def release(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
        self.tensor = None


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

    def register_cuda(self, instance_id: str, handle: bytes) -> None:
        import pickle

        rebuild, args = pickle.loads(handle)
        tensor = rebuild(*args)
        with self.lock:
            if instance_id in self.instances:
                raise KeyError(f"instance {instance_id} already registered")
            self.instances[instance_id] = Imported(
                instance_id, "", tensor.numel() * tensor.element_size(), tensor=tensor
            )
            self.registered_total += 1

    def write(self, instance_id: str, payload: bytes) -> int:
        """Copy KV into the instance's memory, repeating it to fill the region."""
        with self.lock:
            imported = self.instances[instance_id]
            if imported.tensor is not None:
                import torch

                chunk = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(imported.tensor.device)
                flat = imported.tensor.view(torch.uint8).view(-1)
                for offset in range(0, flat.numel(), chunk.numel()):
                    n = min(chunk.numel(), flat.numel() - offset)
                    flat[offset : offset + n] = chunk[:n]
                return imported.nbytes
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
            imported.release()
        if any(i.tensor is None and i.mapping is None for i in released) and _cuda_in_use():
            import torch

            torch.cuda.ipc_collect()  # the exporter can free what it shared only after this
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
            imported.release()


def _cuda_in_use() -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
