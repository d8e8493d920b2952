"""A long conversation stays within the KV pool: resident memory is bounded by the pool's
size, not by the number of turns (oMLX 0.5.3: resident KV accumulated over multi-turn
sessions)."""

from __future__ import annotations

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, EngineConfig
from kvconform.oracles import theil_sen
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict
from kvconform.suites.memory_reclaim.bounds import NOISY_TOLERANCE_BYTES, RSS_GATE_TOLERANCE_BYTES

pytestmark = pytest.mark.requires(C.LONG_SESSION, C.HOST_MEMORY)

WARMUP_TURNS = 4
NEW_TOKENS_PER_TURN = 56
OUTPUT_TOKENS = 8


def test_long_session_bounded(
    engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict, request: pytest.FixtureRequest
) -> None:
    engine.ensure(EngineConfig())
    turns = request.config.getoption("--session-turns")
    history = prompts.fresh(64)
    rss: list[float] = []
    cached: list[int] = []
    for _turn in range(turns):
        served = engine.serve_prompt(history, max_tokens=OUTPUT_TOKENS)
        cached.append(served.cached_tokens)
        rss.append(float(engine.memory_sample().rss))
        history = history + served.output[:OUTPUT_TOKENS] + prompts.fresh(NEW_TOKENS_PER_TURN)
    pool = engine.kv_pool_bytes()
    bound = pool + NOISY_TOLERANCE_BYTES
    growth = rss[-1] - min(rss[:WARMUP_TURNS])
    trend = theil_sen(rss[WARMUP_TURNS:])
    verdict.record("turns", turns)
    verdict.record("final_context_tokens", len(history), "tokens")
    verdict.record("kv_pool_bytes", pool, "bytes")
    verdict.record("cached_tokens_last_turn", cached[-1], "tokens")
    verdict.add_series("engine RSS per turn", [(float(i), v) for i, v in enumerate(rss)])
    verdict.expect(
        "rss_growth_after_warmup",
        growth,
        "<=",
        bound,
        "bytes",
        better="lower",
        tolerance=RSS_GATE_TOLERANCE_BYTES,
        note="bounded by the KV pool plus RSS noise, not by the turn count",
    )
    verdict.expect(
        "rss_slope_per_turn",
        trend.slope,
        "<=",
        bound / turns,
        "bytes/turn",
        better="lower",
        tolerance=RSS_GATE_TOLERANCE_BYTES / turns,
        note=f"Theil-Sen over turns {WARMUP_TURNS}..{turns - 1}",
    )
    verdict.conclude()
