"""The S3 server vllm-obj's object tier writes to, and that server as the REMOTE_TIER facet.

One driver process in the s3-moto environment (drivers/s3_store_driver.py) runs moto's S3
server and the suite's boto3 client: what the bucket holds, read and damaged, is read over S3,
never through vLLM. The server outlives vLLM's restarts (it is the remote tier); `down` stops it
under a running vLLM. moto is the suite's stand-in for an S3 service: vLLM reaches it through
NIXL's OBJ plugin (the AWS C++ SDK) as it would reach S3.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from kvconform import envs
from kvconform.contract import RemoteStore
from kvconform.errors import EngineError
from kvconform.kit.drivers import DriverProcess
from kvconform.processes import TeardownReport, free_port

DRIVER = Path(__file__).resolve().parent / "drivers" / "s3_store_driver.py"
BUCKET = "kvconform-kv"
KEY_PREFIX = "kvc"  # the obj tier's `prefix`: its keys are kvc/<model root>/<shard>/<hash>.bin
S3_ENV_SPEC = "s3-moto"
ACCESS_KEY, SECRET_KEY, REGION = "kvconform", "kvconform-secret", "us-east-1"  # as the driver's


class S3Server:
    """moto's S3 server on a free port of 127.0.0.1, with the bucket created."""

    def __init__(self, engine: str, workdir: Path) -> None:
        self.port = free_port()
        self.driver = DriverProcess(
            engine,
            envs.find(S3_ENV_SPEC).python,
            DRIVER,
            workdir / "s3-server.log",
            env={"KVCONFORM_S3_PORT": str(self.port), "KVCONFORM_S3_BUCKET": BUCKET},
            start_timeout_s=60,
        )

    def alive(self) -> bool:
        return self.driver.process.alive()

    def store_config(self) -> dict[str, str]:
        """The obj tier's store_config (vllm/v1/kv_offload/tiering/obj/config.py ObjStoreConfig)."""
        return {
            "bucket": BUCKET,
            "endpoint_override": f"127.0.0.1:{self.port}",
            "scheme": "http",
            "access_key": ACCESS_KEY,
            "secret_key": SECRET_KEY,
            "region": REGION,
        }

    def call(self, op: str, **args: object) -> object:
        return self.driver.call(op, timeout_s=60, **args)

    def pids(self) -> list[int]:
        return self.driver.pids()

    def log_tail(self, lines: int = 40) -> str:
        return self.driver.log_tail(lines)

    def stop(self) -> TeardownReport:
        return self.driver.close()


class S3Owner(Protocol):
    """What the store needs of the adapter that runs the S3 server beside vLLM."""

    @property
    def name(self) -> str: ...

    def running_s3(self) -> S3Server: ...
    def ensure_s3(self) -> S3Server: ...
    def stop_remote(self) -> TeardownReport: ...
    def stop(self) -> list[TeardownReport]: ...


class S3Store(RemoteStore):
    """The adapter's S3 bucket, alive or not: every call finds the server that runs now.

    An object store has no per-object overhead, capacity, write pause or refusal count to read:
    those are the Redis-shaped measures of the checks that also require TIERED_STORE_METRICS,
    which vllm-obj does not declare (vLLM counts tier bytes, not objects), so nothing asks."""

    def __init__(self, adapter: S3Owner) -> None:
        self.adapter = adapter

    def entries(self) -> dict[str, int]:
        """The obj tier's objects -> their sizes, by the bucket's own listing."""
        listing = self.adapter.running_s3().call("listing", prefix=f"{KEY_PREFIX}/")
        assert isinstance(listing, dict)
        return {str(key): int(size) for key, size in listing.items()}

    def objects_total(self) -> int:
        listing = self.adapter.running_s3().call("listing")
        assert isinstance(listing, dict)
        return len(listing)

    def read(self, key: str) -> bytes:
        return bytes.fromhex(str(self.adapter.running_s3().call("read", key=key)))

    def write(self, key: str, data: bytes) -> None:
        self.adapter.running_s3().call("write", key=key, data_hex=data.hex())

    def wipe(self) -> None:
        """Every object deleted, with vLLM stopped."""
        self.adapter.stop()
        self.adapter.ensure_s3().call("wipe")

    def down(self) -> TeardownReport:
        return self.adapter.stop_remote()

    def memory_usage(self, key: str) -> int:
        raise NotImplementedError("an S3 store reports no per-object overhead")

    def capacity_bytes(self) -> int:
        raise NotImplementedError("vLLM's obj tier has no capacity: it never evicts (obj/manager.py)")

    def pause_writes(self, seconds: float) -> None:
        raise NotImplementedError("moto's S3 server cannot hold writes")

    def refuse_writes(self, refuse: bool) -> None:
        raise NotImplementedError("moto's S3 server cannot refuse writes")

    def refused_writes(self) -> int:
        raise NotImplementedError("moto's S3 server counts no refused writes")


def require_running(server: S3Server | None, engine: str) -> S3Server:
    if server is None or not server.alive():
        raise EngineError(engine, "the S3 server of the obj tier is not running")
    return server
