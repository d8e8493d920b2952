"""SGLang's RadixCache, driven in-process by drivers/sglang_driver.py, as a RadixCache facet.

The driver's ops (insert, match, lock, unlock, evict, stats, take_events) call the cache as
SGLang's scheduler does; their JSON answers are read here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from kvconform.contract.facets import CacheEvent, RadixCache, RadixCacheModel, RadixMatch, RadixSizes

# (op, **args) -> the driver's JSON answer
Call = Callable[..., Any]

KINDS: dict[str, Literal["stored", "removed", "cleared"]] = {
    "BlockStored": "stored",
    "BlockRemoved": "removed",
    "AllBlocksCleared": "cleared",
}


def cache_event(raw: dict[str, Any]) -> CacheEvent:
    kind = KINDS[raw["type"]]
    if kind != "stored":
        return CacheEvent(kind, tuple(raw.get("block_hashes") or ()))
    return CacheEvent(
        "stored",
        tuple(raw["block_hashes"]),
        tuple(raw.get("token_ids") or ()),
        int(raw.get("block_size") or 0),
        raw.get("parent_block_hash"),
    )


class SglangRadixCache(RadixCache):
    def __init__(self, call: Call) -> None:
        self.call = call

    def insert(self, tokens: list[int]) -> int:
        return int(self.call("insert", token_ids=tokens)["prefix_len"])

    def match(self, tokens: list[int]) -> RadixMatch:
        found = self.call("match", token_ids=tokens)
        return RadixMatch(int(found["prefix_len"]), found["handle"])

    def lock(self, handle: int) -> None:
        self.call("lock", handle=handle)

    def unlock(self, handle: int) -> None:
        self.call("unlock", handle=handle)

    def evict(self, num_tokens: int) -> None:
        self.call("evict", num_tokens=num_tokens)

    def sizes(self) -> RadixSizes:
        s = self.call("stats")
        return RadixSizes(
            capacity=int(s["capacity"]),
            total=int(s["total_size"]),
            available=int(s["available_size"]),
            evictable=int(s["evictable_size"]),
            protected=int(s["protected_size"]),
        )

    def take_events(self, router_hashes: bool = False) -> list[CacheEvent]:
        # the driver records SGLang's own events and, beside them, the ones its recorder
        # writes in the Dynamo router's format (KVCacheEventRecorder(dynamo_format=True))
        return [cache_event(raw) for raw in self.call("take_events", dynamo_format=router_hashes)]


class SglangRadixCacheModel(RadixCacheModel):
    """SGLang's RadixCache class: `build` makes a new cache in the driver (or a double that
    answers the driver's ops) and returns the call that drives it."""

    def __init__(self, build: Callable[[int, int], Call]) -> None:
        self.build = build

    def new_cache(self, page_size: int, capacity_tokens: int) -> RadixCache:
        return SglangRadixCache(self.build(page_size, capacity_tokens))
