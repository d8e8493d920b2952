"""Test double for BLOCK_TRACKER: a router's active-block tracker behind an HTTP-like API.

Not an engine. The contract is the one adapters/dynamo.py drives over HTTP against Dynamo's
slot tracker service (read through the adapter's SlotTrackerClient, as Dynamo's is):

  POST /register        {model_name, worker_id, block_size, dp_start, dp_size}: 201; 409 if known
  POST /unregister      {model_name, worker_id}: 200; 404 for an unknown worker
  POST /add             {model_name, request_id, worker_id, dp_rank, sequence_hashes,
                         new_isl_tokens}: 201; 409 for a live request id; 404 for an unknown worker
  POST /prefill_complete {model_name, request_id}: 200; 404 for an unknown request
  POST /free            {model_name, request_id}: 200; 404 for an unknown (or already freed) request
  GET  /loads?model_name=M   200: one row per (worker, dp_rank) with active_decode_blocks
  GET  /health          200

Active blocks are prompt-hash deduplicated: a block is the prefix of sequence hashes up to it,
held once however many live requests share it, and counted until the last of them is freed.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar
from urllib.parse import parse_qs, urlsplit

from kvconform.adapters.dynamo.slot_tracker import SlotTrackerClient
from kvconform.contract import ActiveBlockTracker, Capability, provides
from kvconform.engines.reference.faults import Fault
from tests.doubles.base import DoubleAdapter

_CHECK = ("transfer::test_block_tracker_ownership_and_drain",)

FAULTS: dict[str, Fault] = {
    "free_drops_shared_prefix": Fault(
        "free deletes every block of the request, although another live request shares its prefix",
        _CHECK,
        "blocks tracked per request instead of reference-counted per prompt prefix",
        ("active_blocks_after_first_free", "active_blocks_after_second_free"),
    ),
    "prefill_complete_orphans_blocks": Fault(
        "prefill_complete hands the request to a decode table that free never looks at, so "
        "active blocks never drain to 0",
        _CHECK,
        "Dynamo #11644: terminal ownership of a request split between prefill and decode",
        ("active_blocks_after_all_freed",),
    ),
    "double_free_releases_again": Fault(
        "a second free of a request releases its blocks again, taking the shared prefix another "
        "live request still holds",
        _CHECK,
        "a double free that is not idempotent: the reference count of a shared prefix "
        "decremented twice for one request (the accounting an idempotent free, as Dynamo 1.6.1's, "
        "must keep exact)",
        ("active_blocks_after_second_free",),
    ),
    "duplicate_add_overwrites": Fault(
        "add with a live request id answers 201 and replaces that request's blocks",
        _CHECK,
        "Dynamo #11644: duplicate request ids silently accepted",
        ("duplicate_add_refused",),
    ),
    "shared_prefix_counted_per_request": Fault(
        "/loads counts each live request's blocks, so a prompt prefix two requests share is counted twice",
        _CHECK,
        "router load from per-request block counts instead of the deduplicated prefix tree "
        "(over-predicted load steers requests away from the worker holding the prefix)",
        ("active_blocks_with_shared_prefix",),
    ),
    "register_overwrites_worker": Fault(
        "a second register of a known worker answers 201 and replaces its record",
        _CHECK,
        "Dynamo #11644's class: duplicate identities silently accepted (here a worker's)",
        ("duplicate_register_refused",),
    ),
    "add_to_unknown_worker_dropped": Fault(
        "add for an unknown worker answers 201 and tracks nothing",
        _CHECK,
        "a request accepted and silently untracked: its blocks never count toward any worker",
        ("add_unknown_worker_refused",),
    ),
    "prefill_complete_unknown_answers_200": Fault(
        "prefill_complete of an unknown (or already freed) request answers 200",
        _CHECK,
        "an idempotent answer (Dynamo 1.6.1's slot tracker gives one to a second free, by design) "
        "on the prefill_complete route, where Dynamo answers 404",
        ("prefill_complete_unknown_request_refused",),
    ),
    "unregister_unknown_answers_200": Fault(
        "unregister of an unknown worker answers 200",
        _CHECK,
        "an idempotent unregister that hides a caller unregistering the wrong worker",
        ("unregister_unknown_worker_refused",),
    ),
}


class BlockTracker:
    def __init__(self, fault: str | None) -> None:
        self.fault = fault
        self.workers: dict[tuple[str, int], dict[str, Any]] = {}
        self.requests: dict[tuple[str, str], dict[str, Any]] = {}
        self.decoding: dict[tuple[str, str], dict[str, Any]] = {}  # prefill_complete_orphans_blocks
        self.freed: dict[tuple[str, str], dict[str, Any]] = {}  # double_free_releases_again
        self.active: Counter[tuple[str, int, int, tuple[int, ...]]] = Counter()

    def call(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        url = urlsplit(path)
        route = (method.upper(), url.path)
        if route == ("GET", "/health"):
            return 200, {"status": "ok"}
        if route == ("GET", "/loads"):
            model = parse_qs(url.query).get("model_name", [None])[0]
            return 200, self.loads(model)
        handlers = {
            "/register": self.register,
            "/unregister": self.unregister,
            "/add": self.add,
            "/prefill_complete": self.prefill_complete,
            "/free": self.free,
        }
        if url.path not in handlers:
            return 404, {"error": f"no route {url.path}"}
        if route[0] != "POST":
            return 405, {"error": f"{method} not allowed on {url.path}"}
        if not isinstance(body, dict) or "model_name" not in body:
            return 400, {"error": "a JSON object with model_name is required"}
        try:
            return handlers[url.path](body)
        except (KeyError, TypeError, ValueError) as exc:
            return 400, {"error": f"bad request: {type(exc).__name__}: {exc}"}

    def register(self, body: dict[str, Any]) -> tuple[int, Any]:
        key = (body["model_name"], int(body["worker_id"]))
        if key in self.workers and self.fault != "register_overwrites_worker":
            return 409, {"error": f"worker {key[1]} already registered"}
        self.workers[key] = {
            "block_size": int(body["block_size"]),
            "dp_start": int(body.get("dp_start", 0)),
            "dp_size": int(body.get("dp_size", 1)),
        }
        return 201, {"worker_id": key[1]}

    def unregister(self, body: dict[str, Any]) -> tuple[int, Any]:
        key = (body["model_name"], int(body["worker_id"]))
        if key not in self.workers:
            if self.fault == "unregister_unknown_answers_200":
                return 200, {"worker_id": key[1]}
            return 404, {"error": f"unknown worker {key[1]}"}
        del self.workers[key]
        for rid, req in list(self.requests.items()):
            if req["worker"] == key[1] and rid[0] == key[0]:
                self._release(rid[0], self.requests.pop(rid))
        return 200, {"worker_id": key[1]}

    def add(self, body: dict[str, Any]) -> tuple[int, Any]:
        model, rid = body["model_name"], str(body["request_id"])
        worker, dp_rank = int(body["worker_id"]), int(body.get("dp_rank", 0))
        if (model, worker) not in self.workers:
            if self.fault == "add_to_unknown_worker_dropped":
                return 201, {"request_id": rid}
            return 404, {"error": f"unknown worker {worker}"}
        spec = self.workers[(model, worker)]
        if not spec["dp_start"] <= dp_rank < spec["dp_start"] + spec["dp_size"]:
            return 404, {"error": f"worker {worker} has no dp rank {dp_rank}"}
        if (model, rid) in self.requests or (model, rid) in self.decoding:
            if self.fault != "duplicate_add_overwrites":
                return 409, {"error": f"request {rid} is already live"}
            self._release(model, self.requests.pop((model, rid)))
        req = {
            "worker": worker,
            "dp_rank": dp_rank,
            "hashes": [int(h) for h in body["sequence_hashes"]],
            "prefill_tokens": int(body.get("new_isl_tokens", 0)),
        }
        for prefix in self._prefixes(req["hashes"]):
            self.active[(model, worker, dp_rank, prefix)] += 1
        self.requests[(model, rid)] = req
        return 201, {"request_id": rid}

    def prefill_complete(self, body: dict[str, Any]) -> tuple[int, Any]:
        key = (body["model_name"], str(body["request_id"]))
        req = self.requests.get(key)
        if req is None:
            if self.fault == "prefill_complete_unknown_answers_200":
                return 200, {"request_id": key[1]}
            return 404, {"error": f"unknown request {key[1]}"}
        req["prefill_tokens"] = 0
        if self.fault == "prefill_complete_orphans_blocks":
            self.decoding[key] = self.requests.pop(key)
        return 200, {"request_id": key[1]}

    def free(self, body: dict[str, Any]) -> tuple[int, Any]:
        key = (body["model_name"], str(body["request_id"]))
        req = self.requests.pop(key, None)
        if req is None:
            if key in self.decoding:
                self.decoding.pop(key, None)  # orphaned: forgotten without releasing its blocks
                return 200, {"request_id": key[1]}
            if key in self.freed:
                self._release(key[0], self.freed[key])  # the fault's second release
                return 200, {"request_id": key[1]}
            return 404, {"error": f"unknown request {key[1]}"}
        self._release(key[0], req)
        if self.fault == "double_free_releases_again":
            self.freed[key] = req
        return 200, {"request_id": key[1]}

    def _release(self, model: str, req: dict[str, Any]) -> None:
        for prefix in self._prefixes(req["hashes"]):
            slot = (model, req["worker"], req["dp_rank"], prefix)
            if self.fault == "free_drops_shared_prefix":
                self.active.pop(slot, None)
                continue
            self.active[slot] -= 1
            if self.active[slot] <= 0:
                del self.active[slot]

    @staticmethod
    def _prefixes(hashes: list[int]) -> list[tuple[int, ...]]:
        return [tuple(hashes[: i + 1]) for i in range(len(hashes))]

    def loads(self, model: str | None) -> list[dict[str, Any]]:
        rows = []
        for (m, worker), spec in sorted(self.workers.items()):
            if model is not None and m != model:
                continue
            for dp_rank in range(spec["dp_start"], spec["dp_start"] + spec["dp_size"]):
                blocks = sum(1 for (mm, w, dp, _p) in self.active if (mm, w, dp) == (m, worker, dp_rank))
                if self.fault == "shared_prefix_counted_per_request":
                    blocks = sum(
                        len(r["hashes"])
                        for (mm, _rid), r in self.requests.items()
                        if mm == m and (r["worker"], r["dp_rank"]) == (worker, dp_rank)
                    )
                prefill = sum(
                    r["prefill_tokens"]
                    for (mm, _rid), r in self.requests.items()
                    if mm == m and (r["worker"], r["dp_rank"]) == (worker, dp_rank)
                )
                rows.append(
                    {
                        "worker_id": worker,
                        "dp_rank": dp_rank,
                        "active_decode_blocks": blocks,
                        "active_prefill_tokens": prefill,
                    }
                )
        return rows


class BlockTrackerDouble(DoubleAdapter):
    """Test double (not an engine) for BLOCK_TRACKER."""

    name = "testdouble_block_tracker"
    capabilities = frozenset({Capability.BLOCK_TRACKER})
    faults: ClassVar[dict[str, Fault]] = FAULTS

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.tracker = BlockTracker(self.fault)

    @provides(ActiveBlockTracker)
    def block_tracker(self) -> ActiveBlockTracker:
        # the double speaks Dynamo's slot tracker protocol: read through Dynamo's client
        return SlotTrackerClient(self.name, self.tracker.call)
