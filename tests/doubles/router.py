"""Test double for ROUTER_PREDICTION (+ PREFIX_CACHE, FORCED_EVICTION): a KV-aware router in
front of one worker with a paged prefix cache.

Not an engine. The worker caches full blocks under chained hashes, evicts cached blocks LRU
when its pool is full and always recomputes the prompt's last token (a repeated prompt of n
tokens hits floor((n - 1) / block) blocks); every stored block and every eviction is a KV
event. The router applies the events to its own index and predicts, for a prompt, the longest
chain of its full blocks the index holds (cached blocks: a router models no engine's
last-token rule); it counts the events it
applied by status, as Dynamo's kv_cache_events_applied{status} does ("ok", "block_not_found",
...), and the blocks of requests in flight (active_blocks). router_event_status(before, after)
reads the event counters from two metric snapshots.
"""

from __future__ import annotations

import hashlib
import time
from collections import Counter, OrderedDict
from typing import Any, ClassVar

from kvconform.contract import (
    Capability,
    EngineTraits,
    KvPool,
    KvRouter,
    MetricMap,
    ServedPrompt,
    deployed_block_size,
)
from kvconform.engines.reference.faults import Fault
from kvconform.metrics import MetricSnapshot
from tests.doubles.base import DoubleAdapter

_CHECK = ("prefix_reuse::test_router_prediction_matches_worker",)
EVENTS_METRIC = "router_kv_events_applied"
ACTIVE_METRIC = "router_active_blocks"
NUM_BLOCKS = 64

FAULTS: dict[str, Fault] = {
    "router_applies_no_events": Fault(
        "the router never receives the worker's KV events (subscribed to nothing): its index "
        "stays empty, it predicts 0 and its applied-events counter stays at 0",
        _CHECK,
        "a router whose event subscription is misconfigured (Dynamo kv_cache_events_applied "
        "with no ok events)",
        ("predictions_off_oracle", "router_events_applied_ok"),
    ),
    "router_drops_removed_events": Fault(
        "the router fails to apply removed events (status block_not_found) and keeps the "
        "evicted blocks in its index, so it predicts prefixes the worker no longer holds",
        _CHECK,
        "Dynamo RadixTree dropping removals it cannot place (stale router state)",
        ("predictions_off_oracle", "router_events_not_applied_ok"),
    ),
    "active_blocks_never_drain": Fault(
        "the router adds a request's blocks to its active-block count and never subtracts them "
        "when the request finishes",
        _CHECK,
        "Dynamo #11644: active blocks of finished requests never drain to 0",
        ("active_blocks_after_requests",),
    ),
}


def chain_hashes(tokens: list[int], block: int) -> list[str]:
    out: list[str] = []
    parent = ""
    for start in range(0, len(tokens) - len(tokens) % block, block):
        parent = hashlib.sha256(f"{parent}:{tokens[start : start + block]}".encode()).hexdigest()[:24]
        out.append(parent)
    return out


class Worker:
    """A paged prefix cache: cached blocks are LRU-evicted when a request needs room."""

    def __init__(self, num_blocks: int, block: int) -> None:
        self.num_blocks = num_blocks
        self.block = block
        self.cached: OrderedDict[str, None] = OrderedDict()
        self.events: list[dict[str, Any]] = []

    def serve(self, tokens: list[int]) -> int:
        hashes = chain_hashes(tokens, self.block)
        matchable = (len(tokens) - 1) // self.block
        hit = 0
        for h in hashes[:matchable]:
            if h not in self.cached:
                break
            hit += 1
        for h in hashes[:hit]:
            self.cached.move_to_end(h)
        stored = []
        for h in hashes[hit:]:
            if h in self.cached:
                self.cached.move_to_end(h)
                continue
            while len(self.cached) >= self.num_blocks:
                evicted, _ = self.cached.popitem(last=False)
                self.events.append({"type": "removed", "hashes": [evicted]})
            self.cached[h] = None
            stored.append(h)
        if stored:
            self.events.append({"type": "stored", "hashes": stored})
        return hit * self.block


class Router:
    def __init__(self, fault: str | None, block: int) -> None:
        self.fault = fault
        self.block = block
        self.index: set[str] = set()
        self.applied: Counter[str] = Counter()
        self.active_blocks = 0

    def apply(self, events: list[dict[str, Any]]) -> None:
        if self.fault == "router_applies_no_events":
            return
        for event in events:
            if event["type"] == "stored":
                self.index.update(event["hashes"])
                self.applied["ok"] += 1
            elif self.fault == "router_drops_removed_events":
                self.applied["block_not_found"] += 1
            else:
                self.index.difference_update(event["hashes"])
                self.applied["ok"] += 1

    def predict(self, tokens: list[int]) -> int:
        hashes = chain_hashes(tokens, self.block)
        matched = 0
        for h in hashes:
            if h not in self.index:
                break
            matched += 1
        return matched * self.block


class RouterDouble(DoubleAdapter, KvPool, KvRouter):
    """Test double (not an engine) for ROUTER_PREDICTION over one prefix-caching worker."""

    name = "testdouble_router"
    capabilities = frozenset(
        {Capability.PREFIX_CACHE, Capability.FORCED_EVICTION, Capability.ROUTER_PREDICTION}
    )
    faults: ClassVar[dict[str, Fault]] = FAULTS
    traits = EngineTraits(
        metric_map=MetricMap(
            names={"active_blocks": ACTIVE_METRIC},
        )
    )

    def start(self, config: Any) -> None:
        super().start(config)
        self.worker = Worker(NUM_BLOCKS, deployed_block_size(self))
        self.router = Router(self.fault, deployed_block_size(self))

    def running(self) -> bool:
        return self.config is not None

    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        cached = self.worker.serve(tokens)
        events, self.worker.events = self.worker.events, []
        self.router.apply(events)
        return ServedPrompt(len(tokens), cached, [1] * max_tokens)

    def serve_routed(self, tokens: list[int]) -> tuple[int, ServedPrompt]:
        predicted = self.router.predict(tokens)
        blocks = -(-len(tokens) // deployed_block_size(self))
        self.router.active_blocks += blocks  # the request is in flight on its worker
        served = self.serve_prompt(tokens)
        if self.fault != "active_blocks_never_drain":
            self.router.active_blocks -= blocks
        return predicted, served

    def cache_capacity_tokens(self) -> int:
        return NUM_BLOCKS * deployed_block_size(self)

    def metrics(self) -> MetricSnapshot:
        rows = {frozenset({("status", s)}): float(n) for s, n in self.router.applied.items()}
        samples = {ACTIVE_METRIC: {frozenset(): float(self.router.active_blocks)}}
        if rows:
            samples[EVENTS_METRIC] = rows
        return MetricSnapshot(time.time(), samples)

    def router_event_status(self, before: MetricSnapshot, after: MetricSnapshot) -> dict[str, float]:
        """Events applied between the snapshots, by status; the counter exists from the
        router's start (0 before any event), as a registered Prometheus counter does."""
        statuses = {dict(k)["status"] for k in after.samples.get(EVENTS_METRIC, {})} | {"ok"}
        return {
            s: after.value(EVENTS_METRIC, 0.0, status=s) - before.value(EVENTS_METRIC, 0.0, status=s)
            for s in sorted(statuses)
        }
