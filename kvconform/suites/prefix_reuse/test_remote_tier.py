"""Entries damaged inside a remote KV tier (Redis/Valkey...) are recomputed, never served, and
they do not take intact entries down with them (in this session or the next).

The suite writes the damage with its own client, straight into the remote store, while the
engine is stopped (the remote server keeps running: that is what a remote tier is). Then:
no hit may be counted for the damaged prompt and its output must equal a cold run's; a second
prompt whose entries were left intact must still be a full hit with the bytes it stored.

The store is the adapter's remote_tier() (kvconform.contract.RemoteStore).
"""

from __future__ import annotations

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import (
    EngineAdapter,
    EngineConfig,
    PersistentTier,
    RemoteStore,
    deployed_block_size,
    ensure,
    facet,
    restart,
)
from kvconform.oracles import prefix_hit_tokens
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict

pytestmark = [
    pytest.mark.requires(C.PREFIX_CACHE, C.RESTART, C.PERSISTENT_PREFIX, C.REMOTE_TIER),
    pytest.mark.engine_config(persistent=True),
]

PERSISTENT = EngineConfig(persistent=True)


def damaged(data: bytes, damage: str) -> bytes:
    if damage == "truncate":
        return data[: len(data) // 2]
    middle = len(data) // 2
    return data[:middle] + bytes(b ^ 0xFF for b in data[middle : middle + 64]) + data[middle + 64 :]


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_remote_damaged_entry_recomputed(
    engine: EngineAdapter, damage: str, prompts: PromptFactory, verdict: Verdict
) -> None:
    ensure(engine, PERSISTENT)
    block = deployed_block_size(engine)
    intact = prompts.fresh(4 * block + 1)
    intact_cold = engine.serve_prompt(intact)
    facet(engine, PersistentTier).flush()
    kept = set(facet(engine, RemoteStore).entries())
    prompt = prompts.fresh(6 * block + 1)
    cold = engine.serve_prompt(prompt)
    facet(engine, PersistentTier).flush()
    engine.stop()  # the engine is gone before its entries are touched; the remote store is not
    targets = sorted(set(facet(engine, RemoteStore).entries()) - kept)
    verdict.require(
        "entries_damaged", len(targets), ">=", 1, note="the prompt must have reached the remote tier"
    )
    for key in targets:
        facet(engine, RemoteStore).write(key, damaged(facet(engine, RemoteStore).read(key), damage))
    ensure(engine, PERSISTENT)
    warm = engine.serve_prompt(prompt)
    verdict.equal("cached_tokens_from_damaged_entries", warm.cached_tokens, 0, "tokens")
    verdict.equal("output_identical_to_cold_run", int(warm.output == cold.output), 1)
    after = engine.serve_prompt(intact)
    verdict.equal(
        "intact_prefix_hits_after_damaged_read",
        after.cached_tokens,
        prefix_hit_tokens(len(intact), len(intact), block, engine.traits.recomputes_last_token),
        "tokens",
        note="a prompt whose entries were not damaged is still served whole after the damaged read",
    )
    verdict.equal("intact_prefix_output_identical", int(after.output == intact_cold.output), 1)
    facet(engine, PersistentTier).flush()
    restart(engine)  # what the session after the damaged read left in the store
    again = engine.serve_prompt(intact)
    verdict.record("intact_prefix_hits_next_session", again.cached_tokens, "tokens")
    verdict.equal(
        "intact_prefix_output_next_session",
        int(again.output == intact_cold.output),
        1,
        note="entries rewritten after the damaged read hold the bytes that were stored",
    )
    verdict.conclude()
