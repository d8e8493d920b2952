"""No KV block is ever released twice, and the event history is consistent.

One ledger for every engine that emits KV events: the resident set is rebuilt from
stored/removed/cleared alone and judged (removes of unknown or already-removed blocks,
sequence gaps), then compared with what the engine itself reports about its cached blocks
where it reports that. Abort paths (client disconnect mid-request, aborted transfer) run
while the ledger records.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from kvconform.contract import (
    CacheReset,
    EngineAdapter,
    EngineConfig,
    KvEvents,
    KvPool,
    KvTransfer,
    ReleaseGuard,
    StreamAborts,
    deployed_block_size,
    ensure,
    facet,
    metric_delta,
    read_metric,
)
from kvconform.contract import Capability as C
from kvconform.errors import EngineError
from kvconform.events import LedgerVerdict, judge
from kvconform.metrics import MetricSnapshot
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict
from kvconform.suites.prefix_reuse.test_eviction import fill_cache

IDLE_BOUND_S = 10.0
# A cut stream asks for far more tokens than are decoded by the time it is judged, so a request
# the engine never aborted is still running then (SGLang 0.5.18-0.5.19 dropped the abort of a
# disconnected stream: sgl-project/sglang#35255). Whether that holds is measured on the engine:
# an uncut stream must outlive the read (vLLM 0.32 on a CPU decodes 1536 tokens of the tiny
# model in 2.5-4.6 s). The live count is read until it is 0, up to the engine's own abort delay
# (SGLang waits 2 s) plus ABORT_GRACE_S: never past the time the probe showed a stream runs.
ABORT_MAX_TOKENS = 1536
ABORT_GRACE_S = 1.0
PROBE_MARGIN_S = 0.5  # the probe must outlive the read by this much: the cuts' own prefills
REMOVAL_KINDS = ("double_remove", "remove_unknown")


def ledger_mark(engine: EngineAdapter) -> int:
    """Where this check's events start: what earlier checks emitted is in the ledger first."""
    facet(engine, KvEvents).drain_events()
    return engine.ledger.mark()


def judge_ledger(engine: EngineAdapter, verdict: Verdict, mark: int) -> LedgerVerdict:
    """The ledger judged for the events from `mark` (taken when the check started) on."""
    filled = facet(engine, KvEvents).drain_events()
    judged = engine.ledger.judge(since=mark)
    verdict.record("events", judged.events)
    verdict.record("blocks_stored", judged.stored)
    verdict.record("blocks_removed", judged.removed)
    verdict.record("gaps_filled_from_replay", filled)
    # Copies of a hash (stored again while resident, removed while another copy stays) are the
    # engine's documented semantics where it keeps physical copies: recorded, not judged.
    verdict.record("hash_copies_stored", judged.restored_resident, "blocks")
    verdict.record("copies_removed_while_resident", judged.copies_removed_while_resident, "blocks")
    for kind in ("seq_gap", "seq_regress", "double_remove", "remove_unknown"):
        found = [v for v in judged.violations if v.kind == kind]
        shown = "; ".join(str(v) for v in found[:4])
        if kind.startswith("seq_") and not engine.traits.event_seq_from_engine:
            verdict.record(kind, len(found), note=f"numbered by the adapter, not by {engine.name}")
        elif kind in REMOVAL_KINDS and not judged.removed:
            # A workload that evicted nothing cannot fail these: recorded, never a pass.
            verdict.record(kind, len(found), note="not judged: no block was announced removed")
        else:
            verdict.equal(kind, len(found), 0, note=shown)
    return judged


@dataclass(frozen=True)
class AfterFill:
    """Resident blocks right after a fill past capacity, before anything resets the cache."""

    ledger: int  # by the ledger, every event emitted so far drained
    reported: int | None  # by the engine itself (None: it does not say)


def resident_after_fill(engine: EngineAdapter, mark: int) -> AfterFill:
    facet(engine, KvEvents).drain_events()
    return AfterFill(
        engine.ledger.judge(since=mark).resident_count(), facet(engine, KvPool).resident_blocks_reported()
    )


