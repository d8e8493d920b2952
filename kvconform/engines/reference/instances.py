"""Instances that register and unregister imported KV memory, and in-process engines.

On hosts, a client exports KV memory as a POSIX shared-memory file and the engine imports it
by mapping the file. On GPUs, the client exports a CUDA tensor over CUDA IPC (torch's own
tensor reduction) and the engine imports it. Unregister moves the import to a release batch;
the collect step closes mappings and drops tensors, after which the exporter can free its
memory (LMCache #4015: an import that stays referenced keeps the exporter's memory). No
torch.cuda.ipc_collect() here: it empties the exporter's own sent-tensor limbo
(torch/csrc/CudaIPCTypes.cpp), so an importer calling it changes nothing (measured on an
H200, docs/gpu-measurements.md).

Each registered instance also gets a staging segment of the engine's own in /dev/shm (the
bounce buffer loads go through); the engine unlinks it on unregister, on reap and on close.
An instance registered with a heartbeat interval is reaped once its client stops beating
(the client died without unregistering): the reaper releases it exactly as unregister does.

In-process engines (the `destroy` release path) hold their KV in a tensor of their own;
destroy must drop every reference to it.

The CUDA handle arrives pickled (torch's reduction is a rebuild function plus arguments); the
engine listens on 127.0.0.1 only, for the suite that launched it.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHM_DIR = Path("/dev/shm")
STAGING_BYTES = 64 * 1024
REAP_AFTER_BEATS = 2  # an instance missing this many heartbeats is dead


@dataclass
class Imported:
    instance_id: str
    shm_name: str
    nbytes: int
    mapping: mmap.mmap | None = None
    tensor: Any = None  # a CUDA tensor imported over IPC
    staging_name: str = ""
    staging: mmap.mmap | None = None
    heartbeat_s: float = 0.0
    last_beat: float = field(default_factory=time.monotonic)

    def release(self) -> None:
        """The importer lets go of the client's memory (mapping closed, tensor dropped)."""
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None
        self.tensor = None

    def drop_staging(self) -> None:
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self.staging_name:
            (SHM_DIR / self.staging_name).unlink(missing_ok=True)


