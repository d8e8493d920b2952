"""Where a session's time goes, per engine: start-ups (launch to ready), teardowns, and waits
on the engine (HTTP requests, driver calls). The rest of a check's time is the harness's.

Written into results.json (session.engine_time, and engine_time per check) so that
benchmarks/verdict_profile.py can split a run without instrumenting the checks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass


@dataclass
class EngineTime:
    starts: int = 0
    start_s: float = 0.0
    stops: int = 0
    stop_s: float = 0.0
    calls: int = 0
    call_s: float = 0.0

    def minus(self, earlier: EngineTime) -> EngineTime:
        return EngineTime(
            self.starts - earlier.starts,
            self.start_s - earlier.start_s,
            self.stops - earlier.stops,
            self.stop_s - earlier.stop_s,
            self.calls - earlier.calls,
            self.call_s - earlier.call_s,
        )

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


_LOCK = threading.Lock()
_LEDGER: dict[str, EngineTime] = {}
# A call made while a start is timed (a health probe, a login) is start-up time, not a wait.
_IN_START = threading.local()
_IN_STOP = threading.local()


def _entry(engine: str) -> EngineTime:
    return _LEDGER.setdefault(engine, EngineTime())


def add_start(engine: str, seconds: float) -> None:
    with _LOCK:
        entry = _entry(engine)
        entry.starts += 1
        entry.start_s += seconds


def add_stop(engine: str, seconds: float) -> None:
    with _LOCK:
        entry = _entry(engine)
        entry.stops += 1
        entry.stop_s += seconds


def add_call(engine: str, seconds: float) -> None:
    """A wait on the engine. Only the main thread's count: samplers scrape in threads of
    their own while a check waits, and their time overlaps the check's."""
    if getattr(_IN_START, "active", False) or threading.current_thread() is not threading.main_thread():
        return
    with _LOCK:
        entry = _entry(engine)
        entry.calls += 1
        entry.call_s += seconds


@contextmanager
def engine_call(engine: str) -> Iterator[None]:
    t0 = time.monotonic()
    try:
        yield
    finally:
        add_call(engine, time.monotonic() - t0)


@contextmanager
def starting(engine: str) -> Iterator[None]:
    """Time a start-up: everything inside counts as start time, calls included. Nested (an
    adapter's start that launches servers of its own) it counts once, at the outside."""
    if getattr(_IN_START, "active", False):
        yield
        return
    t0 = time.monotonic()
    _IN_START.active = True
    try:
        yield
    finally:
        _IN_START.active = False
        add_start(engine, time.monotonic() - t0)


@contextmanager
def stopping(engine: str) -> Iterator[None]:
    """Time a teardown; nested, it counts once, at the outside."""
    if getattr(_IN_STOP, "active", False):
        yield
        return
    t0 = time.monotonic()
    _IN_STOP.active = True
    try:
        yield
    finally:
        _IN_STOP.active = False
        add_stop(engine, time.monotonic() - t0)


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
