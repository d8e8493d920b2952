"""A cache salt keeps a prompt's cached prefix apart, in the engine and in its KV events.

Tenants that share a server salt their requests so that none can hit, or time, another's
cached prefix. The engine must keep the salts apart, and so must every index built from its
KV events: a router or shared KV tier keys on the block hashes the engine announces, so the
hashes of one salt's blocks must not be another's, or the index believes a prefix is cached
for a salt the engine will never serve it to (SGLang #24568, fixed by #30827 in 0.5.18).

Oracle: the same tokens under two salts the suite chose; no hash and no cached token shared
between them, and the salt's own repeat still served from cache. Hashes are judged where the
engine publishes KV events; cached tokens everywhere a salt is taken.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import (
    EngineAdapter,
    EngineConfig,
    SaltedPrompts,
    ServedPrompt,
    deployed_block_size,
    ensure,
    facet,
)
from kvconform.oracles import prefix_hit_tokens
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict
from kvconform.suites.prefix_reuse.announced import stored_while
from kvconform.suites.prefix_reuse.answers import answer_tokens, judge_same_answer

pytestmark = pytest.mark.requires(C.PREFIX_CACHE, C.CACHE_SALT)


def _served_and_stored(
    engine: EngineAdapter, prompt: list[int], salt: str, events: bool, answer: int = 1
) -> tuple[ServedPrompt, set[str]]:
    if not events:
        return facet(engine, SaltedPrompts).serve_salted(prompt, salt, answer), set()
    return stored_while(engine, lambda: facet(engine, SaltedPrompts).serve_salted(prompt, salt, answer))


def test_cache_salt_isolates_prefix_and_event_hashes(
    engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict, has: Callable[[C], bool]
) -> None:
    ensure(engine, EngineConfig())
    events = has(C.KV_EVENTS)
    block = deployed_block_size(engine)
    prompt = prompts.fresh(4 * block + block // 2)
    whole_blocks = len(prompt) // block
    salt_a, salt_b = f"tenant-a-{prompts.fresh(1)[0]}", f"tenant-b-{prompts.fresh(1)[0]}"
    answer = answer_tokens(has)
    first_a, stored_a = _served_and_stored(engine, prompt, salt_a, events, answer)
    served_b, stored_b = _served_and_stored(engine, prompt, salt_b, events)
    again_a = facet(engine, SaltedPrompts).serve_salted(prompt, salt_a, answer)
    if events:
        verdict.require("blocks_announced_salt_a", len(stored_a), ">=", whole_blocks, "blocks")
        verdict.require("blocks_announced_salt_b", len(stored_b), ">=", whole_blocks, "blocks")
        verdict.equal(
            "block_hashes_shared_across_salts",
            len(stored_a & stored_b),
            0,
            "blocks",
            note="hashes announced for salt b's blocks that salt a's blocks already had",
        )
    else:
        verdict.record("block_hashes_shared_across_salts", "no KV events", note="not judged")
    verdict.equal(
        "cached_tokens_across_salts",
        served_b.cached_tokens,
        0,
        "tokens",
        note="salt b must not hit what salt a cached",
    )
    verdict.equal(
        "cached_tokens_same_salt",
        again_a.cached_tokens,
        prefix_hit_tokens(len(prompt), len(prompt), block, engine.traits.recomputes_last_token),
        "tokens",
        note="the salt's own repeat is still served from cache",
    )
    if facet(engine, SaltedPrompts).salted_answers():
        judge_same_answer(verdict, "answer_from_cache_same_salt_vs_cold", again_a, first_a, has)
    elif has(C.ANSWERS_FROM_KV):
        verdict.record(
            "answer_from_cache_same_salt_vs_cold",
            "not judged",
            note=f"engine {engine.name}: its salted path returns no token ids",
        )
    verdict.conclude()
