"""GPU memory reclaim, measured through NVML (run by ci/gpu-check.sh on a GPU machine).

1. The NVML probe sees known CUDA allocations, attributed to the allocating process (the
   baseline is taken after the CUDA context exists: measured on an H200, the context alone
   is about 610 MiB of the process's figure).
2. CUDA-IPC churn (the LMCache #4015 scenario): an exporter process allocates KV tensors and
   shares them over CUDA IPC; this process (the "engine") imports each one and either
   releases it or holds it. Releasing is enough for the exporter to reuse its memory:
   torch.cuda.ipc_collect() acts on the exporter's own sent-tensor limbo (torch/csrc/
   CudaIPCTypes.cpp), so an importer calling it changes nothing (measured on an H200 with
   torch 2.11: flat either way). An importer that holds its imports grows device memory by one
   KV allocation per cycle. The same verdict as memory_reclaim (Theil-Sen slope vs half an
   allocation) must tell release from hold.

Needs only torch, nvidia-ml-py, psutil, scipy and pytest (what the GPU machine has): run with
`python -m pytest --noconftest tests/gpu`. Skips with the reason where no GPU is visible.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device visible to torch", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

from kvconform.memory import nvml  # noqa: E402
from kvconform.oracles import theil_sen  # noqa: E402

MiB = 2**20
KV_BYTES = 256 * MiB
CYCLES = 6
OUT = Path(os.environ.get("KVCONFORM_GPU_OUT", "results/gpu"))


def settle_device_used(samples: int = 5) -> int:
    probe = nvml()
    values = []
    for _ in range(samples):
        torch.cuda.synchronize()
        values.append(probe.sample([]).device_used)
        time.sleep(0.05)
    return min(values)


def write(name: str, data: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{name}.json").write_text(json.dumps(data, indent=1))


def test_nvml_sees_known_allocation() -> None:
    probe = nvml()
    assert probe.available, probe.reason
    pid = os.getpid()
    torch.zeros(1, device="cuda")  # the context first: it is not the allocation under test
    torch.cuda.synchronize()
    before = probe.sample([pid])
    block = torch.empty(KV_BYTES, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    during = probe.sample([pid])
    del block
    torch.cuda.empty_cache()
    after = probe.sample([pid])
    other = probe.sample([pid + 10_000_000])  # a pid that is not ours sees none of it
    write(
        "nvml_known_allocation",
        {
            "platform": probe.describe(),
            "allocated": KV_BYTES,
            "process_before": before.process_used,
            "process_during": during.process_used,
            "process_after": after.process_used,
            "device_before": before.device_used,
            "device_during": during.device_used,
            "device_after": after.device_used,
            "other_pid_during": other.process_used,
        },
    )
    assert during.process_used - before.process_used >= KV_BYTES
    assert after.process_used <= before.process_used + 64 * MiB
    assert other.process_used == 0


def exporter(conn, cycles: int, nbytes: int) -> None:  # runs in a spawned process
    import torch

    for cycle in range(cycles):
        kv = torch.full((nbytes,), cycle % 255, dtype=torch.uint8, device="cuda")
        conn.send(kv)  # CUDA IPC handle
        del kv
        conn.recv()  # the importer released its reference
    conn.send(None)
    conn.recv()


def churn(mode: str) -> dict:
    """mode: release (drop each import), collect (drop, then ipc_collect here), hold (keep)."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=exporter, args=(theirs, CYCLES, KV_BYTES))
    proc.start()
    held = []
    per_cycle, importer, exporter_bytes = [], [], []
    probe = nvml()
    try:
        while True:
            kv = ours.recv()
            if kv is None:
                break
            assert int(kv[0]) == len(per_cycle) % 255  # the KV is really readable here
            if mode == "hold":
                held.append(kv)
            del kv
            if mode == "collect":
                torch.cuda.ipc_collect()
            ours.send(True)
            time.sleep(0.2)
            per_cycle.append(settle_device_used())
            importer.append(probe.sample([os.getpid()]).process_used)
            exporter_bytes.append(probe.sample([proc.pid]).process_used)
        ours.send(True)
    finally:
        held.clear()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
    trend = theil_sen(per_cycle)
    return {
        "mode": mode,
        "device_used_per_cycle": per_cycle,
        "importer_process_per_cycle": importer,
        "exporter_process_per_cycle": exporter_bytes,
        "slope": trend.slope,
        "final_delta": per_cycle[-1] - per_cycle[0],
    }


def test_cuda_ipc_churn_release_vs_hold() -> None:
    bound = KV_BYTES / 2  # the reclaim verdict's "half a block": here half an allocation
    runs = {mode: churn(mode) for mode in ("release", "collect", "hold")}
    write(
        "cuda_ipc_churn",
        {"kv_bytes": KV_BYTES, "cycles": CYCLES, "slope_bound": bound, **runs, "platform": nvml().describe()},
    )
    for mode in ("release", "collect"):
        assert runs[mode]["slope"] <= bound, f"{mode}: grew with every import dropped: {runs[mode]}"
    assert runs["hold"]["slope"] > bound, f"hold: the check saw no growth from held imports: {runs['hold']}"
