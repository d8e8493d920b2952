"""Reading an engine's prefix counters for exactly one request; the block size it resolved."""

from __future__ import annotations

import time

from kvconform.contract import EngineAdapter, deployed_block_size, metric_delta
from kvconform.contract.adapter import attached_server
from kvconform.metrics import MetricSnapshot


def queried_tokens(engine: EngineAdapter, prompt_tokens: int) -> int:
    """Tokens the engine's query counter should move by for one prompt."""
    if engine.traits.queries_whole_blocks:
        return prompt_tokens // deployed_block_size(engine) * deployed_block_size(engine)
    return prompt_tokens


def wait_counted(
    engine: EngineAdapter, before: MetricSnapshot, queried_tokens: int, timeout_s: float = 5.0
) -> tuple[float, float]:
    """(queried, hit) token deltas since `before`, once the request's queries are counted.

    Engines publish request stats asynchronously; we wait for the *queries* counter to cover
    the request (a fact independent of hits), then read hits — never waiting for hits to
    reach a value, which would hide the failure being checked.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        after = engine.metrics()
        queried = metric_delta(engine, "prefix_queries", before, after)
        if queried >= queried_tokens or time.monotonic() > deadline:
            return queried, metric_delta(engine, "prefix_hits", before, after)
        time.sleep(0.1)


def resolved_block_size(engine: EngineAdapter) -> int | None:
    """The block size the running engine says it uses, where it can say (None if not).

    Judged against what the suite requested, never used as the oracle's block: an engine that
    silently forces another block size must fail, not have its oracle follow it. The adapter's
    `resolved_block_size()`, else in attach mode `attached_block_size()` reading the server.
    """
    value = engine.resolved_block_size()
    if value is not None:
        return int(value)
    if engine.ctx.attached and (reported := attached_server(engine).attached_block_size()) is not None:
        return reported
    return None
