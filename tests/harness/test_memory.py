"""Memory probes: NVML with and without a GPU (a fake pynvml stands in for one), per-process
attribution, and /dev/shm accounting of mapped-then-unlinked segments."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import time
import types
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconform import memory
from kvconform.memory import (
    MemorySample,
    NvmlProbe,
    gpu_measures,
    sample_processes,
    shm_held_by,
    threads_measure,
)

MiB = 1 << 20


class FakeNvmlError(Exception):
    pass


def fake_pynvml(devices: list[dict], fail_init: bool = False) -> types.ModuleType:
    """A pynvml stand-in: devices = [{"used", "total", "name", "procs": [(pid, bytes|None)]}]."""
    nv = types.ModuleType("pynvml")

    def init() -> None:
        if fail_init:
            raise FakeNvmlError("Driver Not Loaded")

    nv.nvmlInit = init  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = lambda: len(devices)  # type: ignore[attr-defined]
    nv.nvmlDeviceGetHandleByIndex = lambda i: f"dev{i}"  # type: ignore[attr-defined]

    def dev(handle: str) -> dict:
        return devices[int(handle[3:])]

    nv.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        used=dev(h)["used"], total=dev(h)["total"], free=dev(h)["total"] - dev(h)["used"]
    )
    nv.nvmlDeviceGetComputeRunningProcesses = lambda h: [  # type: ignore[attr-defined]
        types.SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in dev(h)["procs"]
    ]
    nv.nvmlDeviceGetName = lambda h: dev(h)["name"].encode()  # type: ignore[attr-defined]
    nv.nvmlSystemGetDriverVersion = lambda: b"550.54.15"  # type: ignore[attr-defined]
    return nv


@pytest.fixture
def use_probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    """use_probe.install(pynvml_or_None) -> a fresh NvmlProbe that sample_processes() uses."""
    state = types.SimpleNamespace()

    def install(module: types.ModuleType | None) -> NvmlProbe:
        monkeypatch.setitem(sys.modules, "pynvml", module)  # None: "import pynvml" fails
        probe = NvmlProbe()
        monkeypatch.setattr(memory, "_NVML", probe)
        return probe

    state.install = install
    yield state


def test_no_nvml_module(use_probe: types.SimpleNamespace) -> None:
    probe = use_probe.install(None)
    assert not probe.available
    assert probe.reason is not None and "ModuleNotFoundError" in probe.reason
    assert probe.describe() == "host"


def test_no_gpu_sample_is_unavailable_never_zero(use_probe: types.SimpleNamespace) -> None:
    probe = use_probe.install(fake_pynvml([], fail_init=True))
    assert probe.reason == "NVML unavailable: FakeNvmlError: Driver Not Loaded"
    sample = sample_processes([os.getpid()])
    assert sample.gpu is None
    assert sample.gpu_unavailable == probe.reason
    assert gpu_measures(sample) == {}
    with pytest.raises(LookupError, match="Driver Not Loaded"):
        sample.get("gpu_process_used")
    assert sample.processes == 1 and sample.rss > 0
    assert sample.get("rss") == sample.rss


def test_zero_devices_is_unavailable(use_probe: types.SimpleNamespace) -> None:
    probe = use_probe.install(fake_pynvml([]))
    assert probe.reason == "NVML initialised but reports 0 GPUs"
    assert sample_processes([os.getpid()], with_pss=False).gpu is None


def test_this_machine_without_a_gpu_reports_why() -> None:
    """The real probe on this machine: either a GPU is seen, or a reason says why not."""
    probe = NvmlProbe()
    if probe.available:
        sample = probe.sample([os.getpid()])
        assert sample.device_total > 0 and sample.process_used >= 0
        assert "driver" in probe.describe()
    else:
        assert probe.reason and probe.describe() == "host"


def test_gpu_memory_is_attributed_to_the_given_pids_only(use_probe: types.SimpleNamespace) -> None:
    me, worker, stranger = os.getpid(), 4_000_001, 4_000_002
    devices = [
        {
            "name": "H100",
            "used": 50 * MiB,
            "total": 80 * MiB,
            "procs": [(me, 10 * MiB), (stranger, 30 * MiB)],
        },
        {"name": "H100", "used": 7 * MiB, "total": 80 * MiB, "procs": [(worker, 5 * MiB), (me, None)]},
    ]
    probe = use_probe.install(fake_pynvml(devices))
    assert probe.available
    assert probe.describe() == "H100, H100 (driver 550.54.15)"

    gpu = probe.sample([me, worker])
    assert gpu.process_used == 15 * MiB  # the other tenant's 30 MiB is not ours; None counts 0
    assert (gpu.device_used, gpu.device_total) == (57 * MiB, 160 * MiB)
    assert probe.sample([stranger]).process_used == 30 * MiB
    assert probe.sample([]).process_used == 0

    sample = sample_processes([me])
    assert sample.gpu is not None and sample.gpu_unavailable is None
    assert sample.gpu.process_used == 10 * MiB
    assert sample.get("gpu_process_used") == 10 * MiB
    measures = gpu_measures(sample)
    assert measures["gpu_engine_process_bytes"].value == 10 * MiB
    assert measures["gpu_engine_process_bytes"].exact


@pytest.fixture
def shm_segment() -> Iterator[tuple[str, Path]]:
    name = f"kvconform-selftest-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    path = Path("/dev/shm") / name
    yield name, path
    path.unlink(missing_ok=True)


def test_shm_held_by_counts_mapped_then_unlinked(shm_segment: tuple[str, Path]) -> None:
    """The leak case: the file is gone from /dev/shm, the memory is still mapped."""
    name, path = shm_segment
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 2 * MiB)
        segment = mmap.mmap(fd, 2 * MiB)
    finally:
        os.close(fd)
    try:
        segment[:4] = b"kvkv"
        assert shm_held_by([os.getpid()]).get(name) == 2 * MiB
        path.unlink()
        assert not path.exists()
        assert shm_held_by([os.getpid()]).get(name) == 2 * MiB, "unlinked but mapped still counts"
        sample = sample_processes([os.getpid()], with_pss=False)
        assert sample.shm_bytes >= 2 * MiB and sample.shm_files >= 1
    finally:
        segment.close()
    assert name not in shm_held_by([os.getpid()]), "unmapped: no longer held"


def test_shm_held_open_without_mapping(shm_segment: tuple[str, Path]) -> None:
    name, path = shm_segment
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, MiB)
        path.unlink()
        assert shm_held_by([os.getpid()]).get(name) == MiB
    finally:
        os.close(fd)
    assert name not in shm_held_by([os.getpid()])


def test_shm_held_by_ignores_dead_pids() -> None:
    assert shm_held_by([4_000_003]) == {}
    sample = sample_processes([4_000_003])
    assert sample.processes == 0 and sample.rss == 0


def test_periodic_sampler_keeps_a_steady_rate_and_collects_errors() -> None:
    from kvconform.sampling import PeriodicSampler

    class Probe(PeriodicSampler):
        def __init__(self) -> None:
            super().__init__(0.02)
            self.samples: list[MemorySample] = []

        def sample(self) -> None:
            if len(self.samples) == 1 and not self.errors:
                raise RuntimeError("one bad sample")
            self.samples.append(sample_processes([os.getpid()], with_pss=False))

    with Probe() as sampler:
        deadline = time.monotonic() + 5
        while len(sampler.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert len(sampler.samples) >= 3
    assert sampler.errors == ["RuntimeError: one bad sample"]


def test_threads_are_counted_and_a_kept_thread_shows() -> None:
    # a process of our own: this test process's thread count moves with other tests' threads
    code = (
        "import threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        measure = threads_measure(sample_processes([proc.pid], with_pss=False))
    finally:
        proc.kill()
        proc.wait()
    assert measure.value == 4, "the main thread and the three it started"
    assert measure.exact and measure.unit == "threads" and not measure.holds_kv
