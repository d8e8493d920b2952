"""Sampling an engine's offload gauges at a steady rate while a scenario runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvconform.contract import EngineAdapter
from kvconform.sampling import PeriodicSampler

GAUGES = ("offload_usage", "offload_write_usage", "offload_read_usage")
COUNTERS = ("offload_store_bytes", "offload_load_bytes")


@dataclass
class GaugeSample:
    t: float
    usage: float
    write: float
    read: float
    counters: dict[str, float] = field(default_factory=dict)


class GaugeSampler(PeriodicSampler):
    """Scrapes /metrics every `interval_s` (40 Hz asked, >= 20 Hz required) in a background thread."""

    def __init__(self, engine: EngineAdapter, interval_s: float = 0.025) -> None:
        super().__init__(interval_s)
        self.engine = engine
        self.samples: list[GaugeSample] = []
        self.counter_names = [c for c in COUNTERS if c in engine.metric_names]

    def sample(self) -> None:
        snap = self.engine.metrics()
        usage, write, read = (self.engine.metric(g, snap) for g in GAUGES)
        counters = {c: self.engine.metric(c, snap) for c in self.counter_names}
        self.samples.append(GaugeSample(self.now(), usage, write, read, counters))

    def rate_hz(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        return (len(self.samples) - 1) / (self.samples[-1].t - self.samples[0].t)
