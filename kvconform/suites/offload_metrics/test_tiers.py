"""Tiered-store metrics agree with what the tiers really hold.

The persistent tier receives each fresh block once: the entries that appear in it hold the
fresh prompts' full blocks at the model's KV size (a bounded tier may evict older entries to
make room; those are not the check's). Each L2 metric the engine exports is judged (an engine
exports some of them, never necessarily all): store counts (submitted >= completed at every
scrape, equal once idle, completed = fresh blocks), the L2 usage gauge (moves by the tier's net
change), the L2 written-bytes counter (moves by the bytes of the entries that appeared), lookup
hits (the repeats' full blocks) and the L1 usage ratio (L1 bytes over the L1 capacity the suite
set).
"""

from __future__ import annotations

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import (
    EngineAdapter,
    EngineConfig,
    KvPool,
    PersistentTier,
    deployed_block_size,
    ensure,
    facet,
    metric_delta,
    read_metric,
)
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict

# what an engine with tiered-store metrics reports of its persistent tier: at least one of them
L2_ACCOUNTING = ("l2_store_completed", "l2_usage_bytes", "l2_written_bytes")

pytestmark = [pytest.mark.requires(C.TIERED_STORE_METRICS), pytest.mark.engine_config(persistent=True)]


def test_tiered_store_metrics_consistent(
    engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict
) -> None:
    ensure(engine, EngineConfig(persistent=True))
    names = engine.traits.metric_map
    judged = [name for name in L2_ACCOUNTING if name in names]
    if not judged:
        pytest.fail(f"{engine.name} declares {C.TIERED_STORE_METRICS} but maps none of {L2_ACCOUNTING}")
    tier = facet(engine, PersistentTier)
    entries_before = tier.sizes()
    before = engine.metrics()
    block = deployed_block_size(engine)
    batch = [prompts.fresh(4 * block + 7) for _ in range(4)]
    during = []
    for tokens in batch:
        engine.serve_prompt(tokens)
        during.append(engine.metrics())
    tier.flush()
    for tokens in batch:
        engine.serve_prompt(tokens)
    after = engine.metrics()
    entries_after = tier.sizes()
    disk_delta = sum(entries_after.values()) - sum(entries_before.values())
    # a bounded tier may evict older entries to hold the new ones: what appeared is judged
    appeared = sum(size for key, size in entries_after.items() if key not in entries_before)

    full_blocks = sum(len(tokens) // block for tokens in batch)
    verdict.equal(
        "disk_bytes_delta",
        appeared,
        full_blocks * tier.block_bytes(),
        "bytes",
        note=f"bytes of the entries that appeared: {full_blocks} fresh full blocks, each persisted "
        f"once (the repeats store nothing); net change {disk_delta} (older entries evicted: "
        f"{sum(1 for key in entries_before if key not in entries_after)})",
    )
    if "l2_store_completed" in names:
        # A scrape reads its counters one after the other (an OpenTelemetry reader does), so a
        # store submitted and completed between the two reads shows completed above submitted
        # in that one scrape. Submitted only grows: the next scrape's submitted bounds every
        # completion the scrape before it saw.
        lagging = [
            (read_metric(engine, "l2_store_completed", s), read_metric(engine, "l2_store_submitted", nxt))
            for s, nxt in zip(during, [*during[1:], after], strict=True)
            if read_metric(engine, "l2_store_completed", s) > read_metric(engine, "l2_store_submitted", nxt)
        ]
        verdict.equal(
            "scrapes_with_completed_above_submitted",
            len(lagging),
            0,
            note=f"a scrape's completed vs the next one's submitted (was: the same one's): {lagging[:3]}",
        )
        verdict.equal(
            "l2_submitted_minus_completed_at_idle",
            read_metric(engine, "l2_store_submitted", after)
            - read_metric(engine, "l2_store_completed", after),
            0,
        )
        verdict.equal(
            "l2_stores_completed",
            metric_delta(engine, "l2_store_completed", before, after),
            full_blocks,
            "objects",
            note=f"{len(batch)} fresh prompts' full blocks, each stored once",
        )
    if "l2_usage_bytes" in names:
        verdict.equal(
            "l2_usage_bytes_delta",
            metric_delta(engine, "l2_usage_bytes", before, after),
            disk_delta,
            "bytes",
            note="gauge movement vs the tier's net change in bytes",
        )
        verdict.record(
            "l2_usage_minus_disk_bytes",
            read_metric(engine, "l2_usage_bytes", after) - sum(entries_after.values()),
            "bytes",
            note="absolute difference (an engine may count only what this process wrote)",
        )
    if "l2_written_bytes" in names:
        verdict.equal(
            "l2_written_bytes_delta",
            metric_delta(engine, "l2_written_bytes", before, after),
            appeared,
            "bytes",
            note="counter movement vs the bytes of the entries that appeared (fresh blocks "
            "only: a store of a block already on disk may count without writing)",
        )
    if "lookup_requested_tokens" in names:
        requested = metric_delta(engine, "lookup_requested_tokens", before, after)
        hits = metric_delta(engine, "lookup_hit_tokens", before, after)
        verdict.record("lookup_requested_tokens_delta", requested, "tokens")
        verdict.equal(
            "lookup_hit_tokens_delta",
            hits,
            full_blocks * block,
            "tokens",
            note="the repeats hit each fresh prompt's full blocks, the first pass nothing "
            "(was: <= the engine's own requested count)",
        )
    if "l1_usage_ratio" in names:
        ratio = read_metric(engine, "l1_usage_ratio", after)
        expected = read_metric(engine, "l1_usage_bytes", after) / facet(engine, KvPool).kv_pool_bytes()
        verdict.equal(
            "l1_usage_ratio",
            ratio,
            expected,
            abs_tol=1e-6,
            note="L1 bytes / the L1 capacity the suite configured",
        )
    verdict.conclude()
