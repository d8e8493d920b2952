"""The OffloadTier most engines have: waits and failures read from the engine's own offload
counters (the store-byte counter, a failed-store counter), a host block at the model's KV size."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvconform.contract import OffloadTier, deployed_block_size, metric_delta, read_metric
from kvconform.metrics import MetricSnapshot

if TYPE_CHECKING:
    from kvconform.contract import EngineAdapter


class MetricOffloadTier(OffloadTier):
    def __init__(self, engine: EngineAdapter) -> None:
        self.engine = engine

    def wait_idle(self, timeout_s: float = 15.0, quiet_s: float = 1.0) -> None:
        """Until the store byte counter is still for `quiet_s`; never waits on the gauges
        themselves, which are under test."""
        deadline = time.monotonic() + timeout_s
        last, still_since = None, time.monotonic()
        while time.monotonic() < deadline:
            value = read_metric(self.engine, "offload_store_bytes", self.engine.metrics())
            if value != last:
                last, still_since = value, time.monotonic()
            elif time.monotonic() - still_since >= quiet_s:
                return
            time.sleep(0.1)

    def block_bytes(self) -> int:
        return self.engine.deployment.model.block_bytes(deployed_block_size(self.engine))

    def failed_stores(self, before: MetricSnapshot, after: MetricSnapshot) -> float:
        return metric_delta(self.engine, "offload_failed_stores", before, after)
