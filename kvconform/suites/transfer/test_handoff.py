"""Disaggregated prefill -> decode hand-off: the transfer time of each request equals its
KV bytes over the link bandwidth, with KV bytes per token from the model shape."""

from __future__ import annotations

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, ReplaySetup, TraceReplay, facet
from kvconform.results import Verdict
from kvconform.suites.prefix_reuse.test_replay import BLOCK, CACHE_BLOCKS, build_trace

pytestmark = pytest.mark.requires(C.TRACE_REPLAY)

BANDWIDTH_GBPS = 2.0
REL_TOL = 1e-9


def test_handoff_time_matches_bytes_over_bandwidth(engine: EngineAdapter, verdict: Verdict) -> None:
    replay = facet(engine, TraceReplay)
    if not replay.simulates_handoff:
        pytest.skip(f"engine {engine.name}'s replay has no disaggregated hand-off")
    bytes_per_token = engine.deployment.model.kv_bytes_per_token()
    trace = build_trace()
    setup = ReplaySetup(BLOCK, CACHE_BLOCKS, True, bytes_per_token, BANDWIDTH_GBPS)
    rows = sorted(replay.replay(trace, setup), key=lambda r: r.arrival_ms)
    bytes_per_ms = BANDWIDTH_GBPS * 1e6  # 1 GB/s = 1e9 B/s = 1e6 B/ms
    off = []
    ordered = 0
    for i, row in enumerate(rows):
        expected = row.input_length * bytes_per_token / bytes_per_ms
        handoff = row.handoff
        got = None if handoff is None else handoff.transfer_ms
        if got is None or abs(got - expected) > REL_TOL * max(expected, 1.0):
            off.append(f"#{i} n={row.input_length}: {got} ms != {expected:.6f} ms")
        if handoff is None:
            continue
        stamps = [
            handoff.destination_reserved_ms,
            handoff.destination_activated_ms,
            handoff.decode_admitted_ms,
        ]
        present = [s for s in stamps if s is not None]
        ordered += len(present) == len(stamps) and present == sorted(present)
    verdict.record("kv_bytes_per_token_from_model_shape", bytes_per_token, "bytes")
    verdict.record("bandwidth", BANDWIDTH_GBPS, "GB/s")
    verdict.require("handoffs_recorded", sum(1 for r in rows if r.handoff), "==", len(trace))
    verdict.equal("handoffs_off_bytes_over_bandwidth", len(off), 0, note="; ".join(off[:4]))
    verdict.equal(
        "handoffs_with_ordered_timestamps",
        ordered,
        len(rows),
        note="reserved <= activated <= decode admitted",
    )
    verdict.conclude()
