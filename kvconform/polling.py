"""Waiting on a condition with a deadline (never on the value under test)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def poll_until(predicate: Any, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())


def seconds_until_steady(condition: Callable[[], bool], timeout_s: float, quiet_s: float = 0.0) -> float:
    """Seconds until condition() held and kept holding for quiet_s; timeout_s if it never did."""
    t0 = time.monotonic()
    since = None
    while time.monotonic() - t0 < timeout_s:
        if condition():
            since = since or time.monotonic()
            if time.monotonic() - since >= quiet_s:
                return round(since - t0, 2)
        else:
            since = None
        time.sleep(0.1)
    return round(timeout_s, 2)
