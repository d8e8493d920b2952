"""Cross-stack: an engine's KV events, replayed into another stack's router index, give the
same prefix lengths as the engine's own cache (e.g. SGLang's events in Dynamo's format into
Dynamo's RadixTree). Runs when the session selects an engine with a drivable radix cache and
another with a router-side index.
"""

from __future__ import annotations

import pytest

from kvconform.contract import (
    CacheEvent,
    EngineAdapter,
    IndexBlock,
    IndexEvent,
    RadixCacheModel,
    RouterIndex,
    facet,
    supported,
)
from kvconform.contract import Capability as C
from kvconform.results import Verdict

pytestmark = pytest.mark.requires(C.RADIX_CACHE_MODEL)

PAGE = 16
WORKER = 1
U64 = (1 << 64) - 1


@pytest.fixture
def index_engine(other_engines: list[EngineAdapter]) -> EngineAdapter:
    for other in other_engines:
        if C.RADIX_INDEX in supported(other):
            return other
    pytest.skip("no engine with capability radix_index selected in this session (select one with --engine)")


def to_index_events(events: list[CacheEvent], first_id: int) -> list[IndexEvent]:
    out = []
    for i, event in enumerate(events, first_id):
        if event.kind == "stored":
            tokens, size = event.token_ids, event.block_size
            blocks = tuple(
                IndexBlock(h & U64, tuple(tokens[j * size : (j + 1) * size]))
                for j, h in enumerate(event.block_hashes)
            )
            parent = event.parent_hash
            out.append(
                IndexEvent(
                    "stored", WORKER, i, parent=parent & U64 if parent is not None else None, blocks=blocks
                )
            )
        elif event.kind == "removed":
            out.append(IndexEvent("removed", WORKER, i, hashes=tuple(h & U64 for h in event.block_hashes)))
        else:
            out.append(IndexEvent("cleared", WORKER, i))
    return out


def test_events_replayed_into_router_index_match(
    engine: EngineAdapter, index_engine: EngineAdapter, verdict: Verdict
) -> None:
    cache = facet(engine, RadixCacheModel).new_cache(PAGE, 1024)
    base = list(range(100, 164))
    sequences = [base + list(range(500 + 40 * i, 540 + 40 * i)) for i in range(6)]
    sequences += [base[:32] + list(range(900, 980)), list(range(2000, 2100))]
    for tokens in sequences:
        cache.insert(tokens)
    cache.evict(200)  # removals reach the index too
    events = cache.take_events(router_hashes=True)
    index = facet(index_engine, RouterIndex)
    index.new_tree("cross")
    applied = index.apply("cross", to_index_events(events, 1))
    verdict.record("events", len(events))
    verdict.equal("events_rejected_by_index", applied.rejected, 0, note="; ".join(applied.errors[:2]))
    differing = []
    for tokens in [*sequences, [*base, 1, 2, 3]]:
        own = cache.match(tokens).prefix_len
        routed = index.match("cross", index.content_hashes(tokens, PAGE)).get(WORKER, 0) * PAGE
        if routed != own:
            differing.append(f"{len(tokens)} tokens: index {routed} vs engine {own}")
    verdict.equal("queries_where_index_and_engine_differ", len(differing), 0, note="; ".join(differing[:4]))
    verdict.conclude()
