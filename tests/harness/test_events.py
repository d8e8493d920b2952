"""The event ledger's checker on crafted histories, and against a model (Hypothesis)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvconform.events import EventLedger, KvEvent, StreamedLedger, hash_text, judge


def stored(seq: int, *blocks: str, medium: str = "device", sub: int = 0) -> KvEvent:
    return KvEvent(seq, "stored", blocks, medium=medium, sub=sub)


def removed(seq: int, *blocks: str, medium: str = "device", sub: int = 0) -> KvEvent:
    return KvEvent(seq, "removed", blocks, medium=medium, sub=sub)


def cleared(seq: int, medium: str = "device", sub: int = 0) -> KvEvent:
    return KvEvent(seq, "cleared", medium=medium, sub=sub)


def test_clean_history() -> None:
    verdict = judge([stored(0, "a", "b"), removed(1, "a"), stored(2, "a"), removed(3, "a", "b")])
    assert verdict.violations == []
    assert (verdict.events, verdict.stored, verdict.removed, verdict.cleared) == (4, 3, 3, 0)
    assert verdict.resident_count() == 0


def test_double_remove() -> None:
    verdict = judge([stored(0, "a", "b"), removed(1, "a"), removed(2, "a")])
    assert verdict.counts() == {"double_remove": 1}
    (violation,) = verdict.violations
    assert (violation.seq, violation.block) == (2, "a")
    assert str(violation) == "double_remove at seq 2 block a: medium device"
    assert verdict.resident == {"device": Counter({"b": 1})}


def test_remove_unknown() -> None:
    verdict = judge([stored(0, "a"), removed(1, "zz")])
    assert verdict.counts() == {"remove_unknown": 1}
    assert verdict.violations[0].block == "zz"


def test_remove_on_another_medium_is_unknown() -> None:
    verdict = judge([stored(0, "a", medium="device"), removed(1, "a", medium="cpu")])
    assert verdict.counts() == {"remove_unknown": 1}
    assert verdict.resident_count("device") == 1 and verdict.resident_count("cpu") == 0


def test_seq_gap() -> None:
    verdict = judge([stored(0, "a"), stored(1, "b"), stored(4, "c")])
    assert verdict.counts() == {"seq_gap": 1}
    assert verdict.violations[0].seq == 4
    assert "1 -> 4: 2 missing" in str(verdict.violations[0])


def test_seq_gap_at_the_start() -> None:
    """A publisher numbers an instance's batches from 0: batches lost before the first one that
    arrived have no earlier number to show their gap, only the first number does."""
    ledger = EventLedger()
    ledger.extend([stored(3, "a"), stored(4, "b")])
    verdict = ledger.judge()
    assert verdict.counts() == {"seq_gap": 1}
    assert "start -> 3: 3 missing at the start" in str(verdict.violations[0])
    assert judge(ledger.since(0)).counts() == {}  # a window alone may start anywhere


def test_seq_repeat() -> None:
    verdict = judge([stored(0, "a"), stored(1, "b"), stored(1, "c")])
    assert verdict.counts() == {"seq_regress": 1}
    assert verdict.resident_count() == 3


def test_batched_events_share_a_seq_and_arrive_in_any_order() -> None:
    """Engines batch events under one sequence number; `sub` orders them inside the batch."""
    history = [removed(1, "a", sub=1), stored(1, "a", sub=0), stored(0, "x"), removed(2, "x")]
    verdict = judge(history)
    assert verdict.violations == []
    assert verdict.resident_count() == 0


def test_cleared_resets_the_medium() -> None:
    history = [
        stored(0, "a", "b"),
        stored(1, "h", medium="cpu"),
        removed(2, "a"),
        cleared(3),
        removed(4, "b"),  # stored only before the clear
        removed(5, "a"),  # removed before the clear: after it, unknown rather than double
        removed(6, "h", medium="cpu"),  # the other medium kept its blocks
        stored(7, "b"),
        removed(8, "b"),
    ]
    verdict = judge(history)
    assert [(v.kind, v.seq, v.block) for v in verdict.violations] == [
        ("remove_unknown", 4, "b"),
        ("remove_unknown", 5, "a"),
    ]
    assert verdict.cleared == 1
    assert verdict.resident_count() == 0


def test_copies_balance_as_a_multiset() -> None:
    """vLLM 0.32.0 announces each physical copy of a hash stored and each copy removed
    (block_pool.py NOTE #1): the stream balances, no violation; one removal more is one."""
    copies = [stored(0, "a"), stored(1, "a"), removed(2, "a"), removed(3, "a")]
    verdict = judge(copies)
    assert verdict.violations == [] and verdict.resident_count() == 0
    assert (verdict.restored_resident, verdict.copies_removed_while_resident) == (1, 1)
    assert judge([*copies, removed(4, "a")]).counts() == {"double_remove": 1}
    assert judge([stored(0, "a"), stored(1, "a"), removed(2, "a")]).resident_count() == 1


def test_store_of_a_resident_block_is_counted_not_a_violation() -> None:
    verdict = judge([stored(0, "a"), stored(1, "a"), removed(2, "a")])
    assert verdict.violations == []
    assert verdict.restored_resident == 1


def test_ledger_marks_and_hash_text() -> None:
    ledger = EventLedger()
    ledger.extend([stored(0, "a")])
    mark = ledger.mark()
    ledger.extend([removed(1, "a"), removed(2, "a")])
    assert [e.seq for e in ledger.since(mark)] == [1, 2]
    assert ledger.judge().counts() == {"double_remove": 1}
    assert judge(ledger.since(mark)).counts() == {"remove_unknown": 2}  # judged alone
    assert hash_text(b"\x01\xff") == "01ff" and hash_text(12345) == "12345" and hash_text("ab") == "ab"
    assert stored(0, "a").as_dict() == {
        "seq": 0,
        "kind": "stored",
        "blocks": ["a"],
        "parent": None,
        "medium": "device",
    }


BLOCKS = [f"b{i}" for i in range(8)]
MEDIA = ["device", "cpu"]


class LedgerMachine(RuleBasedStateMachine):
    """Random store / remove / clear traffic, batched like engines batch it, recorded in a
    ledger in shuffled arrival order; the checker must agree with a plain model."""

    @initialize()
    def setup(self) -> None:
        self.ledger = EventLedger()
        self.seq = 0
        self.resident: dict[str, Counter[str]] = {m: Counter() for m in MEDIA}
        self.removed: dict[str, set[str]] = {m: set() for m in MEDIA}
        self.expected: list[tuple[str, int, str | None]] = []
        self.rng = random.Random(0)

    def _emit(self, events: list[KvEvent]) -> None:
        batch = list(events)
        self.rng.shuffle(batch)  # arrival order inside a batch does not matter
        self.ledger.extend(batch)
        self.seq += 1

    @rule(
        blocks=st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=4),
        medium=st.sampled_from(MEDIA),
        then_remove=st.lists(st.sampled_from(BLOCKS), max_size=3),
    )
    def store(self, blocks: list[str], medium: str, then_remove: list[str]) -> None:
        """One batch: a store, then (same seq, later sub) removals, as an evicting step does."""
        events = [KvEvent(self.seq, "stored", tuple(blocks), medium=medium, sub=0)]
        self.resident[medium].update(blocks)  # every copy counted, duplicates in a batch too
        self.removed[medium] -= set(blocks)
        if then_remove:
            events.append(KvEvent(self.seq, "removed", tuple(then_remove), medium=medium, sub=1))
            self._model_remove(then_remove, medium)
        self._emit(events)

    @rule(blocks=st.lists(st.sampled_from(BLOCKS), min_size=1, max_size=4), medium=st.sampled_from(MEDIA))
    def remove(self, blocks: list[str], medium: str) -> None:
        self._model_remove(blocks, medium)
        self._emit([KvEvent(self.seq, "removed", tuple(blocks), medium=medium)])

    @rule(medium=st.sampled_from(MEDIA))
    def clear(self, medium: str) -> None:
        self.resident[medium].clear()
        self.removed[medium].clear()
        self._emit([KvEvent(self.seq, "cleared", medium=medium)])

    def _model_remove(self, blocks: list[str], medium: str) -> None:
        for block in blocks:
            if self.resident[medium][block] > 0:
                self.resident[medium][block] -= 1
                if not self.resident[medium][block]:
                    self.removed[medium].add(block)
            elif block in self.removed[medium]:
                self.expected.append(("double_remove", self.seq, block))
            else:
                self.expected.append(("remove_unknown", self.seq, block))

    @invariant()
    def agrees_with_the_model(self) -> None:
        verdict = self.ledger.judge()
        for medium in MEDIA:
            assert verdict.resident.get(medium, Counter()) == self.resident[medium]
        got = sorted((v.kind, v.seq, v.block) for v in verdict.violations)
        assert got == sorted(self.expected)
        assert verdict.events == len(self.ledger.events())


LedgerMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
TestLedgerMachine = LedgerMachine.TestCase


def test_judge_since_a_mark_reports_only_that_checks_violations() -> None:
    """One engine instance serves several checks: an earlier check's double remove is that
    check's, while the resident set still comes from the whole history."""
    ledger = EventLedger()
    ledger.extend([stored(0, "a", "b"), removed(1, "a"), removed(2, "a")])
    mark = ledger.mark()
    ledger.extend([removed(3, "b"), stored(4, "c")])
    later = ledger.judge(since=mark)
    assert later.violations == [] and later.events == 2
    assert (later.stored, later.removed) == (1, 1), "the counts recorded are the check's own"
    assert later.resident == {"device": Counter({"c": 1})}
    ledger.extend([removed(5, "b")])
    assert ledger.judge(since=mark).counts() == {"double_remove": 1}
    assert ledger.judge().counts() == {"double_remove": 2}
    empty = EventLedger()
    assert empty.judge(since=empty.mark()).violations == []


def test_streams_are_numbered_and_judged_apart() -> None:
    """Two workers each number their events from 0 and hold their own blocks: no gap or regress
    across streams, the same hash on both counts twice, a violation names its stream."""
    ledger = StreamedLedger(["w0", "w1"])
    ledger.streams["w0"].extend([stored(0, "a"), stored(1, "b")])
    ledger.streams["w1"].extend([stored(0, "a")])
    whole = ledger.judge()
    assert whole.violations == [] and whole.resident_count() == 3
    mark = ledger.mark()
    ledger.streams["w1"].extend([removed(1, "a"), removed(2, "a")])
    ledger.streams["w0"].extend([removed(2, "b")])
    later = ledger.judge(since=mark)
    assert later.counts() == {"double_remove": 1} and "stream w1" in later.violations[0].detail
    assert (later.events, later.removed) == (3, 3)
    assert later.resident == {"device": Counter({"w0/a": 1})}
    ledger.streams["w0"].extend([stored(4, "c")])
    assert ledger.judge(since=ledger.mark() - 1).counts() == {"seq_gap": 1}
    with pytest.raises(TypeError):
        ledger.extend([stored(9, "z")])


def test_a_publisher_numbering_from_one_starts_whole_at_one() -> None:
    """LMCache numbers its records from 1: its first record is no gap, a lost one still is."""
    whole = EventLedger(first_seq=1)
    whole.extend([stored(1, "a"), stored(2, "b")])
    assert whole.judge().counts() == {}
    lost = EventLedger(first_seq=1)
    lost.extend([stored(2, "a"), stored(3, "b")])
    verdict = lost.judge()
    assert verdict.counts() == {"seq_gap": 1}
    assert "start -> 2: 1 missing at the start" in str(verdict.violations[0])
