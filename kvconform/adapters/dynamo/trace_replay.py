"""Dynamo's offline mocker replay (dynamo._core, driven by drivers/dynamo_driver.py) as a
TraceReplay facet: the driver's trace rows and per-request rows are read here only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvconform.contract.facets import Handoff, ReplayedRequest, ReplaySetup, TracedRequest, TraceReplay

# (op, **args) -> the driver's JSON answer
Call = Callable[..., Any]


def _handoff(raw: dict[str, Any] | None) -> Handoff | None:
    if not raw:
        return None
    return Handoff(
        transfer_ms=raw.get("transfer_ms"),
        destination_reserved_ms=raw.get("destination_reserved_ms"),
        destination_activated_ms=raw.get("destination_activated_ms"),
        decode_admitted_ms=raw.get("decode_admit_ms"),
    )


class DynamoTraceReplay(TraceReplay):
    """Requests one at a time (replay_concurrency 1) on one worker per role; the mocker's
    per-request capture gives each request's reuse and, disaggregated, its hand-off stamps."""

    simulates_handoff = True

    def __init__(self, call: Call) -> None:
        self.call = call

    def replay(self, trace: list[TracedRequest], setup: ReplaySetup) -> list[ReplayedRequest]:
        engine_args: dict[str, Any] = {"block_size": setup.block_size, "num_gpu_blocks": setup.cache_blocks}
        if setup.disaggregated:
            engine_args["kv_bytes_per_token"] = setup.kv_bytes_per_token
            engine_args["kv_transfer_bandwidth_gbps"] = setup.link_gbps
        got = self.call(
            "replay",
            trace=[
                {
                    "timestamp": req.arrival_ms,
                    "input_length": req.input_length,
                    "output_length": req.output_length,
                    "hash_ids": list(req.block_ids),
                }
                for req in trace
            ],
            engine_args=engine_args,
            mode="disagg" if setup.disaggregated else "agg",
            replay_concurrency=1,
        )
        return [
            ReplayedRequest(
                arrival_ms=float(row["arrival_time_ms"]),
                input_length=int(row["input_length"]),
                reused_input_tokens=int(row["reused_input_tokens"]),
                completed=row["terminal_status"] == "completed",
                handoff=_handoff(row.get("handoff")),
            )
            for row in got["requests"]
        ]
