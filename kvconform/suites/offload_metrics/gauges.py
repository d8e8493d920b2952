"""Sampling an engine's offload gauges at a steady rate while a scenario runs."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvconform.contract import Capability as C
from kvconform.contract import EngineAdapter, read_metric, supported
from kvconform.metrics import only_names
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
        self.counter_names = [c for c in COUNTERS if c in engine.traits.metric_map]
        # an engine without offload gauges (only its host hits judged) is sampled for counters
        self.gauges = C.OFFLOAD_GAUGES in supported(engine)
        self.scraped = [
            name
            for m in (*(GAUGES if self.gauges else ()), *self.counter_names)
            if m in engine.traits.metric_map
            for name in engine.traits.metric_map.sample_names(m)
        ]

    def sample(self) -> None:
        with only_names(self.scraped):
            snap = self.engine.metrics()
        nan = float("nan")  # never judged: the gauge checks require OFFLOAD_GAUGES
        usage, write, read = (read_metric(self.engine, g, snap) if self.gauges else nan for g in GAUGES)
        counters = {c: read_metric(self.engine, c, snap) for c in self.counter_names}
        self.samples.append(GaugeSample(self.now(), usage, write, read, counters))

    def rate_hz(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        return (len(self.samples) - 1) / (self.samples[-1].t - self.samples[0].t)


@dataclass
class TransferWindow:
    """A stretch during which the engine's transfer worker had transfers of one kind in flight."""

    start: float
    end: float


def in_flight_windows(
    log: list[tuple[float, int]], origin: float, merge_gap_s: float
) -> list[TransferWindow]:
    """Stretches with > 0 in flight, from (monotonic time, count) changes, on the sampler's
    clock; transfers back to back (gaps under `merge_gap_s`, below what a scrape resolves) are
    one stretch."""
    windows: list[TransferWindow] = []
    start: float | None = None
    for t, count in log:
        if count > 0 and start is None:
            start = t - origin
            if windows and start - windows[-1].end < merge_gap_s:
                start = windows.pop().start
        elif count <= 0 and start is not None:
            windows.append(TransferWindow(start, t - origin))
            start = None
    if start is not None:
        windows.append(TransferWindow(start, float("inf")))
    return windows


def gauge_vs_transfers(
    samples: list[tuple[float, float]], windows: list[TransferWindow], slack_s: float, min_window_s: float
) -> tuple[list[str], list[str]]:
    """A gauge against what the worker knew: (samples above 0 with no transfer in flight within
    `slack_s` of them, windows the gauge never showed). `slack_s` covers the engine publishing
    the gauge after its scheduler hears of a transfer, and one scrape. Only windows the samples
    span and at least `min_window_s` long (what scrapes can resolve) are judged unseen."""
    phantom = [
        f"t={t:.3f}s gauge={value:.4g}"
        for t, value in samples
        if value > 0 and not any(w.start - slack_s <= t <= w.end + slack_s for w in windows)
    ]
    first, last = (samples[0][0], samples[-1][0]) if samples else (0.0, 0.0)
    unseen = [
        f"{w.start:.3f}-{w.end:.3f}s"
        for w in windows
        if w.end >= first + slack_s
        and w.end + slack_s <= last
        and w.end - w.start >= min_window_s
        and not any(value > 0 and w.start - slack_s <= t <= w.end + slack_s for t, value in samples)
    ]
    return phantom, unseen
