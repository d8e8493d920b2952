"""The S3 server of engine vllm-obj, through the adapter that owns it (no vLLM launched):
moto's own server in the s3-moto environment, read and written with boto3 in the same driver
process, stopped with nothing left. The engine itself (vLLM's obj tier against it, across a
restart) is judged by the suites (`--engine vllm-obj`)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from kvconform.adapters.vllm_obj.adapter import VllmObjAdapter
from kvconform.adapters.vllm_obj.s3_store import KEY_PREFIX, S3Store
from kvconform.contract import AdapterContext
from kvconform.errors import DriverError, EngineError
from tests.system.engine_envs import skip_unless_built

pytestmark = skip_unless_built("s3-moto")


def adapter(workdir: Path) -> VllmObjAdapter:
    """The real adapter, with no vLLM launched: its stop() stops nothing, its S3 server runs."""
    return VllmObjAdapter(AdapterContext(workdir=workdir))


def test_s3_store_round_trip_wipe_and_clean_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    owner = adapter(tmp_path)
    stops: list[int] = []
    real_stop = owner.stop
    monkeypatch.setattr(owner, "stop", lambda: stops.append(1) or real_stop())
    store = S3Store(owner)
    server = owner.ensure_s3()
    pids = server.pids()
    key = f"{KEY_PREFIX}/model_r0/ab/cd_g0/abcd.bin"
    store.write(key, b"\x00\xff" * 100)
    store.write("foreign/object", b"x")
    assert store.entries() == {key: 200}  # only the tier's prefix
    assert store.objects_total() == 2
    assert store.read(key) == b"\x00\xff" * 100
    store.write(key, store.read(key)[:50])  # damage in place, as the suite does
    assert store.entries() == {key: 50}
    store.wipe()  # vLLM stopped (none runs), the bucket emptied
    assert stops == [1] and store.objects_total() == 0
    with pytest.raises(NotImplementedError):
        store.capacity_bytes()
    report = store.down()
    assert report.clean, report.describe()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    with pytest.raises(EngineError, match="not running"):
        store.entries()


def test_a_failed_s3_call_names_the_engine_and_the_key(tmp_path: Path) -> None:
    owner = adapter(tmp_path)
    store = S3Store(owner)
    owner.ensure_s3()
    try:
        with pytest.raises(DriverError, match="NoSuchKey") as caught:
            store.read(f"{KEY_PREFIX}/absent.bin")
        assert "vllm-obj" in str(caught.value)
    finally:
        assert store.down().clean
