"""Dynamo's slot tracker service (`python -m dynamo.slot_tracker`) as an ActiveBlockTracker.

Its HTTP routes and answers (ai-dynamo 1.6.1; the routes of its own
tests/router/test_standalone_slot_tracker.py): POST /register, /unregister, /add,
/prefill_complete, /free with a JSON body naming the model; GET /loads?model_name=M, one row
per (worker, dp rank) with active_decode_blocks. 201 or 200 accept, 409 refuses a known worker
or live request, 404 an unknown one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvconform.contract.facets import ActiveBlockTracker, Answer, Outcome
from kvconform.errors import EngineError

# (method, path, JSON body) -> (HTTP status, decoded JSON or text)
Call = Callable[[str, str, Any], tuple[int, Any]]

OUTCOMES = {200: Outcome.ACCEPTED, 201: Outcome.ACCEPTED, 409: Outcome.DUPLICATE, 404: Outcome.UNKNOWN}


class SlotTrackerClient(ActiveBlockTracker):
    def __init__(self, engine: str, call: Call, model_name: str = "kvconform-tracker") -> None:
        self.engine = engine
        self.call = call
        self.model = model_name

    def _post(self, path: str, **body: Any) -> Answer:
        status, payload = self.call("POST", path, {"model_name": self.model, **body})
        return Answer(OUTCOMES.get(status, Outcome.FAILED), f"{path} -> {status}: {payload}")

    def register_worker(self, worker_id: int, block_size: int) -> Answer:
        return self._post("/register", worker_id=worker_id, block_size=block_size, dp_start=0, dp_size=1)

    def unregister_worker(self, worker_id: int) -> Answer:
        return self._post("/unregister", worker_id=worker_id)

    def add_request(
        self, request_id: str, worker_id: int, block_hashes: list[int], prompt_tokens: int
    ) -> Answer:
        return self._post(
            "/add",
            request_id=request_id,
            worker_id=worker_id,
            dp_rank=0,
            sequence_hashes=block_hashes,
            new_isl_tokens=prompt_tokens,
        )

    def prefill_complete(self, request_id: str) -> Answer:
        return self._post("/prefill_complete", request_id=request_id)

    def free_request(self, request_id: str) -> Answer:
        return self._post("/free", request_id=request_id)

    def active_blocks(self) -> int:
        status, rows = self.call("GET", f"/loads?model_name={self.model}", None)
        if status != 200 or not isinstance(rows, list):
            raise EngineError(self.engine, f"slot tracker /loads answered {status}: {rows}")
        return sum(int(row["active_decode_blocks"]) for row in rows)
