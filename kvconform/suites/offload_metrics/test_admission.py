"""An offload tier with a store threshold offloads a block on its Nth offer, and only then.

A threshold keeps one-off prompts out of a small host tier: a block is stored only once it has
been offered for storing N times. The offers that matter most are those of a hot prompt that
stays resident on the device: each request that reuses it offers its blocks again. vLLM
0.28.0 counted lookups instead of offers, and a device-resident prompt is never looked up in
the host tier, so the hottest prompts were never offloaded (vLLM #52227).

Oracle: the prompts the suite sent and how often; a prompt offered N times comes back from
the host tier after the device cache is reset, one offered fewer times does not.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvconform.contract import (
    CacheReset,
    EngineAdapter,
    EngineConfig,
    OffloadTier,
    deployed_block_size,
    ensure,
    facet,
)
from kvconform.contract import Capability as C
from kvconform.oracles import prefix_hit_tokens
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict
from kvconform.suites.prefix_reuse.answers import answer_tokens, judge_same_answer

THRESHOLD = 2

pytestmark = [
    pytest.mark.requires(C.OFFLOAD_STORE_THRESHOLD),
    pytest.mark.engine_config(offload=True, offload_store_threshold=THRESHOLD),
]


def test_store_threshold_counts_offers(
    engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict, has: Callable[[C], bool]
) -> None:
    ensure(engine, EngineConfig(offload=True, offload_store_threshold=THRESHOLD))
    block = deployed_block_size(engine)
    once = prompts.fresh(8 * block + 5)
    hot = prompts.fresh(8 * block + 5)
    answer = answer_tokens(has)
    engine.serve_prompt(once)
    served_hot = [engine.serve_prompt(hot, answer) for _ in range(THRESHOLD)]
    facet(engine, OffloadTier).wait_idle()
    facet(engine, CacheReset).reset_prefix_cache()
    once_again = engine.serve_prompt(once)
    hot_again = engine.serve_prompt(hot, answer)
    verdict.require(
        "device_hit_tokens_on_hot_repeat",
        served_hot[-1].cached_tokens,
        ">=",
        block,
        note="the hot prompt must have stayed resident on the device between its offers",
    )
    verdict.equal(
        "host_hit_tokens_offered_once",
        once_again.cached_tokens,
        0,
        "tokens",
        note=f"offered once, under the threshold of {THRESHOLD}: never stored, so nothing comes back",
    )
    verdict.equal(
        "host_hit_tokens_offered_at_threshold",
        hot_again.cached_tokens,
        prefix_hit_tokens(len(hot), len(hot), block, engine.traits.recomputes_last_token),
        "tokens",
        note=f"offered {THRESHOLD} times while resident on the device: every full block was stored",
    )
    judge_same_answer(verdict, "answer_from_host_vs_cold", hot_again, served_hot[0], has)
    verdict.conclude()
