"""Capability facets: what a suite asks of an engine feature, stated as behaviour.

A facet is an engine's feature seen through the suite's questions, never through one engine's
routes, op names or status codes. An adapter provides one either by inheriting it (its own
methods implement it: the facets below whose methods are named to sit on an adapter) or with
a method marked @provides(Facet) that returns an object implementing it; suites ask
engine.facet(Facet) either way.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import ClassVar, Literal

from kvconform.contract.types import BlockPoolStats, ReleaseTwice, SecondRelease, ServedPrompt, TransferResult
from kvconform.memory import MemoryMeasure
from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport


class Outcome(StrEnum):
    """How a service answered a request that changes its state."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # refused: the worker or request is already known
    UNKNOWN = "unknown"  # refused: no such worker or request
    FAILED = "failed"  # any other answer: an error, a malformed request, a crash


@dataclass(frozen=True)
class Answer:
    outcome: Outcome
    detail: str  # what the engine said, verbatim enough for a report

    def is_(self, outcome: Outcome) -> int:
        """1 where the answer is `outcome`, else 0 (a measure's value)."""
        return int(self.outcome is outcome)


class ActiveBlockTracker(ABC):
    """A router's account of the KV blocks live requests hold on its workers (BLOCK_TRACKER).

    Blocks are named by the prefix of sequence hashes up to them: a prefix two live requests
    share is held once, and held until the last of them is freed. Workers and requests are the
    tracker's own records, created and removed through these calls only.
    """

    @abstractmethod
    def register_worker(self, worker_id: int, block_size: int) -> Answer: ...

    @abstractmethod
    def unregister_worker(self, worker_id: int) -> Answer: ...

    @abstractmethod
    def add_request(
        self, request_id: str, worker_id: int, block_hashes: list[int], prompt_tokens: int
    ) -> Answer:
        """A request routed to `worker_id`, holding the blocks `block_hashes` name."""

    @abstractmethod
    def prefill_complete(self, request_id: str) -> Answer:
        """The request's prefill finished; it keeps its blocks while it decodes."""

    @abstractmethod
    def free_request(self, request_id: str) -> Answer: ...

    @abstractmethod
    def active_blocks(self) -> int:
        """Blocks held by live requests over all workers, as the tracker counts them."""


@dataclass(frozen=True)
class RadixSizes:
    """Token counts of a radix cache and its pool."""

    capacity: int
    total: int  # cached in the tree
    available: int  # free in the pool
    evictable: int  # cached and locked by no request
    protected: int  # cached and locked


@dataclass(frozen=True)
class RadixMatch:
    prefix_len: int  # tokens of the query the cache holds, from the start
    handle: int  # the deepest matched node, for lock and unlock


@dataclass(frozen=True)
class CacheEvent:
    """One KV event a cache published: blocks stored (with their tokens), removed, or all
    cleared."""

    kind: Literal["stored", "removed", "cleared"]
    block_hashes: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()  # stored: the blocks' tokens, in order
    block_size: int = 0  # stored
    parent_hash: int | None = None  # stored: the block the first one extends


class RadixCache(ABC):
    """An engine's radix prefix cache, driven as its scheduler drives it (RADIX_CACHE_MODEL):
    a finished request's tokens inserted, a new request's prefix matched and locked while it
    runs, eviction of unlocked leaves when the pool needs room."""

    @abstractmethod
    def insert(self, tokens: list[int]) -> int:
        """Cache `tokens`; returns the prefix length that was cached already."""

    @abstractmethod
    def match(self, tokens: list[int]) -> RadixMatch: ...

    @abstractmethod
    def lock(self, handle: int) -> None: ...

    @abstractmethod
    def unlock(self, handle: int) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> None: ...

    @abstractmethod
    def sizes(self) -> RadixSizes: ...

    @abstractmethod
    def take_events(self, router_hashes: bool = False) -> list[CacheEvent]:
        """The KV events since the last call. `router_hashes`: as the engine publishes them
        to an external KV router (block hashes the router recomputes from the tokens)."""


