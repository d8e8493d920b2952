"""The router's active-block tracker: prompt-hash dedup, terminal ownership, exact drain to 0,
and clear refusals of duplicate or unknown requests and workers (Dynamo #11644).

The oracle for active blocks is our own count of distinct prefixes over the live requests'
block hashes (a shared prefix is held once; it stays while any request holds it).

A second free of one request is judged by the accounting, not by its answer: Dynamo 1.6.1's
tracker makes a free idempotent by design (its own tests/router/test_standalone_slot_tracker.py
frees twice and expects success both times). What a double free must never do is free blocks
another live request still holds, or drive the count below the live requests'.
"""

from __future__ import annotations

import pytest

from kvconform.contract import ActiveBlockTracker, EngineAdapter, Outcome, facet
from kvconform.contract import Capability as C
from kvconform.results import Verdict

pytestmark = pytest.mark.requires(C.BLOCK_TRACKER)

WORKER, STRANGER = 7, 99
BLOCK = 16


def distinct_prefixes(requests: dict[str, list[int]]) -> int:
    return len({tuple(hashes[: i + 1]) for hashes in requests.values() for i in range(len(hashes))})


def test_block_tracker_ownership_and_drain(engine: EngineAdapter, verdict: Verdict) -> None:
    tracker: ActiveBlockTracker = facet(engine, ActiveBlockTracker)
    answer = tracker.register_worker(WORKER, BLOCK)
    verdict.require("register_accepted", answer.is_(Outcome.ACCEPTED), "==", 1, note=answer.detail)
    answer = tracker.register_worker(WORKER, BLOCK)
    verdict.equal("duplicate_register_refused", answer.is_(Outcome.DUPLICATE), 1, note=answer.detail)
    live: dict[str, list[int]] = {}
    plan = {"r1": [11, 12, 13], "r2": [11, 12, 14], "r3": [21, 22]}
    for rid, hashes in plan.items():
        answer = tracker.add_request(rid, WORKER, hashes, BLOCK * len(hashes))
        verdict.require(f"add_{rid}_accepted", answer.is_(Outcome.ACCEPTED), "==", 1, note=answer.detail)
        live[rid] = hashes
    verdict.equal(
        "active_blocks_with_shared_prefix",
        tracker.active_blocks(),
        distinct_prefixes(live),
        "blocks",
        note="shared prompt prefixes are held once",
    )
    answer = tracker.add_request("r1", WORKER, [11], BLOCK)
    verdict.equal("duplicate_add_refused", answer.is_(Outcome.DUPLICATE), 1, note=answer.detail)
    answer = tracker.add_request("rx", STRANGER, [11], BLOCK)
    verdict.equal("add_unknown_worker_refused", answer.is_(Outcome.UNKNOWN), 1, note=answer.detail)
    tracker.free_request("r1")
    del live["r1"]
    verdict.equal(
        "active_blocks_after_first_free",
        tracker.active_blocks(),
        distinct_prefixes(live),
        "blocks",
        note="the shared prefix survives while r2 holds it",
    )
    answer = tracker.free_request("r1")
    verdict.record(
        "second_free_answer",
        str(answer.outcome),
        note=f"accepted (idempotent) or unknown: both are contracts; {answer.detail}",
    )
    verdict.equal(
        "active_blocks_after_second_free",
        tracker.active_blocks(),
        distinct_prefixes(live),
        "blocks",
        note="a second free of r1 must not take r2's shared prefix (or r3's blocks) with it",
    )
    for rid in list(live):
        tracker.prefill_complete(rid)
        tracker.free_request(rid)
        del live[rid]
    verdict.equal("active_blocks_after_all_freed", tracker.active_blocks(), 0, "blocks")
    answer = tracker.prefill_complete("r1")
    verdict.equal(
        "prefill_complete_unknown_request_refused", answer.is_(Outcome.UNKNOWN), 1, note=answer.detail
    )
    answer = tracker.unregister_worker(STRANGER)
    verdict.equal("unregister_unknown_worker_refused", answer.is_(Outcome.UNKNOWN), 1, note=answer.detail)
    tracker.unregister_worker(WORKER)
    verdict.conclude()
