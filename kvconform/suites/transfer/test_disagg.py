"""A disaggregated deployment (prefill instance -> KV hand-off -> decode instance) serves
requests end to end and reports the prefix reuse its prefill side really had."""

from __future__ import annotations

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, EngineConfig
from kvconform.oracles import prefix_hit_tokens
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict

pytestmark = [pytest.mark.requires(C.DISAGG_SERVING), pytest.mark.engine_config(disaggregated=True)]


def test_disaggregated_serving_reports_prefix_reuse(
    engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict
) -> None:
    engine.ensure(EngineConfig(disaggregated=True))
    block = engine.block_size()
    prompt = prompts.fresh(4 * block + 5)
    first = engine.serve_disaggregated(prompt)
    second = engine.serve_disaggregated(prompt)
    expected = prefix_hit_tokens(len(prompt), len(prompt), block, engine.recomputes_last_token)
    verdict.equal("prompt_tokens_served", second.prompt_tokens, len(prompt), "tokens")
    verdict.equal("first_request_cached_tokens", first.cached_tokens, 0, "tokens")
    verdict.equal(
        "repeated_request_cached_tokens",
        second.cached_tokens,
        expected,
        "tokens",
        note="the prefill side holds the whole prompt: whole blocks, last-token rule",
    )
    verdict.conclude()