class RadixCacheModel(ABC):
    """The engine's radix-cache code, from which the suite makes caches to drive
    (RADIX_CACHE_MODEL)."""

    @abstractmethod
    def new_cache(self, page_size: int, capacity_tokens: int) -> RadixCache:
        """A new, empty cache of `capacity_tokens` in pages of `page_size` tokens."""


@dataclass(frozen=True)
class IndexBlock:
    """A block as a KV event names it to a router: the engine's block hash, and its content as
    tokens (the index hashes them its own way) or as a content hash already computed."""

    hash: int
    tokens: tuple[int, ...] = ()
    tokens_hash: int | None = None


@dataclass(frozen=True)
class IndexEvent:
    kind: Literal["stored", "removed", "cleared"]
    worker: int
    event_id: int
    parent: int | None = None  # stored: the engine hash of the block the first one extends
    blocks: tuple[IndexBlock, ...] = ()  # stored
    hashes: tuple[int, ...] = ()  # removed: engine hashes
    dp_rank: int = 0


@dataclass(frozen=True)
class Applied:
    applied: int
    rejected: int
    errors: tuple[str, ...] = ()  # why each rejected event was refused, in order


class RouterIndex(ABC):
    """A router-side prefix index fed by the workers' KV events (RADIX_INDEX). Trees are named
    and independent of each other; a query is a sequence of content hashes (content_hashes)."""

    @abstractmethod
    def new_tree(self, tree: str) -> None: ...

    @abstractmethod
    def apply(self, tree: str, events: list[IndexEvent]) -> Applied:
        """Apply in order; a refused event leaves the tree as it was and the batch goes on."""

    @abstractmethod
    def match(self, tree: str, content_hashes: list[int]) -> dict[int, int]:
        """Per worker holding a prefix of the query: its matched blocks (the longest over its
        data-parallel ranks)."""

    @abstractmethod
    def dump(self, tree: str) -> list[IndexEvent]:
        """The tree as events that rebuild it."""

    @abstractmethod
    def content_hashes(self, tokens: list[int], block_size: int) -> list[int]:
        """The index's own hashes of the full blocks of `tokens`."""

    @abstractmethod
    def resident_bytes(self) -> int:
        """Resident memory of the process holding the index, as the kernel counts it."""


@dataclass(frozen=True)
class TracedRequest:
    """One request of a replay trace. Its prompt is named block by block: one id per block of
    the replay's block size, the partial last block included (its own id); equal ids mean
    equal content, so two requests share a prefix as far as their ids agree."""

    arrival_ms: float
    input_length: int
    output_length: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReplaySetup:
    """One worker per role, a cache of `cache_blocks` blocks, requests one at a time.
    Disaggregated: a prefill worker hands each prompt's KV to a decode worker over a link of
    `link_gbps` decimal GB/s (1 GB/s moves 1e6 bytes per ms), `kv_bytes_per_token` a token."""

    block_size: int
    cache_blocks: int
    disaggregated: bool = False
    kv_bytes_per_token: int = 0
    link_gbps: float = 0.0


@dataclass(frozen=True)
class Handoff:
    """A disaggregated request's KV hand-off, in simulated milliseconds (None: not reported)."""

    transfer_ms: float | None
    destination_reserved_ms: float | None
    destination_activated_ms: float | None
    decode_admitted_ms: float | None


@dataclass(frozen=True)
class ReplayedRequest:
    arrival_ms: float
    input_length: int
    reused_input_tokens: int  # prompt tokens served from cache, as the engine counted them
    completed: bool
    handoff: Handoff | None = None  # disaggregated replays only


class TraceReplay(ABC):
    """An engine's offline replay of a request trace in simulated time (TRACE_REPLAY): what
    each request reused from the cache the earlier ones left, and, where the engine simulates
    disaggregated serving, each request's KV hand-off."""

    simulates_handoff: bool = False

    @abstractmethod
    def replay(self, trace: list[TracedRequest], setup: ReplaySetup) -> list[ReplayedRequest]:
        """Every request of `trace`, in arrival order."""


