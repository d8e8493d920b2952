"""The router's active-block tracker: prompt-hash dedup, terminal ownership, exact drain to 0,
and clear error codes for duplicate or unknown requests and workers (Dynamo #11644).

The oracle for active blocks is our own count of distinct prefixes over the live requests'
block hashes (a shared prefix is held once; it stays while any request holds it).

A second free of one request is judged by the accounting, not by its status: Dynamo 1.6.1's
tracker makes `/free` idempotent by design (its own tests/router/test_standalone_slot_tracker.py
posts it twice and expects 200 both times). What a double free must never do is free blocks
another live request still holds, or drive the count below the live requests'.
"""

from __future__ import annotations

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter
from kvconform.results import Verdict

pytestmark = pytest.mark.requires(C.BLOCK_TRACKER)

MODEL = {"model_name": "kvconform-tracker"}


def distinct_prefixes(requests: dict[str, list[int]]) -> int:
    return len({tuple(hashes[: i + 1]) for hashes in requests.values() for i in range(len(hashes))})


def active_blocks(engine: EngineAdapter) -> int:
    status, rows = engine.block_tracker("GET", f"/loads?model_name={MODEL['model_name']}")
    assert status == 200, f"/loads -> {status}: {rows}"
    return sum(int(r["active_decode_blocks"]) for r in rows)


def test_block_tracker_ownership_and_drain(engine: EngineAdapter, verdict: Verdict) -> None:
    worker = {**MODEL, "worker_id": 7, "block_size": 16, "dp_start": 0, "dp_size": 1}
    status, _ = engine.block_tracker("POST", "/register", worker)
    verdict.require("register_status", status, "==", 201)
    status, _ = engine.block_tracker("POST", "/register", worker)
    verdict.equal("duplicate_register_status", status, 409)
    live: dict[str, list[int]] = {}
    plan = {"r1": [11, 12, 13], "r2": [11, 12, 14], "r3": [21, 22]}
    for rid, hashes in plan.items():
        body = {
            **MODEL,
            "request_id": rid,
            "worker_id": 7,
            "dp_rank": 0,
            "sequence_hashes": hashes,
            "new_isl_tokens": 16 * len(hashes),
        }
        status, _ = engine.block_tracker("POST", "/add", body)
        verdict.require(f"add_{rid}_status", status, "==", 201)
        live[rid] = hashes
    verdict.equal(
        "active_blocks_with_shared_prefix",
        active_blocks(engine),
        distinct_prefixes(live),
        "blocks",
        note="shared prompt prefixes are held once",
    )
    status, _ = engine.block_tracker(
        "POST", "/add", {**MODEL, "request_id": "r1", "worker_id": 7, "dp_rank": 0, "sequence_hashes": [11]}
    )
    verdict.equal("duplicate_add_status", status, 409)
    status, _ = engine.block_tracker(
        "POST", "/add", {**MODEL, "request_id": "rx", "worker_id": 99, "dp_rank": 0, "sequence_hashes": [11]}
    )
    verdict.equal("add_unknown_worker_status", status, 404)
    engine.block_tracker("POST", "/free", {**MODEL, "request_id": "r1"})
    del live["r1"]
    verdict.equal(
        "active_blocks_after_first_free",
        active_blocks(engine),
        distinct_prefixes(live),
        "blocks",
        note="the shared prefix survives while r2 holds it",
    )
    status, _ = engine.block_tracker("POST", "/free", {**MODEL, "request_id": "r1"})
    verdict.record("second_free_status", status, note="idempotent (200) or refused (404): both are contracts")
    verdict.equal(
        "active_blocks_after_second_free",
        active_blocks(engine),
        distinct_prefixes(live),
        "blocks",
        note="a second free of r1 must not take r2's shared prefix (or r3's blocks) with it",
    )
    for rid in list(live):
        engine.block_tracker("POST", "/prefill_complete", {**MODEL, "request_id": rid})
        engine.block_tracker("POST", "/free", {**MODEL, "request_id": rid})
        del live[rid]
    verdict.equal("active_blocks_after_all_freed", active_blocks(engine), 0, "blocks")
    status, _ = engine.block_tracker("POST", "/prefill_complete", {**MODEL, "request_id": "r1"})
    verdict.equal("prefill_complete_unknown_request_status", status, 404)
    status, _ = engine.block_tracker("POST", "/unregister", {**MODEL, "worker_id": 99})
    verdict.equal("unregister_unknown_worker_status", status, 404)
    engine.block_tracker("POST", "/unregister", {**MODEL, "worker_id": 7})
    verdict.conclude()
