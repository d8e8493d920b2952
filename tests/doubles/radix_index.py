"""Test double for RADIX_INDEX: a router-side prefix index over many workers, fed by KV events.

Not an engine. The contract is the one adapters/dynamo.py drives through Dynamo's RadixTree
(the driver ops its DynamoRouterIndex client reads), in kvconform's plain event form:

  {"type": "stored", "worker", "dp_rank", "id", "parent": block hash | None,
   "blocks": [{"hash", "tokens": [...]} or {"hash", "tokens_hash"}]}
  {"type": "removed", "worker", "dp_rank", "id", "hashes": [...]}
  {"type": "cleared", "worker", "dp_rank", "id"}

Nodes are keyed under their parent by the block's content hash (tokens_hash) and shared by
every worker holding that prefix; each worker keeps its own block hash -> node table. An event
naming an unknown parent or an unknown removed block is rejected and changes nothing.
tree_match scores, per worker, the longest prefix of the query every block of which it holds.
tree_dump gives one stored event per block, parents before children, replayable.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, ClassVar

import psutil

from kvconform.adapters.dynamo.router_index import DynamoRouterIndex
from kvconform.contract import Capability, RouterIndex, provides
from kvconform.engines.reference.faults import Fault
from tests.doubles.base import DoubleAdapter

_CHECK = ("prefix_reuse::test_radix_index_matches_model",)
_CHURN = ("memory_reclaim::test_radix_index_memory_flat_under_eviction_churn",)
Key = tuple[int, int]  # (worker, dp_rank)

FAULTS: dict[str, Fault] = {
    "index_ignores_removed": Fault(
        "removed events are accepted and dropped: evicted blocks keep predicting hits",
        _CHECK,
        "Dynamo RadixTree dropping removals it cannot place (stale router state)",
        ("index_disagreements",),
    ),
    "removal_prunes_subtree": Fault(
        "a worker's removal deletes the node and everything under it, for every worker",
        _CHECK,
        "a shared radix node freed when one holder leaves, taking other workers' descendants along",
        ("index_disagreements",),
    ),
    "clear_clears_all_workers": Fault(
        "one worker's cleared event drops every worker's blocks",
        _CHECK,
        "AllBlocksCleared handled as a reset of the whole router index",
        ("index_disagreements",),
    ),
    "evicted_branch_kept_alive": Fault(
        "an evicted branch leaves the tree but stays referenced, so its memory never comes back",
        _CHURN,
        "Dynamo 1.5.1 RadixTree: evicted branches kept alive by parent links (ai-dynamo/dynamo#14878)",
        ("index_rss_slope_per_evicted_block",),
    ),
    "dump_children_first": Fault(
        "tree_dump emits each worker's blocks deepest first, so a replay meets children before their parents",
        _CHECK,
        "a dump walking hash-map order instead of the tree (unreplayable snapshots)",
        ("index_disagreements",),
    ),
}


def tokens_hash(tokens: list[int]) -> int:
    digest = hashlib.sha256(b"kvc-block:" + b",".join(str(int(t)).encode() for t in tokens)).digest()
    return int.from_bytes(digest[:8], "big") >> 1


@dataclass(eq=False)
class _Node:
    local: int
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    holders: dict[Key, int] = field(default_factory=dict)  # worker -> its block hash here


class RejectedEvent(ValueError):
    pass


class PrefixIndex:
    def __init__(self, fault: str | None) -> None:
        self.fault = fault
        self.root = _Node(0, None)
        self.tables: dict[Key, dict[int, _Node]] = {}
        self.kept_alive: list[_Node] = []  # evicted_branch_kept_alive

    def apply(self, event: dict[str, Any]) -> None:
        key = (int(event["worker"]), int(event.get("dp_rank", 0)))
        table = self.tables.setdefault(key, {})
        kind = event["type"]
        if kind == "stored":
            parent_hash = event.get("parent")
            if parent_hash is None:
                node = self.root
            elif int(parent_hash) in table:
                node = table[int(parent_hash)]
            else:
                raise RejectedEvent(f"worker {key}: unknown parent block {parent_hash}")
            for block in event["blocks"]:
                local = int(block["tokens_hash"]) if "tokens_hash" in block else tokens_hash(block["tokens"])
                child = node.children.get(local)
                if child is None:
                    child = node.children[local] = _Node(local, node)
                child.holders[key] = int(block["hash"])
                table[int(block["hash"])] = child
                node = child
        elif kind == "removed":
            hashes = [int(h) for h in event["hashes"]]
            unknown = [h for h in hashes if h not in table]
            if unknown:
                raise RejectedEvent(f"worker {key}: unknown removed block(s) {unknown}")
            if self.fault == "index_ignores_removed":
                return
            for h in hashes:
                node = table.pop(h, None)
                if node is None:  # already dropped with a subtree (removal_prunes_subtree)
                    continue
                if self.fault == "removal_prunes_subtree":
                    self._drop_subtree(node)
                    continue
                node.holders.pop(key, None)
                if self.fault == "evicted_branch_kept_alive":
                    self.kept_alive.append(node)
                self._prune(node)
        elif kind == "cleared":
            keys = list(self.tables) if self.fault == "clear_clears_all_workers" else [key]
            for k in keys:
                for node in self.tables[k].values():
                    node.holders.pop(k, None)
                    self._prune(node)
                self.tables[k] = {}
        else:
            raise RejectedEvent(f"unknown event type {kind!r} (stored|removed|cleared)")

    def _prune(self, node: _Node) -> None:
        while node.parent is not None and not node.holders and not node.children:
            if node.parent.children.get(node.local) is node:
                del node.parent.children[node.local]
            node = node.parent

    def _drop_subtree(self, node: _Node) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            for k, h in n.holders.items():
                if self.tables.get(k, {}).get(h) is n:
                    del self.tables[k][h]
            stack.extend(n.children.values())
        if node.parent is not None:
            node.parent.children.pop(node.local, None)

    def match(self, block_hashes: list[int]) -> list[dict[str, int]]:
        scores: dict[Key, int] = {}
        node, active = self.root, None
        for depth, local in enumerate(block_hashes, start=1):
            child = node.children.get(int(local))
            if child is None:
                break
            active = set(child.holders) if active is None else active & set(child.holders)
            if not active:
                break
            for k in active:
                scores[k] = depth
            node = child
        return [{"worker": w, "dp_rank": dp, "blocks": n} for (w, dp), n in sorted(scores.items())]

    def dump(self) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for key in sorted(self.tables):
            ordered, frontier = [], [self.root]
            while frontier:  # breadth first: every parent before its children
                nxt = []
                for node in frontier:
                    for child in sorted(node.children.values(), key=lambda c: c.local):
                        if key in child.holders:
                            ordered.append(child)
                            nxt.append(child)
                frontier = nxt
            if self.fault == "dump_children_first":
                ordered.reverse()
            for node in ordered:
                parent = node.parent
                events.append(
                    {
                        "type": "stored",
                        "worker": key[0],
                        "dp_rank": key[1],
                        "id": len(events),
                        "parent": None if parent is None or parent is self.root else parent.holders[key],
                        "blocks": [{"hash": node.holders[key], "tokens_hash": node.local}],
                    }
                )
        return events


class RadixIndexDouble(DoubleAdapter):
    """Test double (not an engine) for RADIX_INDEX."""

    name = "testdouble_radix_index"
    capabilities = frozenset({Capability.RADIX_INDEX})
    faults: ClassVar[dict[str, Fault]] = FAULTS

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.trees: dict[str, PrefixIndex] = {}

    def tree(self, name: str) -> PrefixIndex:
        if name not in self.trees:
            raise KeyError(f"no tree {name!r}; call tree_new first")
        return self.trees[name]

    @provides(RouterIndex)
    def router_index(self) -> DynamoRouterIndex:
        # the double answers the Dynamo driver's ops: read through Dynamo's client
        return DynamoRouterIndex(self.call)

    def call(self, op: str, **args: Any) -> Any:
        tree = str(args.pop("tree", "default"))
        if op == "tree_new":
            self.trees[tree] = PrefixIndex(self.fault)
            return {"tree": tree}
        if op == "tree_apply":
            results = []
            for index, event in enumerate(args["events"]):
                try:
                    self.tree(tree).apply(event)
                    results.append({"index": index, "ok": True, "error": None})
                except (RejectedEvent, KeyError, TypeError) as exc:
                    results.append({"index": index, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
            rejected = sum(not r["ok"] for r in results)
            return {"applied": len(results) - rejected, "rejected": rejected, "results": results}
        if op == "tree_match":
            return {"scores": self.tree(tree).match(args["block_hashes"])}
        if op == "tree_dump":
            return {"events": self.tree(tree).dump()}
        if op == "process_rss":
            return {"rss_bytes": psutil.Process().memory_info().rss}
        if op == "block_hashes":
            size = int(args["block_size"])
            tokens = [int(t) for t in args["token_ids"]]
            hashes = [tokens_hash(tokens[i : i + size]) for i in range(0, len(tokens) // size * size, size)]
            return {"block_size": size, "full_blocks": len(hashes), "hashes": hashes, "hashes_i64": hashes}
        raise ValueError(f"unknown radix_index op {op!r}")