def compare_resident(
    engine: EngineAdapter, judged: LedgerVerdict, verdict: Verdict, after_fill: AfterFill | None
) -> None:
    """The ledger's resident set against the engine's own count of cached blocks: a block
    freed twice can be handed out twice and cached under two hashes, only one of which is
    ever announced removed. Judged right after a fill past capacity, where evictions the
    engine did not announce leave the ledger holding more than the engine (a reset later
    clears both and hides them), and again at the end. Where the engine reports no count,
    the pool bounds the ledger's resident blocks after the fill: more than the pool holds
    means evictions went unannounced (a router fed these events keeps routing to them)."""
    if after_fill is not None and after_fill.reported is not None:
        verdict.equal(
            "resident_blocks_ledger_vs_engine_after_fill",
            after_fill.ledger,
            after_fill.reported,
            "blocks",
            note="right after filling the cache past capacity: every eviction must have been announced",
        )
    elif after_fill is not None:
        pool = (
            facet(engine, KvPool).cache_capacity_tokens()
            // deployed_block_size(engine)
            * engine.traits.workers
        )
        verdict.expect(
            "resident_blocks_ledger_vs_pool",
            after_fill.ledger,
            "<=",
            pool,
            "blocks",
            note=f"after filling the cache past its {pool} blocks (the capacity the suite asked for): "
            "every block beyond them must have been announced removed",
        )
    reported = facet(engine, KvPool).resident_blocks_reported()
    if reported is not None:
        verdict.equal(
            "resident_blocks_ledger_vs_engine",
            judged.resident_count(),
            reported,
            "blocks",
            note="ledger rebuilt from events vs the engine's own cached-block count",
        )
    elif after_fill is None:
        verdict.record(
            "resident_blocks_ledger",
            judged.resident_count(),
            "blocks",
            note=f"engine {engine.name} does not report its cached blocks",
        )


@pytest.mark.requires(C.KV_EVENTS)
def test_event_ledger_consistent(
    engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict, has
) -> None:
    ensure(engine, EngineConfig())
    mark = ledger_mark(engine)
    block = deployed_block_size(engine)
    system = prompts.fresh(5 * block + 2)
    for i in range(6):
        engine.serve_prompt(prompts.extend(system, 8 * block + i))
    # A block-aligned prompt served twice: its last block is recomputed (the last-token rule)
    # into a second physical copy of a cached hash. An engine may announce each copy (vLLM
    # 0.32.0 does, block_pool.py NOTE #1): its removals must then balance its stores, never
    # outnumber them.
    aligned = prompts.fresh(4 * block)
    engine.serve_prompt(aligned)
    engine.serve_prompt(aligned)
    after_fill = None
    if has(C.FORCED_EVICTION):
        # where the engine counts its evictions: the fill's events from here, its counter from here
        start = (
            (ledger_mark(engine), engine.metrics()) if "evicted_tokens" in engine.traits.metric_map else None
        )
        fill_cache(engine, prompts, factor=1.5)
        after_fill = resident_after_fill(engine, mark)
        if start is not None:
            compare_evicted(engine, verdict, *start)
    if has(C.RESET_PREFIX_CACHE):
        facet(engine, CacheReset).reset_prefix_cache()
        engine.serve_prompt(prompts.extend(system, 7 * block))
    judged = judge_ledger(engine, verdict, mark)
    verdict.require("events_seen", judged.events, ">=", 1, note="the workload must produce events")
    compare_resident(engine, judged, verdict, after_fill)
    verdict.conclude()


def compare_evicted(engine: EngineAdapter, verdict: Verdict, fill_mark: int, before: MetricSnapshot) -> None:
    """The removals the fill's events announced against the engine's own count of the tokens
    it evicted: evictions it counts but does not announce leave a router's index stale."""
    evicted = metric_delta(engine, "evicted_tokens", before, engine.metrics())
    removed = judge(engine.ledger.since(fill_mark)).removed  # the fill's events alone
    verdict.require("tokens_evicted_by_fill", evicted, ">", 0, "tokens", note="the fill must force evictions")
    verdict.equal(
        "removed_tokens_vs_engine_evicted",
        removed * deployed_block_size(engine),
        evicted,
        "tokens",
        note="blocks announced removed during the fill x block size vs the engine's evicted-tokens counter",
    )


