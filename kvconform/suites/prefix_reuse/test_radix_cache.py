"""An engine's radix cache obeys its invariants under any sequence of operations.

A Hypothesis state machine drives the real cache (insert on the scheduler's request path,
match, lock, unlock, evict) against a simple model of what was inserted and what is locked:
  - free + cached = capacity, and evictable + protected = cached, after every step;
  - a match (of a cached prompt, or of a shorter one cut anywhere in a page) never returns
    more than the longest page-aligned prefix ever inserted, and never less than the longest
    page-aligned prefix the model knows is still cached (inserted since the last step that
    could evict: an evict, or an insert the free pool could not hold without evicting; locked
    prefixes stay cached through both), so with no eviction in between a match is exact;
  - a locked prefix is never evicted;
  - after everything is unlocked and evicted, the cache is empty and the hashes it reported
    stored equal the hashes it reported removed (its KV events account for every block).
Failures are shrunk by Hypothesis to a minimal sequence of operations.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, RadixCacheModel, RadixSizes, facet
from kvconform.results import Verdict

pytestmark = pytest.mark.requires(C.RADIX_CACHE_MODEL)

CAPACITY = 256
PREFIXES = [[], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9, 9, 9, 9, 9], list(range(10, 30))]
RUN = settings(
    max_examples=20,
    stateful_step_count=25,
    deadline=None,
    report_multiple_bugs=False,  # one verdict per run: the first (shrunk) violation
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


def floor_page(n: int, page: int) -> int:
    return n // page * page


def machine_for(engine: EngineAdapter, page: int, stats_log: list[RadixSizes]) -> type:
    class RadixCacheMachine(RuleBasedStateMachine):
        sequences = Bundle("sequences")

        def __init__(self) -> None:
            super().__init__()
            self.cache = facet(engine, RadixCacheModel).new_cache(page, CAPACITY)
            self.inserted: list[list[int]] = []
            self.locks: list[tuple[int, list[int], int]] = []  # handle, tokens, locked length
            self.cached: list[list[int]] = []  # what the model knows is still cached
            self.stored: Counter[str] = Counter()
            self.removed: Counter[str] = Counter()
            self._take_events()

        def _take_events(self) -> None:
            for event in self.cache.take_events():
                hashes = [str(h) for h in event.block_hashes]
                if event.kind == "stored":
                    self.stored.update(hashes)
                elif event.kind == "removed":
                    self.removed.update(hashes)
                else:
                    self.stored.clear()
                    self.removed.clear()

        def longest_inserted(self, tokens: list[int], among: list[list[int]] | None = None) -> int:
            best = 0
            for seq in self.inserted if among is None else among:
                n = 0
                while n < min(len(seq), len(tokens)) and seq[n] == tokens[n]:
                    n += 1
                best = max(best, n)
            return floor_page(best, page)

        def longest_cached(self, tokens: list[int]) -> int:
            """The model's lower bound: what it knows nothing could have evicted."""
            return self.longest_inserted(tokens, self.cached + [t[:n] for _h, t, n in self.locks])

        def _may_have_evicted(self) -> None:
            self.cached = []  # only locked prefixes are still known to be cached

        @rule(
            target=sequences,
            prefix=st.sampled_from(PREFIXES),
            suffix=st.lists(st.integers(1, 40), min_size=1, max_size=24),
        )
        def insert(self, prefix: list[int], suffix: list[int]) -> list[int]:
            tokens = prefix + suffix
            if self.cache.sizes().available < len(tokens):
                self._may_have_evicted()  # admitting it may evict to make room
            prefix_len = self.cache.insert(tokens)
            assert prefix_len <= self.longest_inserted(tokens), (
                f"insert of {len(tokens)} tokens matched {prefix_len}, more than ever inserted"
            )
            self.inserted.append(tokens)
            self.cached.append(tokens)
            return tokens

        @rule(tokens=sequences)
        def match(self, tokens: list[int]) -> None:
            found = self.cache.match(tokens).prefix_len
            assert found <= self.longest_inserted(tokens), f"match {found} > longest inserted prefix"
            floor = self.longest_cached(tokens)
            assert found >= floor, f"match {found} < {floor} tokens the model knows are cached (lost hits)"

        @rule(tokens=sequences, cut=st.integers(1, 40))
        def match_shorter(self, tokens: list[int], cut: int) -> None:
            """A new request sharing only part of a cached prompt, cut anywhere in a page: the
            cache may reuse whole pages only."""
            self.match(tokens[: max(1, len(tokens) - cut)])

        @rule(tokens=sequences)
        def lock(self, tokens: list[int]) -> None:
            matched = self.cache.match(tokens)
            if matched.prefix_len and len(self.locks) < 4:
                self.cache.lock(matched.handle)
                self.locks.append((matched.handle, tokens, matched.prefix_len))

        @rule(data=st.data())
        def unlock(self, data: st.DataObject) -> None:
            if self.locks:
                handle, _tokens, _n = self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1)))
                self.cache.unlock(handle)

        @rule(num_tokens=st.integers(1, CAPACITY))
        def evict(self, num_tokens: int) -> None:
            self.cache.evict(num_tokens)
            self._may_have_evicted()
            for _handle, tokens, length in self.locks:
                found = self.cache.match(tokens).prefix_len
                assert found >= length, f"locked prefix of {length} tokens evicted (now {found})"

        @invariant()
        def sizes_add_up(self) -> None:
            s = self.cache.sizes()
            stats_log.append(s)
            assert s.available + s.total == s.capacity, f"free + cached != capacity: {s}"
            assert s.evictable + s.protected == s.total, f"evictable + protected != cached: {s}"

        def teardown(self) -> None:
            for handle, _tokens, _n in self.locks:
                self.cache.unlock(handle)
            self.cache.evict(CAPACITY)
            s = self.cache.sizes()
            assert s.total == 0, f"cache not empty after unlocking and evicting everything: {s}"
            self._take_events()
            missing = self.stored - self.removed
            extra = self.removed - self.stored
            assert not missing and not extra, (
                f"events: {sum(missing.values())} stored hashes never removed, "
                f"{sum(extra.values())} removed never stored"
            )

    return RadixCacheMachine


@pytest.mark.parametrize("page", [1, 4, 16])
def test_radix_cache_state_machine(engine: EngineAdapter, page: int, verdict: Verdict) -> None:
    stats_log: list[RadixSizes] = []
    violation = ""
    try:
        run_state_machine_as_test(machine_for(engine, page, stats_log), settings=RUN)
    except AssertionError as exc:
        violation = str(exc).splitlines()[0]
    verdict.record("page_size", page, "tokens")
    verdict.record("steps_checked", len(stats_log))
    verdict.require("steps_checked", len(stats_log), ">=", 50, note="the machine must really have run")
    verdict.equal("invariant_violations", int(bool(violation)), 0, note=violation[:400])
    verdict.conclude()
