"""Persisted prefixes survive a restart, and damaged entries are recomputed, never served.

Restart survival applies only where the engine promises persistence (capability
persistent_prefix); an engine that promises it and loses hits fails with the numbers. A
corrupt SSD entry served as a hit (fixed in oMLX 0.5.3) is the damage case: after the
entries are corrupted or truncated on disk, no hit may be counted for them and the output
must equal a cold run's.
"""

from __future__ import annotations

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import (
    EngineAdapter,
    EngineConfig,
    PersistentTier,
    deployed_block_size,
    ensure,
    facet,
    restart,
)
from kvconform.oracles import prefix_hit_tokens
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict
from kvconform.suites.prefix_reuse.answers import answer_tokens

pytestmark = [
    pytest.mark.requires(C.PREFIX_CACHE, C.RESTART, C.PERSISTENT_PREFIX),
    pytest.mark.engine_config(persistent=True),
]

PERSISTENT = EngineConfig(persistent=True)


def test_hits_survive_restart(engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict, has) -> None:
    ensure(engine, PERSISTENT)
    block = deployed_block_size(engine)
    prompt = prompts.fresh(8 * block + block // 3)
    cold = engine.serve_prompt(prompt, answer_tokens(has))
    facet(engine, PersistentTier).flush()
    reports = restart(engine)
    verdict.expect(
        "teardown_leftovers",
        sum(not r.clean for r in reports),
        "==",
        0,
        note="; ".join(r.describe() for r in reports),
    )
    warm = engine.serve_prompt(prompt, answer_tokens(has))
    expected = prefix_hit_tokens(len(prompt), len(prompt), block, engine.traits.recomputes_last_token)
    verdict.record("cold_cached_tokens", cold.cached_tokens, "tokens")
    verdict.equal(
        "cached_tokens_after_restart",
        warm.cached_tokens,
        expected,
        "tokens",
        note="hits must survive the restart, and no more than the prompt's whole blocks be claimed",
    )
    verdict.equal("output_identical_to_cold_run", int(warm.output == cold.output), 1)
    verdict.conclude()


@pytest.mark.requires(C.CORRUPT_PERSISTED)
@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_corrupt_persisted_entry_recomputed(
    engine: EngineAdapter, damage: str, prompts: PromptFactory, verdict: Verdict, has
) -> None:
    ensure(engine, PERSISTENT)
    block = deployed_block_size(engine)
    before = set(facet(engine, PersistentTier).files())
    prompt = prompts.fresh(6 * block + 1)
    cold = engine.serve_prompt(prompt, answer_tokens(has))
    facet(engine, PersistentTier).flush()
    engine.stop()  # the process is gone before its files are touched
    damaged = [p for p in facet(engine, PersistentTier).files() if p not in before]
    verdict.require("entries_damaged", len(damaged), ">=", 1, note="the prompt must have been persisted")
    for path in damaged:
        data = path.read_bytes()
        if damage == "truncate":
            path.write_bytes(data[: len(data) // 2])
        else:
            # Every byte of the second half flipped (tensor data, past any header): a served
            # entry then changes the answer whatever the prompt. 64 bytes flipped left it to the
            # prompt (oMLX, 2026-12-03: 1536 damaged tokens served and the same 8 tokens once).
            middle = len(data) // 2
            path.write_bytes(data[:middle] + bytes(b ^ 0xFF for b in data[middle:]))
    ensure(engine, PERSISTENT)
    warm = engine.serve_prompt(prompt, answer_tokens(has))
    verdict.equal("cached_tokens_from_damaged_entries", warm.cached_tokens, 0, "tokens")
    verdict.equal("output_identical_to_cold_run", int(warm.output == cold.output), 1)
    verdict.conclude()
