"""LMCache's cache simulator (lmcache/tools, driven by drivers/lmcache_simulator_driver.py)
as a TraceReplay facet: each request becomes the lookup record LMCache logs for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvconform.contract import ModelShape
from kvconform.contract.facets import ReplayedRequest, ReplaySetup, TracedRequest, TraceReplay
from kvconform.errors import EngineError

# (op, **args) -> the driver's JSON answer
Call = Callable[..., Any]


class LmcacheTraceReplay(TraceReplay):
    """One aggregated cache: the simulator has no workers, clock or disaggregation. A request
    is its full chunks' hashes (block ids standing for chunk hashes; a partial last chunk is
    never hashed), replayed through an LRU of `cache_blocks` chunks."""

    simulates_handoff = False

    def __init__(self, engine: str, call: Call, model: ModelShape) -> None:
        self.engine = engine
        self.call = call
        self.model = model

    def replay(self, trace: list[TracedRequest], setup: ReplaySetup) -> list[ReplayedRequest]:
        if setup.disaggregated:
            raise NotImplementedError("LMCache's simulator replays one aggregated cache")
        chunk = setup.block_size
        records = [
            {
                "timestamp": req.arrival_ms / 1000.0,
                "seq_len": req.input_length,
                "chunk_hashes": [f"0x{h:016x}" for h in req.block_ids[: req.input_length // chunk]],
            }
            for req in trace
        ]
        got = self.call(
            "replay",
            requests=records,
            chunk_size=chunk,
            capacity_chunks=setup.cache_blocks,
            kv_bytes_per_chunk=self.model.block_bytes(chunk),
        )
        if got["events"] != len(trace):
            raise EngineError(
                self.engine, f"the simulator loaded {got['events']} of {len(trace)} lookup records"
            )
        # Per request, the simulator's own token hit rate (hit tokens / seq_len, its primary
        # metric) times the request's length: the hit tokens it counted. A lookup record has no
        # outcome: every record the simulator loaded (counted above) is a completed request.
        rows = zip(got["timestamps"], got["token_hit_rates"], got["input_lengths"], strict=True)
        return [
            ReplayedRequest(
                arrival_ms=float(ts) * 1000.0,
                input_length=int(length),
                reused_input_tokens=round(float(rate) * int(length)),
                completed=True,
            )
            for ts, rate, length in rows
        ]
