"""Background sampling at a steady rate: memory curves, gauge series."""

from __future__ import annotations

import threading
import time
from typing import Self


class PeriodicSampler:
    """Calls `sample()` every `interval_s` in a daemon thread while the context is open.

    The schedule is fixed (a late sample does not push the next ones back), so the achieved
    rate shows how well the machine kept up; errors are collected, never raised in the thread.
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True, name=type(self).__name__)

    def sample(self) -> None:
        raise NotImplementedError

    @property
    def origin(self) -> float:
        """time.monotonic() at the sampler's t = 0 (to put other clocks' records on its axis)."""
        return self._t0

    def now(self) -> float:
        """Seconds since the sampler was created (the time axis of its series)."""
        return time.monotonic() - self._t0

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception as exc:  # a sample that fails is recorded, the series goes on
                self.errors.append(f"{type(exc).__name__}: {exc}")
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))