class InstanceChurn(ABC):
    """Engine instances made, loaded and released over and over (INSTANCE_CHURN), through each
    release path the engine has (unregister, a reaper, close, destroy, a whole restart...).
    What a release left behind is what the adapter's reclaim_probe() reads next."""

    paths: tuple[str, ...] = ()

    @abstractmethod
    def cycle(self, path: str, index: int, tokens: list[int]) -> None:
        """One instance lifecycle: create, load with `tokens`, release through `path`; a
        release that fails raises."""

    def cycles(self, path: str, requested: int) -> int:
        """Cycles to run for a release path (slow paths, e.g. a 30 s reaper, may run fewer)."""
        return requested

    def warmup_path(self, path: str) -> str:
        """Release path of the warm-up cycles (a cheaper one where the path is slow)."""
        return path

    def warmup_cycles(self, path: str) -> int:
        """Cycles run before the baseline, so allocator pools and caches settle (RSS-like
        measures); fewer where every measure of the path is exact."""
        return 2

    def second_release(self, path: str, tokens: list[int]) -> SecondRelease:
        """INSTANCE_REGISTRY: release one instance through `path`, then release it again;
        what each answer was."""
        raise NotImplementedError(f"{type(self).__name__} has no instance registry")


class OffloadTier(ABC):
    """The host tier a device KV cache offloads to (OFFLOAD_*), beside the gauges and counters
    the engine exports of it: when its stores have settled, the host block size the byte
    counters are judged in, what the engine's transfer worker knew, and the store failure the
    suite injects. kvconform.kit.offload_tier.MetricOffloadTier is the usual shape."""

    @abstractmethod
    def wait_idle(self, timeout_s: float = 15.0, quiet_s: float = 1.0) -> None:
        """Wait until the tier's stores stop moving (never on the gauges under test)."""

    @abstractmethod
    def block_bytes(self) -> int:
        """Bytes of one block in the host tier."""

    def transfer_log(self) -> list[tuple[float, int, int]] | None:
        """What the engine's transfer worker knew, at each change since the engine started:
        (time.monotonic() seconds, chunks of stores in flight, chunks of loads in flight).
        Where the worker can say it, the offload gauges are judged against it; None: it cannot."""
        return None

    def fail_stores(self, fail: bool) -> None:
        """While on, every store to the tier fails (OFFLOAD_STORE_FAILURE)."""
        raise NotImplementedError(f"{type(self).__name__} cannot fail stores")

    def failed_stores(self, before: MetricSnapshot, after: MetricSnapshot) -> float:
        """Blocks whose store failed between two snapshots, by the engine's own count."""
        raise NotImplementedError(f"{type(self).__name__} counts no failed stores")


class PersistentTier(ABC):
    """Where an engine keeps KV across its own restarts (PERSISTENT_PREFIX, CORRUPT_PERSISTED,
    TIERED_STORE_METRICS): files on disk, or objects in a store the suite runs. The suite reads
    what landed there and, where the tier is files, damages them."""

    @abstractmethod
    def flush(self) -> None:
        """Wait until what the engine stored has reached the tier (writes are asynchronous)."""

    @abstractmethod
    def sizes(self) -> dict[str, int]:
        """Each entry of the tier (a file, an object) -> its bytes."""

    @abstractmethod
    def block_bytes(self) -> int:
        """What one full block takes in the tier, from the model's shape and the tier's
        documented format (a format that adds a header says so here)."""

    def files(self) -> list[Path]:
        """The tier's files, for the suite to damage; a tier of objects has none."""
        raise NotImplementedError(f"{type(self).__name__} keeps objects, not files")


