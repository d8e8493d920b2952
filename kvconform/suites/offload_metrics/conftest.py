"""One offload scenario per engine, judged by several checks.

The scenario: serve fresh prompts (their full blocks are stored to the host tier), drop them
from the device (a prefix-cache reset; where the engine has none, fresh prompts of twice the
device pool evict them), serve them again (their blocks come back from the host tier), then
stay idle while the gauges drain — sampled at 20 Hz throughout.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from kvconform.contract import (
    CacheReset,
    EngineAdapter,
    EngineConfig,
    KvPool,
    OffloadTier,
    ServedPrompt,
    deployed_block_size,
    ensure,
    facet,
    supported,
)
from kvconform.contract import Capability as C
from kvconform.metrics import MetricSnapshot
from kvconform.oracles import prefix_hit_tokens
from kvconform.prompts import PromptFactory
from kvconform.suites.offload_metrics.gauges import GaugeSampler
from kvconform.suites.prefix_reuse.answers import answer_tokens

PROMPTS = 6
IDLE_WATCH_S = 6.0


@dataclass
class OffloadRun:
    sampler: GaugeSampler
    before: MetricSnapshot
    after: MetricSnapshot
    prompts: list[list[int]]
    cold: list[ServedPrompt]  # each prompt's first serve, computed in full
    reserved: list[ServedPrompt]  # served again, from the host tier
    load_ended_at: float
    expected_stored_blocks: int
    expected_host_hit_tokens: int
    block_size: int


def drive(
    engine: EngineAdapter, prompts: PromptFactory, sampler: GaugeSampler
) -> tuple[list[list[int]], list[ServedPrompt], list[ServedPrompt]]:
    block = deployed_block_size(engine)
    # Where the answer is judged, ANSWER_TOKENS of it: fewer than 8 * block + 5 needs to fill
    # the last block, so the blocks stored stay the prompt's.
    answer = answer_tokens(lambda capability: capability in supported(engine))
    batch = [prompts.fresh(8 * block + 5) for _ in range(PROMPTS)]
    cold = [engine.serve_prompt(tokens, answer) for tokens in batch]
    facet(engine, OffloadTier).wait_idle()
    drop_from_device(engine, prompts)
    return batch, cold, [engine.serve_prompt(tokens, answer) for tokens in batch]


def drop_from_device(engine: EngineAdapter, prompts: PromptFactory) -> None:
    """The engine's own reset where it has one; else LRU eviction by fresh prompts of twice the
    device pool (as the eviction check fills it), which the host tier must hold beside them."""
    if C.RESET_PREFIX_CACHE in supported(engine):
        facet(engine, CacheReset).reset_prefix_cache()
        return
    block = deployed_block_size(engine)
    filler = 16 * block
    for _ in range(-(-2 * facet(engine, KvPool).cache_capacity_tokens() // filler)):
        engine.serve_prompt(prompts.fresh(filler))
    facet(engine, OffloadTier).wait_idle()


@pytest.fixture(scope="module")
def offload_run(engine: EngineAdapter) -> Iterator[OffloadRun]:
    ensure(engine, EngineConfig(offload=True))
    prompts = PromptFactory(f"offload-{engine.name}-{time.time_ns()}")
    before = engine.metrics()
    with GaugeSampler(engine) as sampler:
        batch, cold, reserved = drive(engine, prompts, sampler)
        ended = sampler.now()
        time.sleep(IDLE_WATCH_S)
    block = deployed_block_size(engine)
    yield OffloadRun(
        sampler=sampler,
        before=before,
        after=engine.metrics(),
        prompts=batch,
        cold=cold,
        reserved=reserved,
        load_ended_at=ended,
        expected_stored_blocks=sum(len(t) // block for t in batch),
        expected_host_hit_tokens=sum(
            prefix_hit_tokens(len(t), len(t), block, engine.traits.recomputes_last_token) for t in batch
        ),
        block_size=block,
    )