class InstanceRegistry:
    def __init__(self, faults: frozenset[str], reap_interval_s: float = 0.05) -> None:
        self.faults = faults
        self.instances: dict[str, Imported] = {}
        self.pending_release: list[Imported] = []
        self.leaked: list[Imported] = []
        self.lock = threading.Lock()
        self.registered_total = 0
        self.unregistered_total = 0
        self.reaped_total = 0
        self.duplicate_unregisters = 0
        self.released_ids: set[str] = set()
        self.engines: dict[str, LocalEngine] = {}
        self.retired_engines: list[LocalEngine] = []  # only tensor_retained_after_destroy fills it
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, args=(reap_interval_s,), daemon=True)
        self._reaper.start()

    # ---- registration ---------------------------------------------------------------------
    def _staging(self, instance_id: str) -> tuple[str, mmap.mmap]:
        name = f"kvconform-refsrv-{os.getpid()}-{instance_id}"
        fd = os.open(SHM_DIR / name, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, STAGING_BYTES)
            staging = mmap.mmap(fd, STAGING_BYTES)
        finally:
            os.close(fd)
        return name, staging

    def register(self, instance_id: str, shm_name: str, nbytes: int, heartbeat_s: float = 0.0) -> None:
        if "/" in shm_name or not shm_name or "/" in instance_id:
            raise ValueError(f"bad shm name {shm_name!r} or instance id {instance_id!r}")
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
            staging_name, staging = self._staging(instance_id)
            self.instances[instance_id] = Imported(
                instance_id, shm_name, nbytes, mapping, None, staging_name, staging, heartbeat_s
            )
            self.registered_total += 1

    def register_cuda(self, instance_id: str, handle: bytes, heartbeat_s: float = 0.0) -> None:
        import pickle

        rebuild, args = pickle.loads(handle)
        tensor = rebuild(*args)
        with self.lock:
            if instance_id in self.instances:
                raise KeyError(f"instance {instance_id} already registered")
            staging_name, staging = self._staging(instance_id)
            self.instances[instance_id] = Imported(
                instance_id,
                "",
                tensor.numel() * tensor.element_size(),
                None,
                tensor,
                staging_name,
                staging,
                heartbeat_s,
            )
            self.registered_total += 1

    def heartbeat(self, instance_id: str) -> bool:
        with self.lock:
            imported = self.instances.get(instance_id)
            if imported is None:
                return False
            imported.last_beat = time.monotonic()
            return True

    def registered(self, instance_id: str) -> bool:
        with self.lock:
            return instance_id in self.instances

    def write(self, instance_id: str, payload: bytes) -> int:
        """Copy KV into the instance's memory through its staging segment, repeating it to
        fill the region."""
        with self.lock:
            imported = self.instances[instance_id]
            if imported.staging is not None:
                n = min(len(payload), STAGING_BYTES)
                imported.staging[:n] = payload[:n]
            if imported.tensor is not None:
                import torch

                chunk = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(imported.tensor.device)
                flat = imported.tensor.view(torch.uint8).view(-1)
                for offset in range(0, flat.numel(), chunk.numel()):
                    n = min(chunk.numel(), flat.numel() - offset)
                    flat[offset : offset + n] = chunk[:n]
                return imported.nbytes
            assert imported.mapping is not None  # a CPU import maps the file
            for offset in range(0, imported.nbytes, len(payload)):
                n = min(len(payload), imported.nbytes - offset)
                imported.mapping[offset : offset + n] = payload[:n]
            return imported.nbytes

    # ---- release --------------------------------------------------------------------------
    def unregister(self, instance_id: str) -> bool:
        """Release one instance; False (harmless) if it is not registered."""
        with self.lock:
            key = f"instance:{instance_id}" if "unregister_key_mismatch" in self.faults else instance_id
            imported = self.instances.pop(key, None)
            if imported is None:
                self.duplicate_unregisters += 1
                if instance_id in self.released_ids and "double_unregister_crashes" in self.faults:
                    os._exit(3)
                return False
            self._retire(imported)
            self.unregistered_total += 1
        self.collect()
        return True

    def _retire(self, imported: Imported) -> None:
        """Move a released instance to the release batch (called with the lock held)."""
        self.released_ids.add(imported.instance_id)
        imported.drop_staging()
        if "leak_on_unregister" in self.faults:
            self.leaked.append(imported)
        else:
            self.pending_release.append(imported)

    def _reap_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            now = time.monotonic()
            with self.lock:
                dead = [
                    i
                    for i in self.instances.values()
                    if i.heartbeat_s > 0 and now - i.last_beat > REAP_AFTER_BEATS * i.heartbeat_s
                ]
                if "reaper_never_reaps" in self.faults:
                    dead = []  # the reaper sees the dead instances and never releases them
                for imported in dead:
                    del self.instances[imported.instance_id]
                    self._retire(imported)
                    self.reaped_total += 1
            if dead:
                self.collect()

    def collect(self) -> int:
        """Close released imports, so their exporters can free what they shared."""
        with self.lock:
            released, self.pending_release = self.pending_release, []
        for imported in released:
            imported.release()
        return len(released)

    def mapped_bytes(self) -> int:
        with self.lock:
            live = self.instances.values()
            return sum(i.nbytes for i in [*live, *self.pending_release, *self.leaked])

    # ---- in-process engines (destroy) ---------------------------------------------------------
    def create_engine(self, engine_id: str, nbytes: int) -> None:
        with self.lock:
            if engine_id in self.engines:
                raise KeyError(f"engine {engine_id} already exists")
            self.engines[engine_id] = LocalEngine(engine_id, nbytes)

    def engine(self, engine_id: str) -> LocalEngine:
        with self.lock:
            return self.engines[engine_id]

    def destroy_engine(self, engine_id: str) -> bool:
        with self.lock:
            local = self.engines.pop(engine_id, None)
        if local is None:
            return False
        if "tensor_retained_after_destroy" in self.faults:
            self.retired_engines.append(local)  # kept "for its stats": its KV buffer too
        else:
            local.close()
        return True

    def close(self) -> None:
        """Shutdown: release every import and unlink every staging segment."""
        self._stop.set()
        with self.lock:
            live = list(self.instances.values())
            everything = [*live, *self.pending_release, *self.leaked]
            self.instances.clear()
            self.pending_release.clear()
            self.leaked.clear()
            engines = list(self.engines.values())
            self.engines.clear()
        for imported in everything:
            imported.release()
            if imported in live and "close_leaves_instance_shm" in self.faults:
                continue  # only unregister unlinks staging: instances live at close leave theirs
            imported.drop_staging()
        for local in engines:
            local.close()


class LocalEngine:
    """An in-process engine: its KV cache is one tensor over anonymous memory of its own, so
    destroying it returns the pages to the OS at once (no allocator pool in between)."""

    def __init__(self, engine_id: str, nbytes: int) -> None:
        import torch

        self.engine_id = engine_id
        self.nbytes = nbytes
        self._memory = mmap.mmap(-1, nbytes)
        self.kv: torch.Tensor | None = torch.frombuffer(self._memory, dtype=torch.uint8)
        self.stored_tokens = 0

    def store(self, payload: bytes, tokens: int) -> int:
        import torch

        chunk = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        assert self.kv is not None, "store after close"
        for offset in range(0, self.nbytes, chunk.numel()):
            n = min(chunk.numel(), self.nbytes - offset)
            self.kv[offset : offset + n] = chunk[:n]
        self.stored_tokens += tokens
        return self.nbytes

    def close(self) -> None:
        self.kv = None
        self._memory.close()


def live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process, found by walking the
    garbage collector's objects (the runtime's view, not the engine's bookkeeping)."""
    import gc

    import torch

    seen: dict[tuple[str, int], int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            if storage.device.type == "meta":
                continue
            key = (str(storage.device), storage.data_ptr())
            seen[key] = max(seen.get(key, 0), storage.nbytes())
    return sum(seen.values())