@pytest.mark.requires(C.ABORT_REQUESTS)
def test_abort_releases_kv_once(engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict, has) -> None:
    """Cut streams are aborted and release their KV; what judges it is what the engine has:
    its live request count, its KV usage gauge, its KV events (each part where it exists)."""
    ensure(engine, EngineConfig())
    events = has(C.KV_EVENTS)
    mark = ledger_mark(engine) if events else 0
    block = deployed_block_size(engine)
    refused = ""
    cut = 0
    # The read after the cuts can only fail if a request nobody aborted would still be running
    # then: an uncut stream of the same length must outlive the settle time.
    settle_s = engine.traits.abort_delay_s + ABORT_GRACE_S
    probe_s = settle_s + PROBE_MARGIN_S
    try:
        outlives = facet(engine, StreamAborts).stream_outlives(
            prompts.fresh(5 * block + 3), ABORT_MAX_TOKENS, probe_s
        )
    except EngineError as exc:
        outlives, refused = False, str(exc).splitlines()[0][:300]
    if not refused:
        verdict.require(
            "uncut_stream_outlives_settle",
            int(outlives),
            "==",
            1,
            note=f"a stream of {ABORT_MAX_TOKENS} tokens still ran {probe_s:.1f} s after it began "
            "(else a request never aborted would be done by the read: nothing could fail)",
        )
    for _ in range(0 if refused else 3):
        try:
            cut += int(
                facet(engine, StreamAborts).stream_and_disconnect(
                    prompts.fresh(5 * block + 3), after_chunks=2, max_tokens=ABORT_MAX_TOKENS
                )
                == 2
            )
        except EngineError as exc:  # judged below: the engine must serve after an abort
            refused = str(exc).splitlines()[0][:300]
            break
    in_flight: int | None = None
    if refused:  # never a pass: the aborts could not be judged (a wedged engine also fails below)
        why = f"after {cut} cut streams: {refused}"
        verdict.require("streams_served_for_the_aborts", 0, "==", 1, note=why)
    else:
        verdict.require(
            "streams_cut_mid_way", cut, "==", 3, note="each dropped after 2 token chunks, before its end"
        )
        deadline = time.monotonic() + settle_s
        in_flight = facet(engine, StreamAborts).requests_in_flight()
        while in_flight and time.monotonic() < deadline:
            time.sleep(0.1)
            in_flight = facet(engine, StreamAborts).requests_in_flight()
        if in_flight is None:
            verdict.record("requests_in_flight_after_disconnects", "no live count", note="not judged")
        else:
            verdict.equal(
                "requests_in_flight_after_disconnects",
                in_flight,
                0,
                "requests",
                note=f"read until 0, up to {settle_s:.1f} s after the cuts ({ABORT_MAX_TOKENS} tokens each)",
            )
    if has(C.TRANSFER_ACCOUNTING) and (transfer := facet(engine, KvTransfer)).aborts:
        transfer.transfer(prompts.fresh(4 * block + 1), transfer.layouts[0], 1, 1, abort_after_pages=3)
    if "kv_usage" in engine.traits.metric_map:
        # Read once, at the bound: polled until it reads 0, a gauge that dips to 0 between
        # reports and comes back would pass.
        idle_s = IDLE_BOUND_S + engine.traits.idle_gauge_refresh_s
        time.sleep(idle_s)
        verdict.equal(
            "kv_usage_after_aborts",
            read_metric(engine, "kv_usage", engine.metrics()),
            0.0,
            note=f"aborted requests must release their blocks (read once, {idle_s:.0f} s after the cuts)",
        )
    else:
        verdict.record("kv_usage_after_aborts", "no KV usage gauge", note=f"engine {engine.name} has none")
    fresh = prompts.fresh(3 * block)
    try:
        served, why = engine.serve_prompt(fresh).prompt_tokens, ""
    except EngineError as exc:  # an engine wedged by the aborts answers with an error
        served, why = 0, str(exc).splitlines()[0][:300]
    why = "; ".join(w for w in (f"during the aborts: {refused}" if refused else "", why) if w)
    verdict.equal("engine_serves_after_aborts", served, len(fresh), "tokens", note=why)
    if not events:
        # Without events, what shows a request the engine never released is its live count or
        # its usage gauge: an engine with neither could only be judged on serving again.
        if not refused:
            verdict.require(
                "release_measures",
                int(in_flight is not None) + int("kv_usage" in engine.traits.metric_map),
                ">=",
                1,
                note="a live request count or a KV usage gauge; the engine has no KV events",
            )
        verdict.conclude()
        return
    after_fill = None
    if served and has(C.FORCED_EVICTION):
        fill_cache(engine, prompts, factor=1.5)  # a doubly freed block shows once evicted
        after_fill = resident_after_fill(engine, mark)
    judged = judge_ledger(engine, verdict, mark)
    verdict.require("events_seen", judged.events, ">=", 1, note="the requests must produce events")
    compare_resident(engine, judged, verdict, after_fill)
    verdict.conclude()


@pytest.mark.requires(C.RELEASE_GUARD)
def test_release_guard_holds(engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict) -> None:
    """Drive the engine's own release path twice for one request: the first release returns
    every slot the request held; the second is refused or ignored, never an assertion (which
    ends a production scheduler, and is stripped under python -O), and frees nothing more."""
    ensure(engine, EngineConfig())
    block = deployed_block_size(engine)
    tokens = prompts.fresh(3 * block + 2)
    guard = facet(engine, ReleaseGuard)
    result = guard.release_twice(tokens)
    verdict.record("second_release_outcome", result.second_outcome)
    verdict.record("detail", result.detail)
    if guard.releases_cached_prefix:
        held, what = len(tokens) // block * block, "holds its cached prefix's whole blocks"
    else:
        held, what = -(-len(tokens) // block) * block, "(fresh) holds whole blocks, the partial last one too"
    verdict.equal(
        "first_release_freed_tokens",
        result.first_freed_tokens,
        held,
        "tokens",
        note=f"a {len(tokens)}-token prompt {what} of {block}: all go back on the first release",
    )
    verdict.equal(
        "second_release_crashed",
        int(result.second_outcome == "crashed"),
        0,
        note="an assertion in the release path is a crash, not a guard",
    )
    verdict.equal("blocks_freed_by_second_release", result.free_delta_on_second, 0, "blocks")
    verdict.conclude()
