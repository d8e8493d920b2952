"""Block-size sweep: hit ratio vs shared fraction at block sizes 32/64/128/256, against the
block-granularity oracle, with a plot for the report."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvconform.contract import CacheReset, EngineAdapter, EngineConfig, ServedPrompt, ensure, facet
from kvconform.contract import Capability as C
from kvconform.oracles import prefix_hit_tokens
from kvconform.prompts import PromptFactory
from kvconform.report import attach_png, plot_sweep
from kvconform.results import Verdict
from kvconform.suites.prefix_reuse.answers import answer_tokens, judge_least_agreeing

pytestmark = pytest.mark.requires(C.PREFIX_CACHE, C.BLOCK_SIZE_CONFIG, C.RESET_PREFIX_CACHE)

# Visited in this order: the sweep runs in the block-32 group of checks (its starting size) and
# ends in 128, the size the next group (partial-block hits at 128) starts in: one engine start less.
BLOCK_SIZES = (32, 64, 256, 128)
SHARED_FRACTIONS = (0.1, 0.3, 0.5, 0.7, 0.9)
PROMPT_TOKENS = 640


@pytest.mark.engine_config(block_size=BLOCK_SIZES[0], varies=True)
def test_block_size_sweep(
    engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict, has: Callable[[C], bool]
) -> None:
    curves: dict[int, list[tuple[float, float, float]]] = {}
    off_oracle = []
    answer = answer_tokens(has)
    # Each hit's answer against the same prompt computed after a reset.
    pairs: list[tuple[ServedPrompt, ServedPrompt]] = []
    for block in BLOCK_SIZES:
        ensure(engine, EngineConfig(block_size=block))
        curve = []
        for fraction in SHARED_FRACTIONS:
            facet(engine, CacheReset).reset_prefix_cache()
            shared = int(PROMPT_TOKENS * fraction)
            prefix = prompts.fresh(shared)
            engine.serve_prompt(prompts.extend(prefix, PROMPT_TOKENS))
            second = prompts.extend(prefix, PROMPT_TOKENS)
            result = engine.serve_prompt(second, answer)
            if has(C.ANSWERS_FROM_KV):
                facet(engine, CacheReset).reset_prefix_cache()
                pairs.append((result, engine.serve_prompt(second, answer)))
            expected = prefix_hit_tokens(shared, PROMPT_TOKENS, block, engine.traits.recomputes_last_token)
            curve.append((fraction, result.cached_tokens / shared, expected / shared))
            if result.cached_tokens != expected:
                off_oracle.append(f"block {block} shared {shared}: {result.cached_tokens} != {expected}")
        curves[block] = curve
        verdict.record(
            f"hit_ratio_block_{block}",
            ", ".join(f"{f:.1f}:{h:.2f}" for f, h, _o in curve),
            note="shared fraction: hits / shared tokens",
        )
    attach_png("block size sweep", plot_sweep(dict(sorted(curves.items()))))
    verdict.equal("points_off_oracle", len(off_oracle), 0, note="; ".join(off_oracle[:8]))
    judge_least_agreeing(verdict, "answer_from_cache_vs_after_reset", pairs, has)
    verdict.conclude()
