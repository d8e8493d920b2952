"""Prefix hits are served, counted, and not lost to block granularity.

The oracle: a prefix cache serves whole blocks of the shared prefix, floor(shared/block)·block
tokens (one token fewer where the engine must compute the prompt's last token). vllm-ascend
#12589 and oMLX #3443 are the 0 % cases: hits that silently vanish when the shared prefix is
not a multiple of the block.
"""

from __future__ import annotations

import pytest

from kvconform.contract import CacheReset, EngineAdapter, EngineConfig, ensure, facet
from kvconform.contract import Capability as C
from kvconform.oracles import prefix_hit_tokens
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict
from kvconform.suites.prefix_reuse.answers import answer_tokens, judge_same_answer
from kvconform.suites.prefix_reuse.counters import queried_tokens, resolved_block_size, wait_counted

pytestmark = pytest.mark.requires(C.PREFIX_CACHE)


@pytest.fixture
def cache(engine: EngineAdapter, has) -> EngineAdapter:
    """The engine at its default block size, prefix cache emptied when it can be."""
    ensure(engine, EngineConfig())
    if has(C.RESET_PREFIX_CACHE):
        facet(engine, CacheReset).reset_prefix_cache()
    return engine


def requested_block_size(engine: EngineAdapter) -> int:
    """The block size the suite asked for: its config's, else the adapter's default (in attach
    mode the operator chose; the adapter's default is what the suite assumes)."""
    config = engine.config
    return (
        config.block_size
        if config is not None and config.block_size is not None
        else engine.deployment.block_size
    )


def oracle(engine: EngineAdapter, shared: int, prompt_len: int, block: int | None = None) -> int:
    block = block if block is not None else requested_block_size(engine)
    return prefix_hit_tokens(shared, prompt_len, block, engine.traits.recomputes_last_token)


def expect_block_size(engine: EngineAdapter, verdict: Verdict, requested: int) -> None:
    """Requested vs resolved block size, its own expectation (when the engine can tell)."""
    resolved = resolved_block_size(engine)
    verdict.record("requested_block_size", requested, "tokens")
    if resolved is None:
        verdict.record("resolved_block_size", "not reported by the engine")
        return
    verdict.equal(
        "resolved_block_size", resolved, requested, "tokens", note="what the engine says it runs at"
    )


def test_repeated_prompt_served_from_cache(
    cache: EngineAdapter, prompts: PromptFactory, verdict: Verdict, has
) -> None:
    block = requested_block_size(cache)
    expect_block_size(cache, verdict, block)
    # Another prompt of the same shape first: a block key that does not cover the block's tokens
    # (colliding hashes, GHSA-rm76-4mrf-v9r8's class) serves its KV to the fresh prompt.
    cache.serve_prompt(prompts.fresh(10 * block))
    prompt = prompts.fresh(10 * block)  # block-aligned: the last-token rule decides the last block
    first = cache.serve_prompt(prompt, answer_tokens(has))
    verdict.equal(
        "first_request_cached_tokens",
        first.cached_tokens,
        0,
        "tokens",
        note="a fresh prompt, served right after another of the same length",
    )
    before = cache.metrics() if has(C.PREFIX_HIT_COUNTERS) else None
    second = cache.serve_prompt(prompt, answer_tokens(has))
    expected = oracle(cache, len(prompt), len(prompt))
    verdict.record("block_size", block, "tokens")
    verdict.record("prompt_tokens", len(prompt), "tokens")
    verdict.equal("cached_tokens_in_response", second.cached_tokens, expected, "tokens")
    if before is not None:
        queried, hits = wait_counted(cache, before, queried_tokens(cache, len(prompt)))
        verdict.equal("prefix_queries_counter_delta", queried, queried_tokens(cache, len(prompt)), "tokens")
        verdict.equal("prefix_hits_counter_delta", hits, expected, "tokens")
    judge_same_answer(verdict, "answer_from_cache_vs_cold", second, first, has)
    verdict.conclude()


