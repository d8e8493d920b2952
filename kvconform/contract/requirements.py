"""Which contract methods each capability needs: an adapter that declares a capability must
provide them, or registration refuses it, naming both (a missing method would otherwise show
as NotImplementedError in the middle of a check).

Only methods whose base version is a stub are listed: the rest have a working default.
"""

from __future__ import annotations

from kvconform.contract.adapter import EngineAdapter
from kvconform.contract.capabilities import Capability as C

METHODS: dict[C, tuple[str, ...]] = {
    C.PREFIX_CACHE: ("serve_prompt",),
    C.PREFIX_HIT_COUNTERS: ("metrics",),
    C.RESET_PREFIX_CACHE: ("reset_prefix_cache",),
    C.PERSISTENT_PREFIX: ("persistent_tier",),
    C.CORRUPT_PERSISTED: ("persistent_tier",),
    C.FORCED_EVICTION: ("cache_capacity_tokens",),
    C.CACHE_SALT: ("serve_salted",),
    C.HOST_MEMORY: ("engine_pids",),
    C.INSTANCE_CHURN: ("instance_churn", "reclaim_probe"),
    C.INSTANCE_REGISTRY: ("instance_churn",),
    C.LONG_SESSION: ("kv_pool_bytes",),
    C.OFFLOAD_GAUGES: ("offload_tier", "metrics"),
    C.OFFLOAD_STORE_FAILURE: ("offload_tier", "metrics"),
    C.OFFLOAD_HOST_HITS: ("offload_tier", "metrics"),
    C.OFFLOAD_STORE_THRESHOLD: ("offload_tier", "metrics"),
    # l1_capacity_bytes too, but only where the engine reports an L1 usage ratio to judge it by
    C.TIERED_STORE_METRICS: ("metrics", "persistent_tier"),
    C.BLOCK_POOL_STATS: ("block_pool_stats",),
    C.TRANSFER_ACCOUNTING: ("kv_transfer",),
    C.PAGE_INDEX: ("kv_transfer",),
    C.RELEASE_GUARD: ("release_twice",),
    C.BLOCK_TRACKER: ("block_tracker",),
    C.RADIX_INDEX: ("router_index",),
    C.RADIX_CACHE_MODEL: ("radix_cache",),
    C.ROUTER_PREDICTION: ("serve_routed",),
    C.TRACE_REPLAY: ("trace_replay",),
    C.DISAGG_SERVING: ("serve_disaggregated",),
    C.REMOTE_TIER: ("remote_tier",),
}


def missing_methods(cls: type[EngineAdapter]) -> dict[C, list[str]]:
    """Per declared capability, the methods it needs that `cls` leaves as the contract's stub."""
    missing: dict[C, list[str]] = {}
    for capability in sorted(cls.capabilities):
        stubs = [m for m in METHODS.get(capability, ()) if getattr(cls, m) is getattr(EngineAdapter, m)]
        if stubs:
            missing[capability] = stubs
    return missing


def describe_missing(name: str, cls: type[EngineAdapter]) -> str | None:
    """Why registration refuses `cls`, or None if every declared capability is provided."""
    missing = missing_methods(cls)
    if not missing:
        return None
    parts = [f"{cap.value} needs {', '.join(methods)}" for cap, methods in missing.items()]
    return (
        f"engine {name!r}: {cls.__module__}.{cls.__qualname__} declares capabilities it does not "
        f"provide: {'; '.join(parts)} (implement them, or drop the capability)"
    )
