"""KV event capture -> one ledger (stored / removed / cleared with sequence numbers) + checker.

Every engine that emits KV events feeds the same ledger, in one plain form. The checker
rebuilds the resident block set from the history alone (Jepsen's discipline: record, then
judge with an independent model) and reports:
  - remove_unknown: a block removed that was never stored (or stored only before a clear);
  - double_remove: a block removed more times than it was stored since it was last gone (its
    copies counted: a hash may be cached in several physical blocks, each announced stored and
    each announced removed, as vLLM 0.32.0 does — block_pool.py's NOTE #1; such a stream balances
    as a multiset, and Dynamo's EventDedupFilter and llm-d refcount it. Copies are counted and
    recorded, never judged);
  - seq_gap: sequence numbers the engine skipped (transport losses are filled by replay
    before judging, where the engine offers one, so a gap is the engine's own);
  - seq_regress: a sequence number repeated or going backwards (also as the engine sent them:
    a live batch arriving after a later one, or a live batch repeated, noted by the subscriber).
Batches that failed to decode cannot be judged: EventLedger.judge() raises UndecodableEvents
naming them (they were never silently dropped from the history being judged).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvconform.errors import KvconformError

Kind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True)
class KvEvent:
    seq: int  # the engine's sequence number (per batch where the engine batches events)
    kind: Kind
    block_hashes: tuple[str, ...] = ()
    parent_hash: str | None = None
    medium: str = "device"
    token_count: int = 0
    sub: int = 0  # position inside the engine's batch

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "kind": self.kind,
            "blocks": list(self.block_hashes),
            "parent": self.parent_hash,
            "medium": self.medium,
        }


@dataclass
class Violation:
    kind: str
    seq: int
    block: str | None = None
    detail: str = ""

    def __str__(self) -> str:
        where = f" block {self.block}" if self.block else ""
        return f"{self.kind} at seq {self.seq}{where}{': ' + self.detail if self.detail else ''}"


@dataclass
class LedgerVerdict:
    events: int
    stored: int
    removed: int
    cleared: int
    resident: dict[str, Counter[str]]  # medium -> hash -> copies resident
    violations: list[Violation] = field(default_factory=list)
    restored_resident: int = 0  # store of a hash already resident: another copy (not a violation)
    copies_removed_while_resident: int = 0  # a removal that left another copy of its hash resident

    def counts(self) -> dict[str, int]:
        return dict(Counter(v.kind for v in self.violations))

    def resident_count(self, medium: str | None = None) -> int:
        """Blocks resident by the ledger, every announced copy counted (physical blocks)."""
        media = [self.resident.get(medium, Counter())] if medium is not None else self.resident.values()
        return sum(sum(copies.values()) for copies in media)


class UndecodableEvents(KvconformError):
    """KV-event batches the subscriber could not decode: the ledger lacks their events."""


class EventLedger:
    """Thread-safe append-only history; `judge()` is a pure function of it (plus what the
    transport noted: undecodable batches, batches out of the engine's order)."""

    def __init__(self, first_seq: int = 0) -> None:
        """`first_seq`: the number the publisher gives its first batch or record (0 for vLLM's,
        SGLang's and Dynamo's publishers; LMCache's records start at 1)."""
        self._events: list[KvEvent] = []
        self._lock = threading.Lock()
        self.first_seq = first_seq
        self.undecodable: dict[int, str] = {}  # seq -> why it failed to decode
        self.disorder: list[Violation] = []  # seq_regress seen on arrival

    def note_undecodable(self, seq: int, why: str) -> None:
        with self._lock:
            self.undecodable[seq] = why

    def note_decoded(self, seq: int) -> None:
        """A batch that failed live but came whole from the engine's replay socket."""
        with self._lock:
            self.undecodable.pop(seq, None)

    def note_disorder(self, seq: int, detail: str) -> None:
        with self._lock:
            self.disorder.append(Violation("seq_regress", seq, detail=detail))

    def extend(self, events: Iterable[KvEvent]) -> None:
        with self._lock:
            self._events.extend(events)

    def events(self) -> list[KvEvent]:
        with self._lock:
            return list(self._events)

    def mark(self) -> int:
        with self._lock:
            return len(self._events)

    def since(self, mark: int) -> list[KvEvent]:
        with self._lock:
            return list(self._events[mark:])

    def judge(self, since: int = 0) -> LedgerVerdict:
        """Judge the whole history (the resident set needs all of it), reporting only the
        violations from the `since` mark on (a check's own events: one engine instance serves
        several checks, and an earlier check's violation is that check's)."""
        with self._lock:
            undecodable = dict(self.undecodable)
            disorder = list(self.disorder)
            history = list(self._events)
        if undecodable:
            shown = "; ".join(f"seq {seq}: {why}" for seq, why in sorted(undecodable.items())[:5])
            raise UndecodableEvents(
                f"KV events: {len(undecodable)} batch(es) failed to decode (also from replay) and are "
                f"missing from the ledger, so it cannot be judged: {shown}"
            )
        verdict = judge(history)
        verdict.violations.extend(disorder)
        first_seq = min((e.seq for e in history), default=self.first_seq)
        if first_seq > self.first_seq:  # one ledger per publisher instance, from its first number
            missing = first_seq - self.first_seq
            verdict.violations.append(
                Violation(
                    "seq_gap", first_seq, detail=f"start -> {first_seq}: {missing} missing at the start"
                )
            )
        if since:
            recent = history[since:]
            first = min((e.seq for e in recent), default=None)
            # the counts the check records are its own too (judge()'s counting rule over its
            # events alone); the resident set stays the whole history's
            own = judge(recent)
            verdict.events, verdict.stored = own.events, own.stored
            verdict.removed, verdict.cleared = own.removed, own.cleared
            verdict.restored_resident = own.restored_resident
            verdict.copies_removed_while_resident = own.copies_removed_while_resident
            verdict.violations = [v for v in verdict.violations if first is not None and v.seq >= first]
        return verdict


class StreamLedger(EventLedger):
    """One stream of a StreamedLedger: an EventLedger that also tells its owner the order in
    which events of all streams arrived (so one mark spans every stream)."""

    def __init__(self, owner: StreamedLedger, name: str) -> None:
        super().__init__()
        self.owner = owner
        self.name = name

    def extend(self, events: Iterable[KvEvent]) -> None:
        batch = list(events)
        with self.owner.arrival_lock:
            self.owner.arrivals.extend([self.name] * len(batch))
            super().extend(batch)


class StreamedLedger(EventLedger):
    """Several event streams numbered apart: one per worker of an engine that runs several
    (Dynamo's mockers each publish their own sequence from 0). Each stream is judged on its
    own (sequence numbers, removals against its own stores); a block is resident per stream, so
    the same hash held by two workers counts twice. Checks read it as one ledger."""

    def __init__(self, names: Iterable[str]) -> None:
        super().__init__()
        self.arrival_lock = threading.Lock()
        self.arrivals: list[str] = []  # the stream of each event, in arrival order
        self.streams = {name: StreamLedger(self, name) for name in names}

    def extend(self, events: Iterable[KvEvent]) -> None:
        raise TypeError("a StreamedLedger takes events through its streams")

    def events(self) -> list[KvEvent]:
        return [e for ledger in self.streams.values() for e in ledger.events()]

    def mark(self) -> int:
        with self.arrival_lock:
            return len(self.arrivals)

    def since(self, mark: int) -> list[KvEvent]:
        with self.arrival_lock:
            before = Counter(self.arrivals[:mark])
        return [e for name, ledger in self.streams.items() for e in ledger.since(before[name])]

    def judge(self, since: int = 0) -> LedgerVerdict:
        with self.arrival_lock:
            before = Counter(self.arrivals[:since])
        merged = LedgerVerdict(0, 0, 0, 0, {})
        for name, ledger in self.streams.items():
            # A stream with no event before the mark is judged whole: all of it is this check's.
            part = ledger.judge(since=before[name])
            merged.events += part.events
            merged.stored += part.stored
            merged.removed += part.removed
            merged.cleared += part.cleared
            merged.restored_resident += part.restored_resident
            merged.copies_removed_while_resident += part.copies_removed_while_resident
            for medium, copies in part.resident.items():
                live = merged.resident.setdefault(medium, Counter())
                for block, count in copies.items():
                    live[f"{name}/{block}"] += count
            merged.violations += [
                Violation(v.kind, v.seq, v.block, f"stream {name}" + (f": {v.detail}" if v.detail else ""))
                for v in part.violations
            ]
        return merged


def judge(history: list[KvEvent]) -> LedgerVerdict:
    ordered = sorted(history, key=lambda e: (e.seq, e.sub))
    resident: dict[str, Counter[str]] = {}
    removed_since_store: dict[str, set[str]] = {}
    violations: list[Violation] = []
    stored = removed = cleared = restored = copy_removed = 0
    previous: tuple[int, int] | None = None
    for event in ordered:
        if previous is not None:
            if (event.seq, event.sub) == previous:
                violations.append(Violation("seq_regress", event.seq, detail="sequence number repeated"))
            elif event.seq > previous[0] + 1:
                missing = event.seq - previous[0] - 1
                violations.append(
                    Violation("seq_gap", event.seq, detail=f"{previous[0]} -> {event.seq}: {missing} missing")
                )
        previous = (event.seq, event.sub)
        live = resident.setdefault(event.medium, Counter())
        gone = removed_since_store.setdefault(event.medium, set())
        if event.kind == "stored":
            for block in event.block_hashes:
                stored += 1
                if live[block] > 0:
                    restored += 1
                live[block] += 1
                gone.discard(block)
        elif event.kind == "removed":
            for block in event.block_hashes:
                removed += 1
                if live[block] > 0:
                    live[block] -= 1
                    if live[block]:
                        copy_removed += 1
                    else:
                        del live[block]
                        gone.add(block)
                elif block in gone:
                    violations.append(Violation("double_remove", event.seq, block, f"medium {event.medium}"))
                else:
                    violations.append(Violation("remove_unknown", event.seq, block, f"medium {event.medium}"))
        else:
            cleared += 1
            live.clear()
            gone.clear()
    return LedgerVerdict(len(ordered), stored, removed, cleared, resident, violations, restored, copy_removed)


def hash_text(value: Any) -> str:
    """One printable form for block hashes, whatever type the engine uses (int, bytes, str)."""
    if isinstance(value, bytes):
        return value.hex()
    return str(value)
