"""Memory probes of an engine's own processes: NVML on GPUs, RSS/PSS and /dev/shm on hosts.

Device-wide GPU numbers include other tenants, so GPU memory is attributed per process
(nvmlDeviceGetComputeRunningProcesses) to the engine's process tree; device used is kept as
context. Without a GPU, NVML samples are *unavailable with a reason*, never zero.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from kvconform.errors import EngineError, KvconformError

SHM_DIR = Path("/dev/shm")


@dataclass
class GpuSample:
    device_used: int
    device_total: int
    process_used: int  # bytes held by the engine's processes, summed over devices
    devices: list[str] = field(default_factory=list)


@dataclass
class MemorySample:
    t: float
    rss: int
    pss: int
    uss: int
    shm_bytes: int  # size of /dev/shm files the tree maps or holds open
    shm_files: int
    processes: int
    threads: int = 0  # OS threads of the live processes: a thread kept per instance keeps its stack and arena
    gpu: GpuSample | None = None
    gpu_unavailable: str | None = None

    def get(self, measure: str) -> int:
        if measure.startswith("gpu_"):
            if self.gpu is None:
                raise LookupError(f"no GPU sample: {self.gpu_unavailable}")
            return int(getattr(self.gpu, measure[4:]))
        return int(getattr(self, measure))


@dataclass(frozen=True)
class MemoryMeasure:
    """One memory quantity that must return to baseline. Exact measures (mapped or leftover
    bytes, process counts, per-process GPU memory) are judged against a fraction of a KV
    block; noisy ones (RSS, PSS) against bounds above their measured noise."""

    value: float
    exact: bool
    unit: str = "bytes"
    # Whether it moves with the KV the engine holds (the long session judges only those); a
    # count of loaded model bytes returns to baseline on release but stands still per turn.
    holds_kv: bool = True


def gpu_measures(sample: MemorySample) -> dict[str, MemoryMeasure]:
    """Per-process GPU memory of the engine (exact), when NVML sees a GPU; else nothing."""
    if sample.gpu is None:
        return {}
    return {"gpu_engine_process_bytes": MemoryMeasure(sample.gpu.process_used, exact=True)}


class MemoryProbeError(KvconformError):
    """A memory probe that worked failed while sampling: the machine's fault, named."""


