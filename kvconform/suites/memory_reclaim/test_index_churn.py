"""A router's prefix index gives its memory back when blocks are evicted.

A router index lives as long as the router and sees every block every worker stores and
evicts. The workload is a worker's steady state: a shared prefix stays stored while suffix
chains are stored under it and evicted again, cycle after cycle. After each cycle the index
holds what it held before, so the index process's resident memory must not grow with the
cycles (Dynamo 1.5.1: evicted branches kept alive by parent links, ~100 B per evicted block,
fixed in 1.6.0 by ai-dynamo/dynamo#14878). The shared prefix must still match afterwards (a
precondition: an index that dropped it would have nothing left to leak; wrong matches are
prefix_reuse::test_radix_index_matches_model's to judge).

RSS is read by the suite (the kernel's count for the index's process), never the engine's
report. Allocator noise does not grow steadily with the cycles; the Theil-Sen slope after a
warm-up is judged against a quarter of the smallest plausible leaked node (64 bytes).
"""

from __future__ import annotations

import hashlib

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, IndexBlock, IndexEvent, RouterIndex, facet
from kvconform.oracles import theil_sen
from kvconform.results import Verdict

pytestmark = pytest.mark.requires(C.RADIX_INDEX)

WORKER = 1
SHARED_BLOCKS = 4
SUFFIX_BLOCKS = 8
CYCLES = 24_000
CYCLES_PER_BATCH = 600
WARMUP_BATCHES = 8
SLOPE_BOUND_BYTES_PER_BLOCK = 16.0  # a quarter of the smallest leaked node (64 B)


def block_hash(*key: object) -> int:
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "big") >> 1


def stored(parent: int | None, hashes: list[int], event_id: int) -> IndexEvent:
    blocks = tuple(IndexBlock(h, tokens_hash=h ^ 0x5A5A) for h in hashes)
    return IndexEvent("stored", WORKER, event_id, parent=parent, blocks=blocks)


def test_radix_index_memory_flat_under_eviction_churn(engine: EngineAdapter, verdict: Verdict) -> None:
    tree = "index-churn"
    index = facet(engine, RouterIndex)
    index.new_tree(tree)
    shared = [block_hash("shared", i) for i in range(SHARED_BLOCKS)]
    rss: list[float] = []
    rejected = index.apply(tree, [stored(None, shared, 0)]).rejected
    event_id = 1
    for batch in range(CYCLES // CYCLES_PER_BATCH):
        events: list[IndexEvent] = []
        for cycle in range(batch * CYCLES_PER_BATCH, (batch + 1) * CYCLES_PER_BATCH):
            suffix = [block_hash("suffix", cycle, i) for i in range(SUFFIX_BLOCKS)]
            events.append(stored(shared[-1], suffix, event_id))
            events.append(IndexEvent("removed", WORKER, event_id + 1, hashes=tuple(suffix)))
            event_id += 2
        rejected += index.apply(tree, events).rejected
        rss.append(float(index.resident_bytes()))
    matched = index.match(tree, [h ^ 0x5A5A for h in shared]).get(WORKER, 0)
    evicted_per_batch = CYCLES_PER_BATCH * SUFFIX_BLOCKS
    trend = theil_sen(rss[WARMUP_BATCHES:])
    verdict.record("cycles", CYCLES, note=f"{SUFFIX_BLOCKS} blocks stored and evicted under a shared prefix")
    verdict.require("events_rejected", rejected, "<=", 0, note="every store and eviction must be applied")
    verdict.require(
        "shared_prefix_blocks_matched", matched, "==", SHARED_BLOCKS, note="the prefix stays stored"
    )
    verdict.record("index_rss_growth", rss[-1] - rss[0], "bytes")
    verdict.add_series("index process RSS per batch", [(float(i), v) for i, v in enumerate(rss)])
    verdict.expect(
        "index_rss_slope_per_evicted_block",
        trend.slope / evicted_per_batch,
        "<=",
        SLOPE_BOUND_BYTES_PER_BLOCK,
        "bytes/block",
        better="lower",
        note=f"Theil-Sen over batches {WARMUP_BATCHES}..{len(rss) - 1} of {CYCLES_PER_BATCH} cycles",
    )
    verdict.conclude()
