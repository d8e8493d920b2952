"""Test double for REMOTE_TIER (+ PREFIX_CACHE, RESTART, PERSISTENT_PREFIX, TIERED_STORE_METRICS):
a prefix cache with a local L1 and a remote L2 store, as LMCache runs with Redis.

Not an engine. The contract is the one LmcacheRedisAdapter implements (kvconform/adapters/lmcache):

  store        the remote server, a dict key -> bytes; it outlives the engine (stop/restart) and
               is stopped only by its down(), or emptied out of band by its wipe()
  chunks       one per whole block of the prompt (a cache store: every stored chunk is returned,
               traits.recomputes_last_token False), keyed by a hash chain under "kvc-double@"; a value
               is the chunk's KV (kv_bytes_per_token x block), its last 32 bytes a digest of the key
               and the rest, which the engine checks (length and digest) before serving a hit
  L1           local buffers (slots) indexed by chunk key, lost when the engine stops
  L2           the engine's index of what it wrote (key -> bytes: its usage gauge, LRU eviction
               from 0.8 to 0.6 of the capacity), rebuilt from the store when it starts; loads go
               through one connection per engine instance
  output       one token: a digest of the KV the prompt was served from (hit or computed), so KV
               served with the wrong bytes changes it

A request looks its chunks up in L1, then in L2 (loads), serves the longest valid prefix, computes
the rest and stores what L1 and L2 lack. With the remote server gone an L2 operation fails at once
(connection refused) and the request goes on without L2. A store the server holds (paused writes)
stays in flight until the pause ends; one it refuses (out of memory) fails: counted submitted and
failed, the chunk stays in L1 only.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Any, ClassVar

from kvconform.contract import (
    Capability,
    EngineConfig,
    EngineTraits,
    KvPool,
    MetricMap,
    PersistentTier,
    RemoteStore,
    ServedPrompt,
    deployed_block_size,
    provides,
)
from kvconform.engines.reference.faults import Fault
from kvconform.errors import EngineError
from kvconform.kit.persistent_tiers import StoreTier
from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport
from tests.doubles.base import DoubleAdapter

PREFIX = "kvc-double@"
DIGEST = 32
CAPACITY_CHUNKS = 32  # remote capacity, in chunks: the eviction check fills it twice over
L1_CHUNKS = 256
TRIGGER, TARGET = 0.8, 0.6  # LMCache's trigger_watermark 0.8, eviction_ratio 0.2
STORE_OVERHEAD = 56  # what the store says an object costs beyond key and value (MEMORY USAGE)
HEADER = 28  # LMCache's RemoteMetadata: length, shape, dtype, format
# The remote client's socket timeout: 1 s past the server-loss check's 30 s bound (SERVE_BOUND_S)
REMOTE_TIMEOUT_S = 31.0
USAGE, SUBMITTED, COMPLETED = "l2_usage_bytes", "l2_store_submitted_total", "l2_store_completed_total"
FAILED, L1_USAGE = "l2_store_failed_total", "l1_usage_bytes"
# store tasks (one per prompt's store), completed whether they succeeded or failed, as LMCache
# 0.5.6 counts its requests (store_controller.py: L2_STORE_COMPLETED is published for both)
TASKS_SUBMITTED, TASKS_COMPLETED = "l2_store_submitted_requests_total", "l2_store_completed_requests_total"
CLIENT_TIMEOUT_S = 1.0  # the remote client's write timeout (the held_writes_abandoned fault)
FREE_LINK = 16  # bytes an allocator writes into a freed buffer (its free-list link)

_DAMAGE = "prefix_reuse::test_remote_damaged_entry_recomputed"
_RECONCILE = "offload_metrics::test_remote_tier_bytes_reconcile"
_EVICTION = "offload_metrics::test_remote_tier_eviction_within_capacity"
_LOSS = "offload_metrics::test_remote_server_loss"
_PENDING = "offload_metrics::test_remote_store_counters_track_pending_writes"

FAULTS: dict[str, Fault] = {
    "remote_checks_length_only": Fault(
        "a loaded value is checked for its length only: a corrupted value of the right length is "
        "served as a hit",
        (f"{_DAMAGE}[corrupt]",),
        "LMCache 0.5.6: the remote tier's retrieve checks a value's size, not its contents",
        ("cached_tokens_from_damaged_entries", "output_identical_to_cold_run"),
    ),
    "truncated_value_desyncs_connection": Fault(
        "a value shorter than the chunk is refused, but its body is left unread on the load "
        "connection: every later value read on it is shifted by that many bytes, fails the digest "
        "and is recomputed, until the engine reconnects (next start)",
        (f"{_DAMAGE}[truncate]",),
        "LMCache RESP client: size-header mismatch leaves the connection out of step",
        ("intact_prefix_hits_after_damaged_read",),
    ),
    "desynced_reads_served_and_rewritten": Fault(
        "as truncated_value_desyncs_connection, with a length-only check: the shifted values have "
        "the right length and are served as hits, and the engine writes every chunk of a request "
        "back to the store (hits included), so the shifted bytes replace the intact entries",
        (f"{_DAMAGE}[truncate]",),
        "LMCache 0.5.6 RESP tier: size-header desync and length-only checks together; redis-py "
        "CVE-2023-28858 (a connection left out of step answers a request with another's data)",
        ("intact_prefix_output_identical", "intact_prefix_output_next_session"),
    ),
    "remote_metadata_header": Fault(
        "each value carries a 28-byte metadata header before the chunk's KV (the engine counts it)",
        (_RECONCILE,),
        "LMCache remote connectors' RemoteMetadata header stored with every chunk",
        ("remote_bytes",),
    ),
    "layerwise_objects": Fault(
        "each chunk is stored as one object per layer (bytes add up, objects do not)",
        (_RECONCILE,),
        "LMCache layerwise storage (use_layerwise): a key per layer and chunk",
        ("remote_objects",),
    ),
    "metadata_side_objects": Fault(
        "each chunk also writes a metadata object under its own key, outside the engine's key "
        "space, which eviction never deletes",
        (_RECONCILE, _EVICTION),
        "LMCache's Redis connector storing key+'metadata' beside key+'kv_bytes'",
        ("remote_foreign_objects",),
    ),
    "store_completed_counts_batches": Fault(
        "the completed-stores counter moves once per batch (a request's chunks), not per chunk",
        (_RECONCILE,),
        "LMCache L2 store counters in two units (objects vs chunks: *_objects_chunks_total)",
        ("l2_store_completed_delta",),
    ),
    "usage_gauge_from_store_memory": Fault(
        "the L2 usage gauge adds up what the store says each object costs (key, value and its "
        "own overhead), not the bytes the engine holds there",
        (_RECONCILE, _EVICTION),
        "a usage gauge read from the server's memory accounting (Redis MEMORY USAGE)",
        (
            f"{_RECONCILE}:l2_usage_bytes",
            f"{_RECONCILE}:l2_usage_bytes_after_restart",
            f"{_EVICTION}:l2_usage_bytes_vs_remote",
        ),
    ),
    "usage_gauge_forgets_store": Fault(
        "a started engine does not rebuild its L2 index from the store: the usage gauge reads 0 "
        "after a restart while the store still holds (and serves) the entries",
        (_RECONCILE,),
        "LMCache with a Redis L2: l2_usage_bytes starts at 0 after a restart",
        ("l2_usage_bytes_after_restart",),
    ),
    "eviction_never_runs": Fault(
        "the L2 eviction never runs: the store grows past its capacity",
        (_EVICTION,),
        "an L2 eviction policy configured but never triggered (LMCache eviction watermark unused)",
        ("remote_bytes_at_idle",),
    ),
    "usage_gauge_not_decremented_on_eviction": Fault(
        "eviction deletes from the store but the usage gauge never subtracts what it deleted",
        (_EVICTION,),
        "usage gauges incremented on store and not decremented on delete (LMCache L1/L2 gauges)",
        ("l2_usage_bytes_vs_remote",),
    ),
    "remote_teardown_leaves_child": Fault(
        "stopping the remote server leaves its background-save child process running",
        (_LOSS,),
        "Redis's forked BGSAVE child (redis-rdb-bgsave) outliving its killed server",
        ("remote_teardown_leftovers",),
    ),
    "lost_remote_hangs_requests": Fault(
        f"every lookup also asks the remote tier and waits on its dead connection for the "
        f"client's socket timeout ({REMOTE_TIMEOUT_S:.0f} s) before answering from L1",
        (_LOSS,),
        "LMCache with a lost Redis: requests block on the remote tier until its socket times out",
        ("fresh_request_seconds", "stored_request_seconds"),
    ),
    "lost_remote_kills_engine": Fault(
        "the first request after the remote server is lost raises out of the tier's worker and "
        "ends the engine: that request is refused and the engine answers nothing more",
        (_LOSS,),
        "a remote tier's connection error raised past its worker thread (the class of an "
        "uncaught connector exception ending a cache server)",
        ("engine_healthy_after_loss", "requests_refused_after_loss"),
    ),
    "partial_chunk_saved": Fault(
        "the prompt's partial last chunk is stored and matched like a whole one",
        (_LOSS,),
        "LMCache save_unfull_chunk: the unfull tail chunk cached and counted as hit tokens",
        ("stored_prompt_hits",),
    ),
    "l1_buffers_released_on_remote_loss": Fault(
        "when the remote tier fails, the engine returns the L1 buffers of chunks it already wrote "
        "there to its allocator but keeps them indexed; the next chunks stored reuse them, and a "
        "hit on the old chunks serves the new chunks' bytes",
        (_LOSS,),
        "LMCache memory-object ref-count bugs: a buffer released on an error path while the L1 "
        "index still refers to it",
        ("stored_prompt_output_identical",),
    ),
    "submitted_counted_on_completion": Fault(
        "the submitted counter moves when a store completes, not when it is handed to the remote "
        "client: a store the server holds is in flight but never shows as such",
        (_PENDING,),
        "write-pending signals published from the completion path (vLLM's offload write gauge "
        "against the stores the host-copy worker has in flight)",
        ("l2_pending_objects_while_remote_paused",),
    ),
    "held_writes_abandoned": Fault(
        f"a write the server holds longer than the client's {CLIENT_TIMEOUT_S:.0f} s timeout is "
        "abandoned (the server drops the closed connection's command) but counted completed",
        (_PENDING,),
        "LMCache 0.5.6 counts a failed store task completed (store_controller.py _finalize_store); "
        "a timed-out RESP write",
        ("remote_objects_after_pause",),
    ),
    "late_completions_dropped": Fault(
        f"the completion of a store that took longer than {CLIENT_TIMEOUT_S:.0f} s is dropped: "
        "the chunk lands in the store, the completed counter never moves",
        (_PENDING,),
        "LMCache store_controller.py _drain_l2_store_completions: a completion whose task is no "
        "longer tracked is logged ('not found in tracking') and dropped",
        ("l2_pending_objects_after_pause",),
    ),
    "store_skipped_when_store_full": Fault(
        "the engine asks the store for its free memory first and skips the L2 write when it is "
        "full: no write is ever refused, so the failed-store path never runs",
        (_PENDING,),
        "L2 admission control that drops stores silently (a store policy skipping a full tier)",
        ("remote_refused_writes",),
    ),
    "failed_store_left_pending": Fault(
        "a refused store counts as submitted and never as completed or failed, its task never "
        "finishes: it stays in flight for good",
        (_PENDING,),
        "a failure path that skips the completion event (LMCache's store_controller publishes "
        "L2_STORE_COMPLETED with failed_count on failure; a submit that throws is counted nowhere, "
        "store_controller.py:662-671)",
        ("l2_pending_objects_after_failed_stores", "l2_pending_store_tasks_after_failed_stores"),
    ),
    "failed_store_counted_as_stored": Fault(
        "a refused store's chunk is booked as stored: the L2 usage gauge counts bytes the store never took",
        (_PENDING,),
        "LMCache#4991 (fs_native: failed stores stay registered as present); LMCache 0.5.6's RESP "
        "adapter books a store only when its completion says ok",
        ("l2_usage_bytes_vs_remote_after_failed_stores",),
    ),
    "failed_store_drops_l1": Fault(
        "a refused L2 store also deletes the chunks' L1 copies, as a successful one may "
        "(the L1 deletion policy applied on the failure path)",
        (_PENDING,),
        "LMCache store_controller.py: select_l1_deletions after an L2 store (applied on success only there)",
        ("hits_after_failed_stores", "l1_usage_bytes_delta"),
    ),
    "failed_store_frees_l1_buffers": Fault(
        "a refused L2 store returns the chunks' L1 buffers to the allocator while L1 still "
        f"indexes them; the allocator writes its {FREE_LINK}-byte free-list link into each, so a "
        "hit on them serves damaged KV",
        (_PENDING,),
        "LMCache memory-object ref-count bugs: a buffer released on an error path while the L1 "
        "index still refers to it",
        ("output_after_failed_stores_identical",),
    ),
    "refusal_desyncs_connection": Fault(
        "the remote client leaves an error reply unread on its connection: every later write "
        "on it fails, until the engine reconnects (next start)",
        (_PENDING,),
        "LMCache 0.5.6 RESP L2 adapter: after Redis refused writes (OOM), stores keep failing "
        "('Store task N to adapter 0 failed') on a store that takes writes again",
        ("l2_objects_completed_after_refusals_end",),
    ),
    "l1_gauge_counts_l2_staging": Fault(
        "the L1 usage gauge also counts the staging copy each L2 write makes of a chunk, and "
        "never subtracts it",
        (_PENDING,),
        "usage gauges incremented for read-locked copies held during an L2 store and not "
        "decremented on release (LMCache L1 gauges)",
        ("l1_usage_bytes_delta",),
    ),
}


def chunk_keys(tokens: list[int], block: int, partial: bool) -> list[tuple[str, int]]:
    """(key, tokens) of each whole chunk, and of the partial tail where `partial`."""
    out: list[tuple[str, int]] = []
    parent = ""
    for start in range(0, len(tokens), block):
        part = tokens[start : start + block]
        if len(part) < block and not partial:
            break
        parent = hashlib.sha256(f"{parent}:{part}".encode()).hexdigest()[:24]
        out.append((PREFIX + parent, len(part)))
    return out


def compute_kv(key: str, nbytes: int) -> bytes:
    """The chunk's KV as the model computes it, ending in a digest of the key and the rest."""
    seed = hashlib.sha256(key.encode()).digest()
    body = (seed * (nbytes // len(seed) + 1))[: nbytes - DIGEST]
    return body + hashlib.sha256(key.encode() + body).digest()


def intact(key: str, data: bytes, nbytes: int) -> bool:
    body, digest = data[:-DIGEST], data[-DIGEST:]
    return len(data) == nbytes and hashlib.sha256(key.encode() + body).digest() == digest


class RemoteDown(Exception):
    pass


class Store:
    """The remote server: key -> bytes, up or down; it may hold writes (paused) or refuse them."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.up = True
        self.paused_until = 0.0
        self.refusing = False
        self.refused = 0

    def paused(self) -> bool:
        return time.monotonic() < self.paused_until

    def get(self, key: str) -> bytes | None:
        if not self.up:
            raise RemoteDown
        return self.data.get(key)

    def set(self, key: str, value: bytes) -> None:
        if not self.up:
            raise RemoteDown
        self.data[key] = value

    def delete(self, key: str) -> None:
        if not self.up:
            raise RemoteDown
        self.data.pop(key, None)

    def memory_usage(self, key: str) -> int:
        return len(key) + len(self.data[key]) + STORE_OVERHEAD


class Connection:
    """The engine's load connection. `lag`: bytes of earlier replies left unread on it (only a
    desyncing client leaves any); a read then returns the stream shifted by them."""

    def __init__(self, store: Store, desyncs: bool) -> None:
        self.store = store
        self.desyncs = desyncs
        self.lag = b""
        self.broken = False  # an error reply left unread (the refusal_desyncs_connection fault)

    def load(self, key: str, nbytes: int) -> bytes | None:
        value = self.store.get(key)
        if value is None:
            return None
        if self.lag:
            stream = self.lag + value
            self.lag = stream[nbytes:]
            return stream[:nbytes]
        if len(value) != nbytes and self.desyncs:
            self.lag = value  # the size mismatch raised before the body was read
        return value


class RemoteTierDouble(DoubleAdapter, KvPool):
    """Test double (not an engine) of a prefix cache with a remote (Redis-like) L2 tier."""

    name = "testdouble_remote_tier"
    capabilities = frozenset(
        {
            Capability.PREFIX_CACHE,
            Capability.RESTART,
            Capability.PERSISTENT_PREFIX,
            Capability.TIERED_STORE_METRICS,
            Capability.REMOTE_TIER,
        }
    )
    traits = EngineTraits(
        recomputes_last_token=False,
        metric_map=MetricMap(
            names={
                "l2_usage_bytes": USAGE,
                "l2_store_submitted": SUBMITTED,
                "l2_store_completed": COMPLETED,
                "l2_store_failed": FAILED,
                "l2_store_submitted_requests": TASKS_SUBMITTED,
                "l2_store_completed_requests": TASKS_COMPLETED,
                "l1_usage_bytes": L1_USAGE,
            },
        ),
    )  # a cache store returns every stored chunk
    faults: ClassVar[dict[str, Fault]] = FAULTS
    slow_faults: ClassVar[tuple[str, ...]] = ("lost_remote_hangs_requests",)  # two requests x 31 s

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.store = Store()
        self.submitted = self.completed = self.failed = 0
        self.tasks_submitted = self.tasks_completed = self.tasks_held = 0
        self.held: list[tuple[str, bytes, float]] = []  # writes the store holds: key, value, since
        self.l1_gauge = 0

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, config: EngineConfig) -> None:
        super().start(config)
        self.dead = False
        if not self.store.up:
            self.store = Store()  # the stack starts again, its remote server included (empty)
        self.slots: list[bytes] = []
        self.free: list[int] = []
        self.l1: OrderedDict[str, int] = OrderedDict()  # key -> slot
        self.l2: OrderedDict[str, int] = OrderedDict()  # key -> bytes written (LRU order)
        if self.fault != "usage_gauge_forgets_store":
            for key, value in self.store.data.items():
                if key.startswith(PREFIX):
                    self.l2[key] = len(value)
        self.gauge_bytes = sum(self.l2.values())  # the running gauge (usage_gauge_not_decremented...)
        self.conn = Connection(self.store, self.fault in _DESYNC)
        self.submitted = self.completed = self.failed = 0
        self.tasks_submitted = self.tasks_completed = self.tasks_held = 0
        self.held, self.l1_gauge = [], 0

    def stop(self) -> list[TeardownReport]:
        self.config = None
        self.l1, self.slots, self.free = OrderedDict(), [], []
        self.held, self.l1_gauge = [], 0
        return []

    def running(self) -> bool:
        return self.config is not None

    def healthy(self) -> bool:
        return self.running() and not self.dead

    dead = False  # lost_remote_kills_engine

    def cache_capacity_tokens(self) -> int:
        return L1_CHUNKS * deployed_block_size(self)

    # ---- requests -----------------------------------------------------------------------
    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        if not self.running():
            raise EngineError(self.name, "not started")
        if self.dead or (self.fault == "lost_remote_kills_engine" and not self.store.up):
            self.dead = True
            raise EngineError(self.name, "connection refused (the engine exited)")
        self._release_held()
        per_token = self.deployment.model.kv_bytes_per_token()
        chunks = chunk_keys(tokens, deployed_block_size(self), self.fault == "partial_chunk_saved")
        remote_ok = True
        if self.fault == "lost_remote_hangs_requests" and not self.store.up:
            time.sleep(REMOTE_TIMEOUT_S)  # the lookup waits on the dead connection, then gives up
            remote_ok = False
        served: list[bytes] = []
        for key, n in chunks:
            if key in self.l1:
                self.l1.move_to_end(key)
                served.append(self.slots[self.l1[key]])
                continue
            if not remote_ok:
                break
            try:
                data = self._load(key, n * per_token)
            except RemoteDown:
                remote_ok = False
                self._remote_failed()
                break
            if data is None:
                break
            if key in self.l2:
                self.l2.move_to_end(key)
            served.append(data)
            self._put_l1(key, data)
        hit_tokens = sum(n for _, n in chunks[: len(served)])
        kv = list(served)
        for key, n in chunks[len(served) :]:
            data = compute_kv(key, n * per_token)
            kv.append(data)
            self._put_l1(key, data)
        if remote_ok:
            try:
                self._store_l2(chunks, kv, hits=len(served))
            except RemoteDown:
                self._remote_failed()
        tail = tokens[sum(n for _, n in chunks) :]  # tokens of no chunk: computed every time
        digest = hashlib.sha256(b"".join(kv) + repr(tail).encode()).digest()
        return ServedPrompt(len(tokens), hit_tokens, [int.from_bytes(digest[:4], "big")] * max_tokens)

    def _load(self, key: str, nbytes: int) -> bytes | None:
        """One chunk from L2, checked; None: a miss (absent or refused)."""
        if self.fault == "layerwise_objects":
            parts = [self.conn.load(f"{key}@L{i}", nbytes // 2) for i in range(2)]
            data = None if None in parts else b"".join(p for p in parts if p is not None)
        elif self.fault == "remote_metadata_header":
            raw = self.conn.load(key, nbytes + HEADER)
            data = None if raw is None else raw[HEADER:]
        else:
            data = self.conn.load(key, nbytes)
        if data is None:
            return None
        if self.fault in _LENGTH_ONLY:
            return data if len(data) == nbytes else None
        return data if intact(key, data, nbytes) else None

    def _store_l2(self, chunks: list[tuple[str, int]], kv: list[bytes], hits: int) -> None:
        before, refused_before, held_before = self.submitted, self.failed + self.store.refused, len(self.held)
        self._store_chunks(chunks, kv, hits)
        if self.submitted == before and len(self.held) == held_before:
            return  # nothing submitted: no task
        self.tasks_submitted += 1
        if len(self.held) > held_before:
            self.tasks_held += 1  # completes when the store releases its writes
        elif self.failed + self.store.refused == refused_before or self.fault != "failed_store_left_pending":
            self.tasks_completed += 1

    def _store_chunks(self, chunks: list[tuple[str, int]], kv: list[bytes], hits: int) -> None:
        written = 0
        for i, ((key, _n), data) in enumerate(zip(chunks, kv, strict=True)):
            rewrite = self.fault == "desynced_reads_served_and_rewritten" and i < hits
            index_key = f"{key}@L0" if self.fault == "layerwise_objects" else key
            if index_key in self.l2 and not rewrite:
                continue
            if (self.store.refusing or self.conn.broken) and self.store.up:
                self._refused(key)
                continue
            if self.fault == "l1_gauge_counts_l2_staging":
                self.l1_gauge += len(data)
            if self.store.paused() and self.store.up:
                if self.fault != "submitted_counted_on_completion":
                    self.submitted += 1
                self.held.append((key, data, time.monotonic()))
                continue
            self.submitted += 1
            if self.fault == "layerwise_objects":
                half = len(data) // 2
                for layer, part in enumerate((data[:half], data[half:])):
                    self._write(f"{key}@L{layer}", part)
            elif self.fault == "remote_metadata_header":
                self._write(key, len(data).to_bytes(HEADER, "big") + data)
            else:
                self._write(key, data)
            if self.fault == "metadata_side_objects":
                self.store.set("meta:" + key[len(PREFIX) :], f'{{"bytes": {len(data)}}}'.encode())
            written += 1
            if self.fault != "store_completed_counts_batches":
                self.completed += 1
        if written and self.fault == "store_completed_counts_batches":
            self.completed += 1
        self._evict()

    def _refused(self, key: str) -> None:
        """The store answers the write with an out-of-memory error."""
        if self.fault == "store_skipped_when_store_full":
            return  # it asked first, and never wrote
        if self.store.refusing:
            self.store.refused += 1
            self.conn.broken = self.fault == "refusal_desyncs_connection"
        self.submitted += 1
        if self.fault != "failed_store_left_pending":
            self.failed += 1
        if key in self.l1 and self.fault == "failed_store_counted_as_stored":
            self.gauge_bytes += len(self.slots[self.l1[key]])
        if key in self.l1 and self.fault == "failed_store_drops_l1":
            self.free.append(self.l1.pop(key))
            self.l1_gauge -= len(self.slots[self.free[-1]])
        elif key in self.l1 and self.fault == "failed_store_frees_l1_buffers":
            slot = self.l1[key]
            self.free.append(slot)  # released, still indexed
            self.slots[slot] = bytes(FREE_LINK) + self.slots[slot][FREE_LINK:]

    def _release_held(self) -> None:
        """Once the store's pause ends, the writes it held land (or are given up on)."""
        if not self.held or self.store.paused():
            return
        held, self.held = self.held, []
        self.tasks_completed += self.tasks_held
        self.tasks_held = 0
        for key, data, since in held:
            slow = time.monotonic() - since > CLIENT_TIMEOUT_S
            if self.fault == "submitted_counted_on_completion":
                self.submitted += 1
            if not (slow and self.fault == "held_writes_abandoned"):
                self._write(key, data)
            if not (slow and self.fault == "late_completions_dropped"):
                self.completed += 1
        self._evict()

    def _write(self, key: str, value: bytes) -> None:
        self.store.set(key, value)
        self.gauge_bytes += len(value) - self.l2.get(key, 0)
        self.l2[key] = len(value)
        self.l2.move_to_end(key)

    def _evict(self) -> None:
        if self.fault == "eviction_never_runs":
            return
        capacity = self.remote_tier().capacity_bytes()
        if sum(self.l2.values()) <= TRIGGER * capacity:
            return
        while self.l2 and sum(self.l2.values()) > TARGET * capacity:
            key, size = self.l2.popitem(last=False)
            self.store.delete(key)
            if self.fault != "usage_gauge_not_decremented_on_eviction":
                self.gauge_bytes -= size

    def _put_l1(self, key: str, data: bytes) -> None:
        if key in self.l1:
            self.slots[self.l1[key]] = data
            return
        while len(self.l1) >= L1_CHUNKS:
            _old, slot = self.l1.popitem(last=False)
            self.free.append(slot)
            self.l1_gauge -= len(self.slots[slot])
        if self.free:
            slot = self.free.pop()
            self.slots[slot] = data
        else:
            slot = len(self.slots)
            self.slots.append(data)
        self.l1[key] = slot
        self.l1_gauge += len(data)

    def _remote_failed(self) -> None:
        if self.fault == "l1_buffers_released_on_remote_loss":
            # "they are safe in L2": released to the allocator, still indexed
            self.free.extend(self.l1[k] for k in self.l1 if k in self.l2)

    # ---- metrics ------------------------------------------------------------------------
    def metrics(self) -> MetricSnapshot:
        self._release_held()
        if self.fault == "usage_gauge_from_store_memory":
            usage = sum(self.store.memory_usage(k) for k in self.l2 if k in self.store.data)
        else:
            usage = self.gauge_bytes
        samples = {
            USAGE: {frozenset(): float(usage)},
            SUBMITTED: {frozenset(): float(self.submitted)},
            COMPLETED: {frozenset(): float(self.completed)},
            FAILED: {frozenset(): float(self.failed)},
            TASKS_SUBMITTED: {frozenset(): float(self.tasks_submitted)},
            TASKS_COMPLETED: {frozenset(): float(self.tasks_completed)},
            L1_USAGE: {frozenset(): float(self.l1_gauge)},
        }
        return MetricSnapshot(time.time(), samples)

    # ---- the remote tier (REMOTE_TIER) ----------------------------------------------------
    def _up(self) -> Store:
        if not self.store.up:
            raise EngineError(self.name, "the remote store is not running")
        return self.store

    @provides(RemoteStore)
    def remote_tier(self) -> RemoteStore:
        return DoubleStore(self)

    @provides(PersistentTier)
    def persistent_tier(self) -> PersistentTier:
        return StoreTier(self.remote_tier(), self.deployment.model.block_bytes(deployed_block_size(self)))


_DESYNC = frozenset({"truncated_value_desyncs_connection", "desynced_reads_served_and_rewritten"})
_LENGTH_ONLY = frozenset({"remote_checks_length_only", "desynced_reads_served_and_rewritten"})


class DoubleStore(RemoteStore):
    """The double's remote store, seen as the suite sees a real one."""

    def __init__(self, double: RemoteTierDouble) -> None:
        self.d = double

    def entries(self) -> dict[str, int]:
        self.d._release_held()
        return {k: len(v) for k, v in self.d._up().data.items() if k.startswith(PREFIX)}

    def objects_total(self) -> int:
        return len(self.d._up().data)

    def memory_usage(self, key: str) -> int:
        return self.d._up().memory_usage(key)

    def read(self, key: str) -> bytes:
        return self.d._up().data.get(key, b"")

    def write(self, key: str, data: bytes) -> None:
        self.d._up().data[key] = bytes(data)

    def capacity_bytes(self) -> int:
        return CAPACITY_CHUNKS * self.d.deployment.model.block_bytes(deployed_block_size(self.d))

    def wipe(self) -> None:
        self.d.stop()
        if not self.d.store.up:
            self.d.store = Store()
        self.d.store.data.clear()

    def pause_writes(self, seconds: float) -> None:
        self.d._up().paused_until = time.monotonic() + seconds

    def refuse_writes(self, refuse: bool) -> None:
        self.d._up().refusing = refuse

    def refused_writes(self) -> int:
        return self.d._up().refused

    def down(self) -> TeardownReport:
        self.d.store.up = False
        leftovers = []
        if self.d.fault == "remote_teardown_leaves_child":
            leftovers = ["redis-rdb-bgsave (remote double)"]
        return TeardownReport("remote store (double)", 0, 0.0, False, leftover_processes=leftovers)