class NvmlProbe:
    """nvidia-ml-py, initialised once; `reason` says why it is unavailable."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._handles: list[object] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            self._nvml = pynvml
            if not self._handles:
                self.reason = "NVML initialised but reports 0 GPUs"
        except Exception as exc:
            self.reason = f"NVML unavailable: {type(exc).__name__}: {exc}".strip()

    @property
    def available(self) -> bool:
        return self.reason is None

    def describe(self) -> str:
        """The GPUs and driver (every record's platform): never raises, NVML failing mid-run
        included, so a lost GPU cannot stop the records being written."""
        if not self.available:
            return "host"
        nv = self._nvml
        try:
            names = [_text(nv.nvmlDeviceGetName(h)) for h in self._handles]
            driver = _text(nv.nvmlSystemGetDriverVersion())
        except Exception as exc:
            return f"{len(self._handles)} GPU(s) (NVML failed: {type(exc).__name__}: {exc})"
        return f"{', '.join(names)} (driver {driver})"

    def sample(self, pids: Iterable[int]) -> GpuSample:
        nv = self._nvml
        wanted = set(pids)
        used = total = by_process = 0
        for handle in self._handles:
            info = nv.nvmlDeviceGetMemoryInfo(handle)
            used += int(info.used)
            total += int(info.total)
            for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid in wanted and proc.usedGpuMemory is not None:
                    by_process += int(proc.usedGpuMemory)
        return GpuSample(used, total, by_process, [str(h) for h in self._handles])


_NVML: NvmlProbe | None = None


def nvml() -> NvmlProbe:
    global _NVML
    if _NVML is None:
        _NVML = NvmlProbe()
    return _NVML


def shm_held_by(pids: Iterable[int]) -> dict[str, int]:
    """/dev/shm files these processes map or hold open, with the bytes held.

    Mapped bytes come from /proc/PID/maps address ranges, so a segment that was unlinked but
    is still mapped (the classic leak: "released" KV still resident) is counted too.
    """
    held: dict[str, int] = {}
    for pid in pids:
        mapped: dict[str, int] = {}
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            for line in maps:
                idx = line.find("/dev/shm/")
                if idx < 0:
                    continue
                name = line[idx + 9 :].rstrip("\n").removesuffix(" (deleted)")
                start, end = line.split(" ", 1)[0].split("-")
                mapped[name] = mapped.get(name, 0) + int(end, 16) - int(start, 16)
        with contextlib.suppress(OSError):
            for fd in os.scandir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(fd.path)
                    if target.startswith("/dev/shm/"):
                        name = target[9:].removesuffix(" (deleted)")
                        mapped[name] = max(mapped.get(name, 0), os.stat(fd.path).st_size)
        for name, size in mapped.items():
            held[name] = max(held.get(name, 0), size)
    return held


def threads_measure(sample: MemorySample) -> MemoryMeasure:
    """The OS threads of the sampled processes, a count that returns to baseline when an
    instance's threads end with it (each kept thread holds a stack and a malloc arena)."""
    return MemoryMeasure(sample.threads, exact=True, unit="threads", holds_kv=False)


def sample_processes(pids: Iterable[int], with_pss: bool = True) -> MemorySample:
    pids = list(pids)
    rss = pss = uss = alive = threads = 0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            threads += proc.num_threads()
            if with_pss:
                full = proc.memory_full_info()
                rss += full.rss
                pss += getattr(full, "pss", 0)
                uss += full.uss
            else:
                rss += proc.memory_info().rss
            alive += 1
        except psutil.Error:
            continue
    shm = shm_held_by(pids)
    probe = nvml()
    sample = MemorySample(
        t=time.time(),
        rss=rss,
        pss=pss,
        uss=uss,
        shm_bytes=sum(shm.values()),
        shm_files=len(shm),
        processes=alive,
        threads=threads,
    )
    if probe.available:
        try:
            sample.gpu = probe.sample(pids)
        except Exception as exc:  # NVML calls fail when the GPU falls off the bus, the driver resets
            raise MemoryProbeError(
                f"NVML failed mid-sample ({type(exc).__name__}: {exc}) after initialising fine on "
                f"{probe.describe()}: this check's GPU memory numbers cannot be measured"
            ) from None
    else:
        sample.gpu_unavailable = probe.reason
    return sample


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def gpu_reclaim_measures(
    probe: NvmlProbe, pids: list[int], holds_cuda: bool, device_before: int | None, engine: str
) -> dict[str, MemoryMeasure]:
    """NVML measures of an engine's process tree, when NVML sees a GPU (else none):
    `gpu_engine_process_bytes` (per-process used memory of `pids`, exact) and
    `gpu_device_used_delta_bytes` (device-wide used now minus before the first start: context,
    other tenants included, so not exact). An engine known to hold CUDA memory (`holds_cuda`:
    a running CUDA build) that NVML attributes 0 bytes to is an EngineError, never a pass:
    inside containers NVML reports host PIDs that differ from the container's.
    UNVERIFIED on a GPU: unit-tested with NVML mocked."""
    if not probe.available:
        return {}
    sample = probe.sample(pids)
    if holds_cuda and pids and sample.process_used == 0:
        raise EngineError(
            engine,
            f"NVML attributes 0 bytes of GPU memory to the engine's {len(pids)} processes "
            f"({', '.join(map(str, pids[:8]))}) though it runs on CUDA (device used: "
            f"{sample.device_used} bytes): PID namespaces differ (run with --pid=host) or NVML "
            "cannot see per-process memory; the per-process measure would be a false pass",
        )
    measures = {"gpu_engine_process_bytes": MemoryMeasure(sample.process_used, exact=True)}
    if device_before is not None:
        measures["gpu_device_used_delta_bytes"] = MemoryMeasure(
            sample.device_used - device_before, exact=False
        )
    return measures
