"""Offline trace replay reports, per request, the reuse the trace's shared prefixes allow.

The trace is ours: requests built from a few shared prefixes (one id per block), some prompts
block-aligned, some not, replayed one at a time on one worker with a cache large enough to
keep everything. Oracle per request: the longest block prefix it shares with any earlier
request, under the engine's last-token rule (a serving engine computes the last token:
min(shared, floor((n - 1) / block)) blocks; a cache store returns every stored chunk).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, LastToken, ReplaySetup, TracedRequest, TraceReplay, facet
from kvconform.oracles import prefix_hit_tokens
from kvconform.results import Verdict

pytestmark = pytest.mark.requires(C.TRACE_REPLAY)

BLOCK = 16
CACHE_BLOCKS = 4096


def build_trace() -> list[TracedRequest]:
    groups = {"a": [1, 2, 3, 4], "b": [1, 2, 50, 51, 52], "c": [90]}
    shapes = [
        ("a", 2, 0),
        ("a", 3, 5),
        ("b", 1, 0),
        ("a", 0, 0),
        ("c", 4, 9),
        ("b", 2, 3),
        ("a", 2, 0),
        ("c", 4, 9),
    ]
    trace, fresh = [], 1000
    for i, (group, extra_blocks, tail) in enumerate(shapes):
        block_ids = list(groups[group])
        for _ in range(extra_blocks):
            block_ids.append(fresh)
            fresh += 1
        length = len(block_ids) * BLOCK
        if tail:  # a partial last block: its own id
            block_ids.append(fresh)
            fresh += 1
            length += tail
        trace.append(TracedRequest(i * 100.0, length, 2, tuple(block_ids)))
    # Identical requests share everything, partial block included.
    trace.append(dataclasses.replace(trace[4], arrival_ms=len(trace) * 100.0))
    return trace


def oracle(trace: list[TracedRequest], recomputes_last_token: bool | LastToken) -> list[int]:
    reused = []
    for i, req in enumerate(trace):
        full = req.input_length // BLOCK
        shared = 0
        for prev in trace[:i]:
            n = 0
            while n < min(full, len(prev.block_ids)) and prev.block_ids[n] == req.block_ids[n]:
                n += 1
            shared = max(shared, n)
        reused.append(prefix_hit_tokens(shared * BLOCK, req.input_length, BLOCK, recomputes_last_token))
    return reused


def test_trace_replay_reuse_matches_oracle(engine: EngineAdapter, verdict: Verdict) -> None:
    trace = build_trace()
    rows = facet(engine, TraceReplay).replay(trace, ReplaySetup(block_size=BLOCK, cache_blocks=CACHE_BLOCKS))
    rows = sorted(rows, key=lambda r: r.arrival_ms)
    expected = oracle(trace, engine.traits.recomputes_last_token)
    got = [r.reused_input_tokens for r in rows]
    wrong = [
        f"#{i} n={t.input_length}: {g} != {e}"
        for i, (t, g, e) in enumerate(zip(trace, got, expected, strict=True))
        if g != e
    ]
    verdict.record("requests", len(rows))
    verdict.record("reused_per_request", ", ".join(map(str, got)), "tokens", note=f"oracle {expected}")
    verdict.require("completed_requests", sum(r.completed for r in rows), "==", len(trace))
    verdict.equal("requests_off_oracle", len(wrong), 0, note="; ".join(wrong[:5]))
    verdict.conclude()