class RemoteStore(ABC):
    """The remote KV store an engine offloads to (REMOTE_TIER: Redis, Valkey...), run by the
    suite and read with the store's own client: what the engine wrote there, the store's own
    accounting, and the faults a store really has (damaged values, paused or refused writes,
    the server gone)."""

    @abstractmethod
    def entries(self) -> dict[str, int]:
        """The engine's objects in the store -> the bytes each value holds."""

    @abstractmethod
    def objects_total(self) -> int:
        """Every object in the store, the engine's or not."""

    @abstractmethod
    def memory_usage(self, key: str) -> int:
        """What the store says one object costs (key, value and its own overhead)."""

    @abstractmethod
    def read(self, key: str) -> bytes:
        """One stored value, read straight from the store."""

    @abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Overwrite one stored value behind the engine's back (to damage it)."""

    @abstractmethod
    def capacity_bytes(self) -> int:
        """The capacity the adapter configured the engine's remote tier with."""

    @abstractmethod
    def wipe(self) -> None:
        """The engine stopped and the store emptied out of band (the store keeps running)."""

    @abstractmethod
    def down(self) -> TeardownReport:
        """The store's server stopped under a running engine; its teardown report."""

    @abstractmethod
    def pause_writes(self, seconds: float) -> None:
        """The store holds every write for `seconds` (reads go on): the engine's stores stay in
        flight that long, whatever its own counters say."""

    @abstractmethod
    def refuse_writes(self, refuse: bool) -> None:
        """While on, the store refuses every write with an error (reads go on)."""

    @abstractmethod
    def refused_writes(self) -> int:
        """The store's own count of writes it refused."""


class KvTransfer(ABC):
    """A prefill's KV handed to decode ranks (TRANSFER_ACCOUNTING, PAGE_INDEX): the pages it
    sent and the bytes each side counted. The class attributes say which transfers the engine
    makes; a check asking for another is skipped, naming it."""

    layouts: tuple[str, ...] = ("mha",)  # KV layouts (kvconform.oracles.KvLayout values)
    page_sizes: tuple[int, ...] = ()
    destinations: tuple[int, ...] = (1, 4)  # decode ranks one transfer can fan out to
    aborts: bool = False  # transfer(abort_after_pages=...) cuts a transfer mid-way

    @abstractmethod
    def transfer(
        self,
        tokens: list[int],
        layout: str,
        page_size: int,
        destinations: int,
        abort_after_pages: int | None = None,
    ) -> TransferResult:
        """Prefill `tokens` and transfer their KV to `destinations` decode ranks."""


# ---- facets an adapter usually implements itself (inherits) --------------------------------


class KvPool(ABC):
    """The device KV pool the suite configured, and what the engine says is in it
    (FORCED_EVICTION, LONG_SESSION, BLOCK_POOL_STATS; the KV-event ledger's completeness check
    where the engine counts its cached blocks). A cache server's pool (LMCache) is its L1."""

    @abstractmethod
    def cache_capacity_tokens(self) -> int:
        """Device prefix-cache capacity, from the configuration the suite gave the engine."""

    def kv_pool_bytes(self) -> int:
        """Bytes of the device KV pool the suite configured (LONG_SESSION)."""
        raise NotImplementedError(f"{type(self).__name__} does not size its KV pool in bytes")

    def resident_blocks_reported(self) -> int | None:
        """Cached blocks the engine says it holds (None: it does not say)."""
        return None

    def block_pool_stats(self) -> list[BlockPoolStats]:
        """Every iteration's block-pool stats reported by this engine instance, oldest first
        (BLOCK_POOL_STATS)."""
        raise NotImplementedError(f"{type(self).__name__} reports no block-pool stats")


class StreamAborts(ABC):
    """Streaming completions the suite cuts mid-way, and the engine's live count of the requests
    it runs (ABORT_REQUESTS). kvconform.kit.http_api.HttpApi implements the streams."""

    @abstractmethod
    def stream_and_disconnect(self, tokens: list[int], after_chunks: int, max_tokens: int = 256) -> int:
        """Start a streaming completion and drop the connection after `after_chunks` token
        chunks. Returns the token chunks received before the drop, 0 when the stream finished
        first (then no request was aborted)."""

    @abstractmethod
    def stream_outlives(self, tokens: list[int], max_tokens: int, seconds: float) -> bool:
        """Whether a streaming completion of `max_tokens` is still running `seconds` after it
        started (then the connection is dropped); False when it finished first."""

    def requests_in_flight(self) -> int | None:
        """Requests the engine runs or queues now, by its live count (not a gauge refreshed
        later); None where the engine has no live count (nothing is judged)."""
        return None


