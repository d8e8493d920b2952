"""Dynamo's RadixTree (dynamo.llm, driven in-process by drivers/dynamo_driver.py) as a
RouterIndex facet: the driver's ops and their plain event form are read here only."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvconform.contract.facets import Applied, IndexBlock, IndexEvent, RouterIndex

# (op, **args) -> the driver's JSON answer
Call = Callable[..., Any]


def to_plain(event: IndexEvent) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": event.kind,
        "worker": event.worker,
        "dp_rank": event.dp_rank,
        "id": event.event_id,
    }
    if event.kind == "stored":
        out["parent"] = event.parent
        out["blocks"] = [
            {"hash": b.hash, "tokens_hash": b.tokens_hash}
            if b.tokens_hash is not None
            else {"hash": b.hash, "tokens": list(b.tokens)}
            for b in event.blocks
        ]
    elif event.kind == "removed":
        out["hashes"] = list(event.hashes)
    return out


def from_plain(raw: dict[str, Any]) -> IndexEvent:
    worker, event_id, dp_rank = int(raw["worker"]), int(raw.get("id") or 0), int(raw.get("dp_rank") or 0)
    if raw["type"] == "stored":
        blocks = tuple(IndexBlock(int(b["hash"]), tokens_hash=int(b["tokens_hash"])) for b in raw["blocks"])
        parent = raw.get("parent")
        return IndexEvent(
            "stored",
            worker,
            event_id,
            parent=None if parent is None else int(parent),
            blocks=blocks,
            dp_rank=dp_rank,
        )
    if raw["type"] == "removed":
        hashes = tuple(int(h) for h in raw["hashes"])
        return IndexEvent("removed", worker, event_id, hashes=hashes, dp_rank=dp_rank)
    return IndexEvent("cleared", worker, event_id, dp_rank=dp_rank)


class DynamoRouterIndex(RouterIndex):
    def __init__(self, call: Call) -> None:
        self.call = call

    def new_tree(self, tree: str) -> None:
        self.call("tree_new", tree=tree)

    def apply(self, tree: str, events: list[IndexEvent]) -> Applied:
        result = self.call("tree_apply", events=[to_plain(e) for e in events], tree=tree)
        errors = tuple(f"event {r['index']}: {r['error']}" for r in result["results"] if not r["ok"])
        return Applied(int(result["applied"]), int(result["rejected"]), errors)

    def match(self, tree: str, content_hashes: list[int]) -> dict[int, int]:
        matched: dict[int, int] = {}
        for score in self.call("tree_match", block_hashes=content_hashes, tree=tree)["scores"]:
            worker = int(score["worker"])
            matched[worker] = max(matched.get(worker, 0), int(score["blocks"]))
        return matched

    def dump(self, tree: str) -> list[IndexEvent]:
        return [from_plain(raw) for raw in self.call("tree_dump", tree=tree)["events"]]

    def content_hashes(self, tokens: list[int], block_size: int) -> list[int]:
        return [int(h) for h in self.call("block_hashes", token_ids=tokens, block_size=block_size)["hashes"]]

    def resident_bytes(self) -> int:
        # the driver reads its own /proc/self/statm: the kernel's count, not Dynamo's
        return int(self.call("process_rss")["rss_bytes"])
