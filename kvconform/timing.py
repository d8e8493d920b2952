"""Where a session's time goes, per engine: start-ups (launch to ready), teardowns, and waits
on the engine (HTTP requests, driver calls). The rest of a check's time is the harness's.

Written into results.json (session.engine_time, and engine_time per check) so that
benchmarks/verdict_profile.py can split a run without instrumenting the checks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, fields


@dataclass
class EngineTime:
    starts: int = 0
    start_s: float = 0.0
    stops: int = 0
    stop_s: float = 0.0
    calls: int = 0
    call_s: float = 0.0

    def minus(self, earlier: EngineTime) -> EngineTime:
        return EngineTime(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def plus(self, other: EngineTime) -> EngineTime:
        return EngineTime(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


_LOCK = threading.Lock()
_LEDGER: dict[str, EngineTime] = {}
# A call made while a start is timed (a health probe, a login) is start-up time, not a wait.
_IN_START = threading.local()
_IN_STOP = threading.local()


def _entry(engine: str) -> EngineTime:
    return _LEDGER.setdefault(engine, EngineTime())


def _add(engine: str, count: str, seconds_field: str, seconds: float) -> None:
    with _LOCK:
        entry = _entry(engine)
        setattr(entry, count, getattr(entry, count) + 1)
        setattr(entry, seconds_field, getattr(entry, seconds_field) + seconds)


def add_call(engine: str, seconds: float) -> None:
    """A wait on the engine. Only the main thread's count: samplers scrape in threads of
    their own while a check waits, and their time overlaps the check's."""
    if getattr(_IN_START, "active", False) or threading.current_thread() is not threading.main_thread():
        return
    _add(engine, "calls", "call_s", seconds)


@contextmanager
def engine_call(engine: str) -> Iterator[None]:
    t0 = time.monotonic()
    try:
        yield
    finally:
        add_call(engine, time.monotonic() - t0)


@contextmanager
def _timed_once(flag: threading.local, engine: str, count: str, seconds_field: str) -> Iterator[None]:
    """Time the block into the ledger; nested inside another block of the same kind (an
    adapter's start that launches servers of its own), it counts once, at the outside."""
    if getattr(flag, "active", False):
        yield
        return
    t0 = time.monotonic()
    flag.active = True
    try:
        yield
    finally:
        flag.active = False
        _add(engine, count, seconds_field, time.monotonic() - t0)


def starting(engine: str) -> AbstractContextManager[None]:
    """Time a start-up: everything inside counts as start time, calls included."""
    return _timed_once(_IN_START, engine, "starts", "start_s")


def stopping(engine: str) -> AbstractContextManager[None]:
    """Time a teardown."""
    return _timed_once(_IN_STOP, engine, "stops", "stop_s")


def snapshot() -> dict[str, EngineTime]:
    with _LOCK:
        return {name: EngineTime(**asdict(entry)) for name, entry in _LEDGER.items()}


def since(earlier: dict[str, EngineTime]) -> dict[str, dict[str, float]]:
    now = snapshot()
    out = {}
    for name, entry in now.items():
        delta = entry.minus(earlier.get(name, EngineTime()))
        if delta.starts or delta.stops or delta.calls:
            out[name] = delta.as_dict()
    return out


def summed(ledgers: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per-check ledgers added up per engine: the session's ledger under xdist, where the
    controller starts no engine (session teardowns in the workers are not in any check's)."""
    known = {f.name for f in fields(EngineTime)}
    total: dict[str, EngineTime] = {}
    for ledger in ledgers:
        for engine, entry in ledger.items():
            total[engine] = total.get(engine, EngineTime()).plus(
                EngineTime(**{k: v for k, v in entry.items() if k in known})  # type: ignore[arg-type]  # counts are ints
            )
    return {engine: entry.as_dict() for engine, entry in total.items()}
