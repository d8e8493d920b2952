"""Sampling an engine's offload gauges at a steady rate while a scenario runs."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from adapters.base import EngineAdapter

GAUGES = ("offload_usage", "offload_write_usage", "offload_read_usage")
COUNTERS = ("offload_store_bytes", "offload_load_bytes")


@dataclass
class GaugeSample:
    t: float
    usage: float
    write: float
    read: float
    counters: dict[str, float] = field(default_factory=dict)


class GaugeSampler:
    """Scrapes /metrics every `interval_s` (40 Hz asked, >= 20 Hz required) in a background thread."""

    def __init__(self, engine: EngineAdapter, interval_s: float = 0.025) -> None:
        self.engine = engine
        self.interval_s = interval_s
        self.samples: list[GaugeSample] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.counter_names = [c for c in COUNTERS if c in engine.metric_names]

    def __enter__(self) -> GaugeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        next_at = time.monotonic()
        while not self._stop.is_set():
            try:
                snap = self.engine.metrics()
                usage, write, read = (self.engine.metric(g, snap) for g in GAUGES)
                counters = {c: self.engine.metric(c, snap) for c in self.counter_names}
                self.samples.append(GaugeSample(time.monotonic() - self._t0, usage, write, read, counters))
            except Exception as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
            next_at += self.interval_s
            self._stop.wait(max(0.0, next_at - time.monotonic()))

    def now(self) -> float:
        return time.monotonic() - self._t0

    def rate_hz(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        return (len(self.samples) - 1) / (self.samples[-1].t - self.samples[0].t)
