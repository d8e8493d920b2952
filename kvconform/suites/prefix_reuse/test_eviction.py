"""Eviction hygiene: an evicted prefix is not reported as a hit, in the response or in the
engine's counters (a prefix index not cleaned on eviction reports phantom hits)."""

from __future__ import annotations

import time

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, EngineConfig, KvPool, deployed_block_size, ensure, facet
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict
from kvconform.suites.prefix_reuse.counters import queried_tokens, wait_counted

pytestmark = pytest.mark.requires(C.PREFIX_CACHE, C.FORCED_EVICTION)


def fill_cache(engine: EngineAdapter, prompts: PromptFactory, factor: float = 2.0) -> int:
    """Serve unrelated prompts totalling `factor` x the cache capacity; returns tokens served.

    With several workers behind a router, each worker must receive `factor` x its own
    capacity: the router spreads fresh prompts at random, so we send 2 x workers x that
    (with 16+ prompts per worker, a worker getting under half its share is vanishingly rare).
    """
    capacity = facet(engine, KvPool).cache_capacity_tokens()  # per worker
    length = min(1024, max(capacity // 8, deployed_block_size(engine) * 4))
    total = factor * capacity * (1 if engine.traits.workers == 1 else 2 * engine.traits.workers)
    # An engine that evicts from a periodic loop drops stores into a full cache until the loop
    # runs: give it that loop once the cache is full and once at the end, so the prompts
    # served before the fill are the least recently used when it evicts.
    pause = 2.5 * engine.traits.eviction_period_s
    served, paused = 0, False
    while served < total:
        engine.serve_prompt(prompts.fresh(length))
        served += length
        if pause and not paused and served >= total / factor:
            time.sleep(pause)
            paused = True
    time.sleep(pause)
    return served


def test_evicted_prefix_not_reported_as_hit(
    engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict, has
) -> None:
    ensure(engine, EngineConfig())
    block = deployed_block_size(engine)
    target = prompts.fresh(8 * block)
    cold = engine.serve_prompt(target)
    filler = fill_cache(engine, prompts)
    verdict.record(
        "filler_tokens",
        filler,
        "tokens",
        note=f"capacity {facet(engine, KvPool).cache_capacity_tokens()} per worker, "
        f"{engine.traits.workers} worker(s)",
    )
    before = engine.metrics() if has(C.PREFIX_HIT_COUNTERS) else None
    again = engine.serve_prompt(target)
    verdict.equal(
        "cached_tokens_after_eviction",
        again.cached_tokens,
        0,
        "tokens",
        note="every block of the prefix was evicted by 2x capacity of other prompts",
    )
    verdict.record("output_identical_to_cold_run", int(again.output == cold.output))
    if before is not None:
        queried, hits = wait_counted(engine, before, queried_tokens(engine, len(target)))
        verdict.equal("queried_tokens_counter_delta", queried, queried_tokens(engine, len(target)), "tokens")
        verdict.equal("hit_tokens_counter_delta", hits, 0, "tokens", note="nothing of the prefix is cached")
    verdict.conclude()
