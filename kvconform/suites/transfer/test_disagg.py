"""A disaggregated deployment (prefill instance -> KV hand-off -> decode instance) serves
requests end to end, reports the prefix reuse its prefill side really had, hands the decode side
the prompt's KV instead of leaving it to recompute, and answers as the prefill side would.

The hand-off is judged where the engine counts what its decode side received (a key mismatch
between the two sides, LMCache/LMCache#1133, serves every request but recomputes it all); the
answer where a model computes it from the KV (a full hit that decodes from the wrong KV,
vllm-project/vllm#52617, counts right and answers wrong)."""

from __future__ import annotations

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import (
    DisaggregatedServing,
    EngineAdapter,
    EngineConfig,
    deployed_block_size,
    ensure,
    facet,
)
from kvconform.oracles import prefix_hit_tokens
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict
from kvconform.suites.prefix_reuse.answers import answer_tokens, judge_same_answer

pytestmark = [pytest.mark.requires(C.DISAGG_SERVING), pytest.mark.engine_config(disaggregated=True)]


def test_disaggregated_serving_reports_prefix_reuse(
    engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict, has
) -> None:
    ensure(engine, EngineConfig(disaggregated=True))
    block = deployed_block_size(engine)
    # Another prompt of the same shape first: a block key that does not cover the block's tokens
    # (colliding hashes, GHSA-rm76-4mrf-v9r8's class) serves its KV to the fresh prompt.
    facet(engine, DisaggregatedServing).serve_disaggregated(prompts.fresh(4 * block + 5))
    prompt = prompts.fresh(4 * block + 5)
    first = facet(engine, DisaggregatedServing).serve_disaggregated(prompt, answer_tokens(has))
    second = facet(engine, DisaggregatedServing).serve_disaggregated(prompt)
    expected = prefix_hit_tokens(len(prompt), len(prompt), block, engine.traits.recomputes_last_token)
    verdict.equal("prompt_tokens_served", second.prompt_tokens, len(prompt), "tokens")
    verdict.equal("first_request_cached_tokens", first.cached_tokens, 0, "tokens")
    verdict.equal(
        "repeated_request_cached_tokens",
        second.cached_tokens,
        expected,
        "tokens",
        note="the prefill side holds the whole prompt: whole blocks, last-token rule",
    )
    handoff = first.source.get("handoff")
    if handoff is None:
        verdict.record("first_request_handed_off_tokens", "not counted by the engine", note="not judged")
    else:
        verdict.equal(
            "first_request_handed_off_tokens",
            handoff,
            expected,
            "tokens",
            note="the decode side receives the prefill's KV of the prompt's whole blocks (last-token "
            "rule) and computes only the rest",
        )
    if has(C.ANSWERS_FROM_KV):
        # The prefill side's own answer: a monolithic serve of the prompt over the KV it computed.
        local = engine.serve_prompt(prompt, answer_tokens(has))
        judge_same_answer(verdict, "decode_answer_vs_prefill_side", first, local, has)
    verdict.conclude()
