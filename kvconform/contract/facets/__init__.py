"""Capability facets: what a suite asks of an engine feature, stated as behaviour.

A facet is an engine's feature seen through the suite's questions, never through one engine's
routes, op names or status codes. An adapter provides one either by inheriting it (its own
methods implement it: the facets whose methods are named to sit on an adapter, KvPool's
kv_pool_bytes for one) or with
a method marked @provides(Facet) that returns an object implementing it; suites ask
facet(engine, Facet) either way.

One module per concern: routing, radix, replay, tiers, memory, transfer, serving.
"""

from __future__ import annotations

from kvconform.contract.facets.memory import InstanceChurn, KvPool, ReclaimProbe, SelfChecks
from kvconform.contract.facets.radix import CacheEvent, RadixCache, RadixCacheModel, RadixMatch, RadixSizes
from kvconform.contract.facets.replay import Handoff, ReplayedRequest, ReplaySetup, TracedRequest, TraceReplay
from kvconform.contract.facets.routing import (
    ActiveBlockTracker,
    Answer,
    Applied,
    IndexBlock,
    IndexEvent,
    KvRouter,
    Outcome,
    RouterIndex,
)
from kvconform.contract.facets.serving import AttachedServer, CacheReset, SaltedPrompts
from kvconform.contract.facets.tiers import OffloadTier, PersistentTier, RemoteStore
from kvconform.contract.facets.transfer import (
    DisaggregatedServing,
    KvEvents,
    KvTransfer,
    ReleaseGuard,
    StreamAborts,
)

__all__ = [
    "ActiveBlockTracker",
    "Answer",
    "Applied",
    "AttachedServer",
    "CacheEvent",
    "CacheReset",
    "DisaggregatedServing",
    "Handoff",
    "IndexBlock",
    "IndexEvent",
    "InstanceChurn",
    "KvEvents",
    "KvPool",
    "KvRouter",
    "KvTransfer",
    "OffloadTier",
    "Outcome",
    "PersistentTier",
    "RadixCache",
    "RadixCacheModel",
    "RadixMatch",
    "RadixSizes",
    "ReclaimProbe",
    "ReleaseGuard",
    "RemoteStore",
    "ReplaySetup",
    "ReplayedRequest",
    "RouterIndex",
    "SaltedPrompts",
    "SelfChecks",
    "StreamAborts",
    "TraceReplay",
    "TracedRequest",
]
