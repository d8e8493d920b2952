"""The harness's contract: what suites may ask and what adapters implement.

Suites and adapters import from here; the harness never imports an adapter or an engine.
"""

from kvconform.contract.adapter import EngineAdapter, provides
from kvconform.contract.capabilities import Capability
from kvconform.contract.facets import (
    ActiveBlockTracker,
    Answer,
    Applied,
    CacheEvent,
    Handoff,
    IndexBlock,
    IndexEvent,
    InstanceChurn,
    KvTransfer,
    OffloadTier,
    Outcome,
    PersistentTier,
    RadixCache,
    RadixCacheModel,
    RadixMatch,
    RadixSizes,
    RemoteStore,
    ReplayedRequest,
    ReplaySetup,
    RouterIndex,
    TracedRequest,
    TraceReplay,
)
from kvconform.contract.types import (
    AdapterContext,
    BlockPoolStats,
    EngineConfig,
    EngineTraits,
    ModelShape,
    ReleaseTwice,
    SecondRelease,
    ServedPrompt,
    TransferResult,
)
from kvconform.oracles import LastToken
from kvconform.polling import poll_until, seconds_until_steady

__all__ = [
    "ActiveBlockTracker",
    "AdapterContext",
    "Answer",
    "Applied",
    "BlockPoolStats",
    "CacheEvent",
    "Capability",
    "EngineAdapter",
    "EngineConfig",
    "EngineTraits",
    "Handoff",
    "IndexBlock",
    "IndexEvent",
    "InstanceChurn",
    "KvTransfer",
    "LastToken",
    "ModelShape",
    "OffloadTier",
    "Outcome",
    "PersistentTier",
    "RadixCache",
    "RadixCacheModel",
    "RadixMatch",
    "RadixSizes",
    "ReleaseTwice",
    "RemoteStore",
    "ReplaySetup",
    "ReplayedRequest",
    "RouterIndex",
    "SecondRelease",
    "ServedPrompt",
    "TraceReplay",
    "TracedRequest",
    "TransferResult",
    "poll_until",
    "provides",
    "seconds_until_steady",
]
