"""What a check may require of an engine. An adapter declaring a capability promises that the
contract methods behind it work; a check requiring one is skipped, with the capability and
the engine named, where it is missing (SQLAlchemy's requirements pattern)."""

from __future__ import annotations

from enum import StrEnum


class Capability(StrEnum):
    # prefix reuse
    PREFIX_CACHE = "prefix_cache"  # serve_prompt() reports cached tokens per request
    PREFIX_HIT_COUNTERS = "prefix_hit_counters"  # engine-wide queried/hit token counters
    # The answer depends on the KV it was served from: serve_prompt returns in ServedPrompt.output
    # a model's max_tokens greedy token ids (the suites compare 8 of them, from cache and computed
    # in full) or, for a KV store that runs no model, one value per prompt: 1 where every chunk
    # served from cache held the bytes its prefix was stored with, 0 where one did not.
    ANSWERS_FROM_KV = "answers_from_kv"
    RESET_PREFIX_CACHE = "reset_prefix_cache"
    BLOCK_SIZE_CONFIG = "block_size_config"  # can run at a chosen block size
    RESTART = "restart"  # the suite owns the processes and can stop/start them
    PERSISTENT_PREFIX = "persistent_prefix"  # the engine promises hits survive a restart
    CORRUPT_PERSISTED = "corrupt_persisted"  # persisted entries can be corrupted on disk
    FORCED_EVICTION = "forced_eviction"  # the cache can be filled until a prefix is evicted
    CACHE_SALT = "cache_salt"  # serve_salted(): a request's salt keeps its prefix-cache entries apart
    # memory
    HOST_MEMORY = "host_memory"  # the engine's own process tree is known
    INSTANCE_CHURN = "instance_churn"  # create/load/release instances repeatedly
    INSTANCE_REGISTRY = "instance_registry"  # instances register/unregister with a live server
    LONG_SESSION = "long_session"  # multi-turn conversations on one server
    # offload
    OFFLOAD_GAUGES = "offload_gauges"  # usage / write / read gauges of an offload tier
    OFFLOAD_STORE_FAILURE = "offload_store_failure"  # stores can be made to fail on demand
    OFFLOAD_HOST_HITS = "offload_host_hits"  # offloaded prefixes come back as host hits
    OFFLOAD_STORE_THRESHOLD = "offload_store_threshold"  # a block is offloaded only on its Nth offer
    TIERED_STORE_METRICS = "tiered_store_metrics"  # L1/L2 usage and store counters
    BLOCK_POOL_STATS = "block_pool_stats"  # used/free/max blocks and reuse counters
    # events and transfer
    KV_EVENTS = "kv_events"
    ABORT_REQUESTS = "abort_requests"  # client disconnect mid-request
    TRANSFER_ACCOUNTING = "transfer_accounting"  # sender/receiver byte counters
    PAGE_INDEX = "page_index"  # KV indices -> page indices
    RELEASE_GUARD = "release_guard"  # a second release of one request's KV is refused
    BLOCK_TRACKER = "block_tracker"  # router-side active block accounting
    RADIX_INDEX = "radix_index"  # a prefix index fed by KV events (router side)
    RADIX_CACHE_MODEL = "radix_cache_model"  # an engine radix cache drivable step by step
    ROUTER_PREDICTION = "router_prediction"  # router predicts cached prefix per request
    TRACE_REPLAY = "trace_replay"  # offline replay of a synthetic trace
    DISAGG_SERVING = "disagg_serving"  # prefill and decode instances serve requests end to end
    # remote tiers
    REMOTE_TIER = "remote_tier"  # a remote KV store (Redis/Valkey...) the suite can read, damage and stop


# What only an engine the suite launched can offer: its checks stop, restart, reconfigure or
# damage the engine, or read its processes. Attached to a server someone else runs, an
# adapter offers none of them.
NEEDS_LAUNCH = frozenset(
    {
        Capability.RESTART,
        Capability.BLOCK_SIZE_CONFIG,
        Capability.PERSISTENT_PREFIX,
        Capability.CORRUPT_PERSISTED,
        Capability.INSTANCE_CHURN,
        Capability.HOST_MEMORY,
        Capability.OFFLOAD_STORE_FAILURE,
        Capability.LONG_SESSION,
    }
)
