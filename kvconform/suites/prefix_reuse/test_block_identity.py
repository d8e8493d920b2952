"""A prefix block has one identity across engine processes.

The block hashes an engine announces in its KV events are what routers and shared KV tiers
key on: the same tokens must hash the same in the next process of the engine (after a
restart, on another node), or every index built from the first process's events, and every
block a shared tier stored under them, is never found again. The same prompt is served by
both processes: every hash the first announced for it (at least one per whole block) must be
announced again by the second.
"""

from __future__ import annotations

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, EngineConfig, deployed_block_size, ensure, restart
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict
from kvconform.suites.prefix_reuse.announced import stored_while

pytestmark = pytest.mark.requires(C.PREFIX_CACHE, C.KV_EVENTS, C.RESTART)


def _stored_by_prompt(engine: EngineAdapter, prompt: list[int]) -> set[str]:
    return stored_while(engine, lambda: engine.serve_prompt(prompt))[1]


def test_block_hashes_stable_across_restart(
    engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict
) -> None:
    ensure(engine, EngineConfig())
    block = deployed_block_size(engine)
    prompt = prompts.fresh(4 * block + block // 2)
    whole_blocks = len(prompt) // block
    first = _stored_by_prompt(engine, prompt)
    reports = restart(engine)
    # What a restart leaves behind is the churn checks' promise (memory_reclaim), judged there.
    verdict.record(
        "teardown_leftovers", sum(not r.clean for r in reports), note="; ".join(r.describe() for r in reports)
    )
    second = _stored_by_prompt(engine, prompt)
    verdict.require("blocks_announced_first_process", len(first), ">=", whole_blocks, "blocks")
    verdict.record("blocks_announced_second_process", len(second), "blocks")
    verdict.equal(
        "block_hashes_lost_across_restart",
        len(first - second),
        0,
        "blocks",
        note="hashes the first process announced for the prompt that the second did not",
    )
    verdict.conclude()