class KvRouter(ABC):
    """A KV-aware router in front of workers (ROUTER_PREDICTION): the overlap it predicts for
    a request against what the worker it picked then reports."""

    @abstractmethod
    def serve_routed(self, tokens: list[int]) -> tuple[int, ServedPrompt]:
        """(tokens the router predicted cached, what the worker then reported)."""

    def router_event_status(self, before: MetricSnapshot, after: MetricSnapshot) -> dict[str, float] | None:
        """KV events the router applied between two snapshots, by status ("ok" and each way of
        failing); None: the engine does not say. An engine that says must export the metric:
        absent after routed traffic is an EngineError naming it, never zero events."""
        return None


class SaltedPrompts(ABC):
    """The engine's documented per-request cache salt (CACHE_SALT)."""

    @abstractmethod
    def serve_salted(self, tokens: list[int], salt: str, max_tokens: int = 1) -> ServedPrompt:
        """serve_prompt under `salt`, which keeps the prompt's cached prefix apart from every
        other salt's."""


class DisaggregatedServing(ABC):
    """A prefill -> decode deployment (DISAGG_SERVING, launched with EngineConfig(disaggregated))."""

    @abstractmethod
    def serve_disaggregated(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        """Serve a prompt through it: prompt_tokens as the decode side counted them,
        cached_tokens the prefix reuse the prefill side had, output the decode side's answer
        (`max_tokens` greedy ids, where ANSWERS_FROM_KV), and source["handoff"] the prompt
        tokens the decode side received from the prefill rather than computed, where the
        engine says (absent: not judged)."""


class ReleaseGuard(ABC):
    """The engine's guard against releasing one request's KV twice (RELEASE_GUARD)."""

    # What a running request holds in the engine's block pool: every block of its prompt
    # (False: the prompt is fresh, nothing cached, and the partial last block counts), or only
    # references on its cached prefix's whole blocks (True: the engine keeps a request's new KV
    # outside the pool, so the prompt is served once before the request under test).
    releases_cached_prefix: ClassVar[bool] = False

    @abstractmethod
    def release_twice(self, tokens: list[int]) -> ReleaseTwice:
        """Release one request's KV twice through the engine's own abort/failure release path,
        and say what each release did. The request is `tokens`: fresh, or (where
        releases_cached_prefix) served once before so its whole blocks are cached."""


class KvEvents(ABC):
    """The KV events the engine publishes (KV_EVENTS), read into the adapter's `ledger`.
    kvconform.kit.event_feed.ZmqEventFeed is the ZMQ publisher's side of it."""

    @abstractmethod
    def drain_events(self) -> int:
        """Make sure every event emitted so far is in the ledger; fill transport gaps from the
        engine's replay where it has one. Returns how many batches replay filled."""


class ReclaimProbe(ABC):
    """Memory that must come back after a release and stay flat over a long session
    (INSTANCE_CHURN, LONG_SESSION), by measure."""

    @abstractmethod
    def reclaim_probe(self) -> dict[str, MemoryMeasure]: ...


class SelfChecks(ABC):
    """The engine's own built-in invariant checks (e.g. SGLang's idle pool audit): each check
    on the engine judges that none raised an alarm while it ran."""

    @abstractmethod
    def self_check_alarms(self, *, settle: bool = True) -> list[str] | None:
        """The alarms raised since the last call (the engine's lines); None where the checks
        cannot be read in this mode (nothing is judged). settle=False reads without waiting
        for the engine's next audit (a check's start only drains what came before it)."""


class AttachedServer(ABC):
    """A running server the suite attaches to instead of launching it (--engine-url): how it is
    reached and what it says of itself. kvconform.kit.http_api.HttpApi implements
    check_reachable; an engine with no server API cannot be attached."""

    @abstractmethod
    def check_reachable(self) -> None:
        """One quick request to the server; a UsageError names the engine and the URL."""

    def attached_version(self) -> str:
        return "unknown (attached)"

    def attached_block_size(self) -> int | None:
        """The block size the running server reports (None: it does not say; the adapter's
        default is taken)."""
        return None


class CacheReset(ABC):
    """The engine's own reset of its prefix cache (RESET_PREFIX_CACHE)."""

    @abstractmethod
    def reset_prefix_cache(self) -> None: ...
