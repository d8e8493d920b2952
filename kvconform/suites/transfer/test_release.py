"""No KV block is ever released twice, and the event history is consistent.

One ledger for every engine that emits KV events: the resident set is rebuilt from
stored/removed/cleared alone and judged (removes of unknown or already-removed blocks,
sequence gaps), then compared with what the engine itself reports about its cached blocks
where it reports that. Abort paths (client disconnect mid-request, aborted transfer) run
while the ledger records.
"""

from __future__ import annotations

import time

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, EngineConfig
from kvconform.events import LedgerVerdict
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict
from kvconform.suites.prefix_reuse.test_eviction import fill_cache

IDLE_BOUND_S = 10.0


def judge_ledger(engine: EngineAdapter, verdict: Verdict) -> LedgerVerdict:
    filled = engine.drain_events()
    judged = engine.ledger.judge()
    verdict.record("events", judged.events)
    verdict.record("blocks_stored", judged.stored)
    verdict.record("blocks_removed", judged.removed)
    verdict.record("gaps_filled_from_replay", filled)
    for kind in ("seq_gap", "seq_regress", "double_remove", "remove_unknown"):
        found = [v for v in judged.violations if v.kind == kind]
        verdict.equal(kind, len(found), 0, note="; ".join(str(v) for v in found[:4]))
    return judged


@pytest.mark.requires(C.KV_EVENTS)
def test_event_ledger_consistent(
    engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict, has
) -> None:
    engine.ensure(EngineConfig())
    block = engine.block_size()
    system = prompts.fresh(5 * block + 2)
    for i in range(6):
        engine.serve_prompt(prompts.extend(system, 8 * block + i))
    if has(C.FORCED_EVICTION):
        fill_cache(engine, prompts, factor=1.5)
    if has(C.RESET_PREFIX_CACHE):
        engine.reset_prefix_cache()
        engine.serve_prompt(prompts.extend(system, 7 * block))
    judged = judge_ledger(engine, verdict)
    verdict.expect("events_seen", judged.events, ">=", 1, note="the workload must produce events")
    reported = engine.resident_blocks_reported()
    if reported is not None:
        verdict.equal(
            "resident_blocks_ledger_vs_engine",
            judged.resident_count(),
            reported,
            "blocks",
            note="ledger rebuilt from events vs the engine's own cached-block count",
        )
    else:
        verdict.record(
            "resident_blocks_ledger",
            judged.resident_count(),
            "blocks",
            note=f"engine {engine.name} does not report its cached blocks",
        )
    verdict.conclude()


@pytest.mark.requires(C.ABORT_REQUESTS, C.KV_EVENTS)
def test_abort_releases_kv_once(engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict, has) -> None:
    engine.ensure(EngineConfig())
    block = engine.block_size()
    for _ in range(3):
        engine.stream_and_disconnect(prompts.fresh(5 * block + 3), after_chunks=2)
    if has(C.TRANSFER_ACCOUNTING):
        engine.transfer(prompts.fresh(4 * block + 1), engine.transfer_layouts[0], 1, 1, abort_after_pages=3)
    t0 = time.monotonic()
    deadline = t0 + IDLE_BOUND_S + engine.idle_gauge_refresh_s
    usage = engine.metric("kv_usage", engine.metrics())
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
        usage = engine.metric("kv_usage", engine.metrics())
    verdict.equal(
        "kv_usage_after_aborts",
        usage,
        0.0,
        note=f"aborted requests must release their blocks (read after {time.monotonic() - t0:.1f} s idle)",
    )
    after = engine.serve_prompt(prompts.fresh(3 * block))
    verdict.equal("engine_serves_after_aborts", int(after.prompt_tokens > 0), 1)
    if has(C.FORCED_EVICTION):
        fill_cache(engine, prompts, factor=1.5)  # a doubly freed block shows once evicted
    judge_ledger(engine, verdict)
    verdict.conclude()


@pytest.mark.requires(C.RELEASE_GUARD)
def test_release_guard_holds(engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict) -> None:
    """Drive the engine's own release path twice for one request: the first release returns
    every slot the request held; the second is refused or ignored, never an assertion (which
    ends a production scheduler, and is stripped under python -O), and frees nothing more."""
    engine.ensure(EngineConfig())
    block = engine.block_size()
    tokens = prompts.fresh(3 * block + 2)
    result = engine.release_twice(tokens)
    verdict.record("second_release_outcome", str(result["second_outcome"]))
    verdict.record("detail", str(result.get("detail", "")))
    verdict.equal(
        "first_release_freed_tokens",
        result["first_freed_tokens"],
        -(-len(tokens) // block) * block,
        "tokens",
        note=f"a fresh {len(tokens)}-token prompt holds whole blocks of {block}: all go back",
    )
    verdict.equal(
        "second_release_crashed",
        int(result["second_outcome"] == "crashed"),
        0,
        note="an assertion in the release path is a crash, not a guard",
    )
    verdict.equal("blocks_freed_by_second_release", result["free_delta_on_second"], 0, "blocks")
    verdict.conclude()
