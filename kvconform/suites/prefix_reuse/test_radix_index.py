"""A router's prefix index, fed with KV events, predicts what each worker really holds.

A Hypothesis state machine plays two workers' KV events (chains stored under deterministic
block hashes, leaf-first evictions, clears) into the engine's index and into a simple model
(per worker: the stored blocks and their parents); for every query the index's per-worker
match must equal the model's longest stored prefix. Then the index is dumped as events and
replayed into a fresh index, which must answer every query the same way.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule, run_state_machine_as_test

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, IndexBlock, IndexEvent, RouterIndex, facet
from kvconform.results import Verdict

pytestmark = pytest.mark.requires(C.RADIX_INDEX)

BLOCK = 16
WORKERS = (1, 2)
RUN = settings(
    max_examples=15,
    stateful_step_count=30,
    deadline=None,
    report_multiple_bugs=False,  # one verdict per run: the first (shrunk) violation
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
Path = tuple[int, ...]  # block contents (one small int per block) from the root


def block_tokens(content: int, depth: int) -> list[int]:
    return [(content * 31 + depth * 7 + i) % 3000 + 10 for i in range(BLOCK)]


def external_hash(path: Path) -> int:
    """Deterministic across workers, as engines' block hashes must be."""
    return int.from_bytes(hashlib.sha256(repr(path).encode()).digest()[:8], "big") >> 1


def machine_for(engine: EngineAdapter, queries_log: list[int]) -> type:
    class RadixIndexMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.index = facet(engine, RouterIndex)
            self.index.new_tree("live")
            self.stored: dict[int, set[Path]] = {w: set() for w in WORKERS}
            self.event_id = 0

        def apply(self, kind: Literal["stored", "removed", "cleared"], worker: int, **fields: Any) -> None:
            self.event_id += 1
            applied = self.index.apply("live", [IndexEvent(kind, worker, self.event_id, **fields)])
            assert applied.rejected == 0, f"index rejected a valid {kind} event: {applied.errors}"

        def model_match(self, worker: int, query: Path) -> int:
            n = 0
            while n < len(query) and query[: n + 1] in self.stored[worker]:
                n += 1
            return n

        def query_hashes(self, query: Path) -> list[int]:
            tokens = [t for depth, c in enumerate(query) for t in block_tokens(c, depth)]
            return self.index.content_hashes(tokens, BLOCK)

        def check_query(self, query: Path, tree: str = "live") -> None:
            got = self.index.match(tree, self.query_hashes(query))
            queries_log.append(1)
            for worker in WORKERS:
                expected = self.model_match(worker, query)
                assert got.get(worker, 0) == expected, (
                    f"{tree} index: worker {worker} matches {got.get(worker, 0)} blocks "
                    f"of a {len(query)}-block query, model {expected}"
                )

        @rule(
            worker=st.sampled_from(WORKERS),
            base=st.integers(0, 6),
            contents=st.lists(st.integers(0, 2), min_size=1, max_size=3),
        )
        def store(self, worker: int, base: int, contents: list[int]) -> None:
            prefixes = sorted(self.stored[worker])
            parent: Path = prefixes[base % len(prefixes)] if prefixes and base else ()
            blocks, path = [], parent
            for content in contents:
                path = (*path, content)
                if path in self.stored[worker]:
                    continue
                blocks.append(IndexBlock(external_hash(path), tuple(block_tokens(content, len(path) - 1))))
            if not blocks:
                return
            first_new = len(path) - len(blocks)
            parent_path = path[:first_new]
            self.apply(
                "stored",
                worker,
                parent=external_hash(parent_path) if parent_path else None,
                blocks=tuple(blocks),
            )
            for depth in range(first_new, len(path)):
                self.stored[worker].add(path[: depth + 1])

        @precondition(lambda self: any(self.stored.values()))
        @rule(worker=st.sampled_from(WORKERS), pick=st.integers(0, 50))
        def evict_leaf(self, worker: int, pick: int) -> None:
            leaves = sorted(
                p
                for p in self.stored[worker]
                if not any(q[: len(p)] == p and len(q) > len(p) for q in self.stored[worker])
            )
            if not leaves:
                return
            leaf = leaves[pick % len(leaves)]
            self.apply("removed", worker, hashes=(external_hash(leaf),))
            self.stored[worker].discard(leaf)

        @rule(worker=st.sampled_from(WORKERS))
        def clear(self, worker: int) -> None:
            self.apply("cleared", worker)
            self.stored[worker].clear()

        @rule(contents=st.lists(st.integers(0, 2), min_size=1, max_size=5))
        def query(self, contents: list[int]) -> None:
            self.check_query(tuple(contents))

        def teardown(self) -> None:
            dump = self.index.dump("live")
            self.index.new_tree("replayed")
            applied = self.index.apply("replayed", dump)
            assert applied.rejected == 0, f"replaying the dump was rejected: {applied.errors[:3]}"
            for worker in WORKERS:
                for path in sorted(self.stored[worker]):
                    self.check_query(path, tree="replayed")

    return RadixIndexMachine


def test_radix_index_matches_model(engine: EngineAdapter, verdict: Verdict) -> None:
    queries: list[int] = []
    violation = ""
    try:
        run_state_machine_as_test(machine_for(engine, queries), settings=RUN)
    except AssertionError as exc:
        violation = str(exc).splitlines()[0]
    verdict.record("queries_checked", len(queries))
    verdict.require("queries_checked", len(queries), ">=", 30, note="the machine must really have run")
    verdict.equal("index_disagreements", int(bool(violation)), 0, note=violation[:400])
    verdict.conclude()
