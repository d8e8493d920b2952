"""The engine's own KV block-pool numbers add up, iteration by iteration.

Each iteration the engine reports its pool (max / free / used blocks) and its prefix-reuse
counters (reused / missed blocks, hit rate). Two identities must hold in every iteration,
whatever the load: used + free == max, and hit_rate == reused / (reused + missed) (0 when
nothing was looked up). Where the counters are cumulative (since engine start), they may never
decrease between two iterations; where they are per iteration, the identity holds per row.
A pool that leaks a block, or a hit rate computed over another window than its own counters,
sends an operator sizing caches after the wrong number.

The counters themselves are judged against our oracle of the workload, exactly: PROMPTS
prompts share a prefix of 4 whole blocks + 3 tokens, so each prompt after the first reuses
exactly floor(shared / block) blocks (the last prompt token is always computed, and the
prompts are longer than the prefix), and misses every other block it touches
(ceil(len / block) - reused). The pool's block size is what the suite asked for.
"""

from __future__ import annotations

import itertools
import time

import pytest

from kvconform.contract import (
    BlockPoolStats,
    EngineAdapter,
    EngineConfig,
    KvPool,
    deployed_block_size,
    ensure,
    facet,
)
from kvconform.contract import Capability as C
from kvconform.oracles import pages
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict

pytestmark = pytest.mark.requires(C.BLOCK_POOL_STATS)

HIT_RATE_TOL = 1e-4  # engines may publish the rate as a float32
SETTLE_S = 10.0
PROMPTS = 4


def expected_hit_rate(stats: BlockPoolStats) -> float:
    looked_up = stats.reused_blocks + stats.missed_blocks
    return stats.reused_blocks / looked_up if looked_up else 0.0


def settled_stats(engine: EngineAdapter, before: int) -> list[BlockPoolStats]:
    """Iterations are published asynchronously: wait for new ones, then until none arrive."""
    deadline = time.monotonic() + SETTLE_S
    pools = facet(engine, KvPool).block_pool_stats()
    while len(pools) <= before and time.monotonic() < deadline:
        time.sleep(0.2)
        pools = facet(engine, KvPool).block_pool_stats()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        more = facet(engine, KvPool).block_pool_stats()
        if len(more) == len(pools):
            break
        pools = more
    return pools


def _describe(stats: BlockPoolStats) -> str:
    return (
        f"iteration {stats.iteration}: max={stats.max_blocks} free={stats.free_blocks} "
        f"used={stats.used_blocks} reused={stats.reused_blocks} missed={stats.missed_blocks} "
        f"hit_rate={stats.hit_rate:.6g} (expected {expected_hit_rate(stats):.6g})"
    )


def test_block_pool_stats_consistent(engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict) -> None:
    ensure(engine, EngineConfig())
    block = deployed_block_size(engine)  # what the suite asked for (the adapter's default config)
    # One unrelated request first, so cumulative counters have a baseline iteration of this
    # run (an engine's own warm-up may already be counted in them).
    engine.serve_prompt(prompts.fresh(2 * block))
    before_pools = settled_stats(engine, len(facet(engine, KvPool).block_pool_stats()) - 1)
    before = len(before_pools)
    shared = prompts.fresh(4 * block + 3)
    workload = [prompts.extend(shared, 6 * block + i) for i in range(PROMPTS)]
    for tokens in workload:
        engine.serve_prompt(tokens)
    reusable = len(shared) // block  # < (len(tokens) - 1) // block for every prompt
    expected_reused = (PROMPTS - 1) * reusable
    expected_missed = sum(pages(len(t), block) for t in workload) - expected_reused
    pools = settled_stats(engine, before)
    new = pools[before:]

    bad_sum = [s for s in new if s.used_blocks + s.free_blocks != s.max_blocks]
    bad_rate = [s for s in new if abs(s.hit_rate - expected_hit_rate(s)) > HIT_RATE_TOL]
    cumulative = all(s.cumulative for s in new)
    decreasing = [
        b
        for a, b in itertools.pairwise(([before_pools[-1]] if before_pools else []) + new)
        if cumulative and (b.reused_blocks < a.reused_blocks or b.missed_blocks < a.missed_blocks)
    ]
    if cumulative:
        start = before_pools[-1] if before_pools else None
        reuse = max((s.reused_blocks for s in new), default=0) - (start.reused_blocks if start else 0)
        missed = max((s.missed_blocks for s in new), default=0) - (start.missed_blocks if start else 0)
    else:
        reuse = sum(s.reused_blocks for s in new)
        missed = sum(s.missed_blocks for s in new)

    verdict.record("block_size", block, "tokens")
    verdict.record("counters", "cumulative" if cumulative else "per-iteration")
    verdict.record("iterations_seen", len(new))
    if new:
        last = new[-1]
        verdict.record("max_blocks", last.max_blocks, "blocks")
        verdict.record("tokens_per_block", last.tokens_per_block, "tokens")
        verdict.record("last_hit_rate", last.hit_rate)
    verdict.require(
        "iterations_reported", len(new), ">=", 1, note="the requests must produce iteration stats"
    )
    if new:
        verdict.equal(
            "pool_tokens_per_block_vs_requested",
            new[-1].tokens_per_block,
            block,
            "tokens",
            note="the block size the suite asked for; an engine forcing another fails here",
        )
    verdict.equal(
        "reused_blocks_during_run",
        reuse,
        expected_reused,
        "blocks",
        note=f"{PROMPTS} prompts share {len(shared)} tokens: {PROMPTS - 1} x floor({len(shared)}/{block})",
    )
    verdict.equal(
        "missed_blocks_during_run",
        missed,
        expected_missed,
        "blocks",
        note="sum of ceil(len/block) over the prompts, less the reused blocks",
    )
    verdict.equal(
        "iterations_used_plus_free_not_max",
        len(bad_sum),
        0,
        note=_describe(bad_sum[0]) if bad_sum else "",
    )
    verdict.equal(
        "iterations_hit_rate_not_reused_over_lookups",
        len(bad_rate),
        0,
        note=_describe(bad_rate[0]) if bad_rate else "",
    )
    verdict.equal(
        "iterations_cumulative_counter_decreased",
        len(decreasing),
        0,
        note=_describe(decreasing[0]) if decreasing else "",
    )
    used = [(float(i), float(s.used_blocks)) for i, s in enumerate(new)]
    verdict.add_series("used blocks per iteration", used)
    verdict.add_series("hit rate per iteration", [(float(i), s.hit_rate) for i, s in enumerate(new)])
    verdict.conclude()
