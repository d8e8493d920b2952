"""The S3 server of engine vllm-obj: moto's own server in the s3-moto environment, read and
written with boto3 in the same driver process, stopped with nothing left. The engine itself
(vLLM's obj tier against it, across a restart) is judged by the suites (`--engine vllm-obj`)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from kvconform.adapters.vllm_obj.s3_store import KEY_PREFIX, S3Server, S3Store
from kvconform.errors import DriverError, EngineError
from kvconform.processes import TeardownReport
from tests.system.engine_envs import skip_unless_built

pytestmark = skip_unless_built("s3-moto")


class Owner:
    """The adapter's side of S3Store, with no vLLM: stop() stops nothing."""

    name = "vllm-obj"

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.s3: S3Server | None = None
        self.stopped = 0

    def ensure_s3(self) -> S3Server:
        if self.s3 is None:
            self.s3 = S3Server(self.name, self.workdir)
        return self.s3

    def running_s3(self) -> S3Server:
        if self.s3 is None or not self.s3.alive():
            raise EngineError(self.name, "the S3 server of the obj tier is not running")
        return self.s3

    def stop_remote(self) -> TeardownReport:
        assert self.s3 is not None
        report, self.s3 = self.s3.stop(), None
        return report

    def stop(self) -> list[TeardownReport]:
        self.stopped += 1
        return []


def test_s3_store_round_trip_wipe_and_clean_stop(tmp_path: Path) -> None:
    owner = Owner(tmp_path)
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
    store.wipe()
    assert owner.stopped == 1 and store.objects_total() == 0
    with pytest.raises(NotImplementedError):
        store.capacity_bytes()
    report = store.down()
    assert report.clean, report.describe()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
    with pytest.raises(EngineError, match="not running"):
        store.entries()


def test_a_failed_s3_call_names_the_engine_and_the_key(tmp_path: Path) -> None:
    owner = Owner(tmp_path)
    store = S3Store(owner)
    owner.ensure_s3()
    try:
        with pytest.raises(DriverError, match="NoSuchKey") as caught:
            store.read(f"{KEY_PREFIX}/absent.bin")
        assert "vllm-obj" in str(caught.value)
    finally:
        assert store.down().clean
