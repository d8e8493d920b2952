"""What each capability needs of an adapter: contract methods it must override and facets it
must provide (@provides). An adapter that declares a capability without them is refused at
registration, naming both (a missing one would otherwise show as NotImplementedError in the
middle of a check).

Only methods whose base version is a stub are listed: the rest have a working default.
"""

from __future__ import annotations

from kvconform.contract.adapter import EngineAdapter, class_provides
from kvconform.contract.capabilities import Capability as C
from kvconform.contract.facets import (
    ActiveBlockTracker,
    CacheReset,
    DisaggregatedServing,
    InstanceChurn,
    KvEvents,
    KvPool,
    KvRouter,
    KvTransfer,
    OffloadTier,
    PersistentTier,
    RadixCacheModel,
    ReclaimProbe,
    ReleaseGuard,
    RemoteStore,
    RouterIndex,
    SaltedPrompts,
    StreamAborts,
    TraceReplay,
)

# A method by name (the adapter's own or its inherited facet's), or a facet by its type.
Need = str | type
# Where the stubs live: a method still from here (or a module below) is not provided.
STUB_MODULES = ("kvconform.contract.adapter", "kvconform.contract.facets")

NEEDS: dict[C, tuple[Need, ...]] = {
    C.PREFIX_CACHE: ("serve_prompt",),
    C.PREFIX_HIT_COUNTERS: ("metrics",),
    C.RESET_PREFIX_CACHE: (CacheReset,),
    C.PERSISTENT_PREFIX: (PersistentTier,),
    C.CORRUPT_PERSISTED: (PersistentTier,),
    C.FORCED_EVICTION: (KvPool,),
    C.CACHE_SALT: (SaltedPrompts,),
    C.HOST_MEMORY: ("engine_pids",),
    C.KV_EVENTS: (KvEvents, KvPool),  # the ledger is judged against the pool
    C.INSTANCE_CHURN: (InstanceChurn, ReclaimProbe),
    C.INSTANCE_REGISTRY: (InstanceChurn,),
    C.LONG_SESSION: (KvPool, "kv_pool_bytes"),
    C.OFFLOAD_GAUGES: (OffloadTier, "metrics"),
    C.OFFLOAD_STORE_FAILURE: (OffloadTier, "metrics"),
    C.OFFLOAD_HOST_HITS: (OffloadTier, "metrics"),
    C.OFFLOAD_STORE_THRESHOLD: (OffloadTier, "metrics"),
    # KvPool too, but only where the engine reports an L1 usage ratio to judge it by
    C.TIERED_STORE_METRICS: ("metrics", PersistentTier),
    C.BLOCK_POOL_STATS: (KvPool, "block_pool_stats"),
    C.TRANSFER_ACCOUNTING: (KvTransfer,),
    C.PAGE_INDEX: (KvTransfer,),
    C.RELEASE_GUARD: (ReleaseGuard,),
    C.ABORT_REQUESTS: (StreamAborts,),
    C.BLOCK_TRACKER: (ActiveBlockTracker,),
    C.RADIX_INDEX: (RouterIndex,),
    C.RADIX_CACHE_MODEL: (RadixCacheModel,),
    C.ROUTER_PREDICTION: (KvRouter,),
    C.TRACE_REPLAY: (TraceReplay,),
    C.DISAGG_SERVING: (DisaggregatedServing,),
    C.REMOTE_TIER: (RemoteStore,),
}


def need_name(need: Need) -> str:
    return need if isinstance(need, str) else f"the {need.__name__} facet"


def provided(cls: type[EngineAdapter], need: Need) -> bool:
    if isinstance(need, str):
        method = getattr(cls, need, None)
        module = str(getattr(method, "__module__", ""))
        return method is not None and not any(module == m or module.startswith(f"{m}.") for m in STUB_MODULES)
    return class_provides(cls, need)


def missing_methods(cls: type[EngineAdapter]) -> dict[C, list[str]]:
    """Per declared capability, what it needs that `cls` leaves as the contract's stub or does
    not provide."""
    missing: dict[C, list[str]] = {}
    for capability in sorted(cls.capabilities):
        absent = [need_name(n) for n in NEEDS.get(capability, ()) if not provided(cls, n)]
        if absent:
            missing[capability] = absent
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