@pytest.mark.requires(C.RESET_PREFIX_CACHE)
def test_reset_drops_cached_prefix(
    cache: EngineAdapter, prompts: PromptFactory, verdict: Verdict, has
) -> None:
    block = requested_block_size(cache)
    prompt = prompts.fresh(6 * block + 3)
    cache.serve_prompt(prompt)
    warm = cache.serve_prompt(prompt, answer_tokens(has))
    expected_warm = oracle(cache, len(prompt), len(prompt))
    verdict.require(
        "cached_tokens_before_reset",
        warm.cached_tokens,
        "==",
        expected_warm,
        "tokens",
        note="the prefix was cached before the reset (judged by test_repeated_prompt_served_from_cache)",
    )
    facet(cache, CacheReset).reset_prefix_cache()
    before = cache.metrics() if has(C.PREFIX_HIT_COUNTERS) else None
    after = cache.serve_prompt(prompt, answer_tokens(has))
    verdict.equal("cached_tokens_after_reset", after.cached_tokens, 0, "tokens")
    if before is not None:
        _queried, hits = wait_counted(cache, before, queried_tokens(cache, len(prompt)))
        verdict.equal("prefix_hits_counter_delta_after_reset", hits, 0, "tokens")
    judge_same_answer(verdict, "answer_from_cache_vs_after_reset", warm, after, has)
    verdict.conclude()


@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.engine_config(block_size="param")
def test_partial_block_prefix_hits_match_oracle(
    engine: EngineAdapter, has, block_size: int, prompts: PromptFactory, verdict: Verdict
) -> None:
    """50 % shared prefix whose length is not a multiple of the block: hits = whole blocks."""
    if block_size != engine.deployment.block_size and not has(C.BLOCK_SIZE_CONFIG):
        pytest.skip(
            f"engine {engine.name} lacks capability block_size_config "
            f"(runs at block size {engine.deployment.block_size})"
        )
    ensure(engine, EngineConfig(block_size=block_size))
    if has(C.RESET_PREFIX_CACHE):
        facet(engine, CacheReset).reset_prefix_cache()
    shared = 3 * block_size + block_size // 2 + 1
    prefix = prompts.fresh(shared)
    first = prompts.extend(prefix, 2 * shared)
    second = prompts.extend(prefix, 2 * shared)
    engine.serve_prompt(first)
    before = engine.metrics() if has(C.PREFIX_HIT_COUNTERS) else None
    result = engine.serve_prompt(second, answer_tokens(has))
    expected = oracle(engine, shared, len(second), block=block_size)  # the requested size
    expect_block_size(engine, verdict, block_size)
    verdict.record("block_size", block_size, "tokens")
    verdict.record("shared_prefix_tokens", shared, "tokens")
    verdict.record("prompt_tokens", len(second), "tokens")
    verdict.record("hit_ratio_of_shared", result.cached_tokens / shared, better="higher", tolerance=0.01)
    verdict.equal(
        "cached_tokens_in_response",
        result.cached_tokens,
        expected,
        "tokens",
        note=f"oracle floor({shared}/{block_size})*{block_size}",
    )
    if before is not None:
        # The prompt ends in a part block: what an engine counts as queried there is its own
        # contract (queried_tokens: EngineTraits.queries_whole_blocks), and an engine's
        # whole-block prompts elsewhere never show it.
        queried, hits = wait_counted(engine, before, queried_tokens(engine, len(second)))
        verdict.equal("prefix_queries_counter_delta", queried, queried_tokens(engine, len(second)), "tokens")
        verdict.equal("prefix_hits_counter_delta", hits, expected, "tokens")
    if has(C.ANSWERS_FROM_KV) and has(C.RESET_PREFIX_CACHE):
        # the part-block hit's answer against the same prompt computed in full
        facet(engine, CacheReset).reset_prefix_cache()
        cold = engine.serve_prompt(second, answer_tokens(has))
        judge_same_answer(verdict, "answer_from_cache_vs_after_reset", result, cold, has)
    verdict.conclude()
