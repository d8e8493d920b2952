"""Waiting on a condition with a deadline (never on the value under test)."""

from __future__ import annotations

import time
from typing import Any


def poll_until(predicate: Any, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return bool(predicate())
