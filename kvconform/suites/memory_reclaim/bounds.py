"""Bounds of the memory verdicts (defaults justified in docs/memory-bounds.md, overridable by options).

Exact measures (mapped/leftover bytes, per-process GPU memory) move only when memory really
is held, so both the final delta and the leak slope are bounded by half a KV block: a leak
of one block per cycle is caught. RSS-like measures carry allocator noise; their bounds sit
above the noise measured on clean runs (benchmarks/reclaim_power.py), and their slope is
decided by its confidence band, the churn extended until the band clears the bound
(benchmarks/rss_flake_rate.py measures how often a clean run still fails).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pytest

from kvconform.contract import EngineAdapter, deployed_block_size
from kvconform.memory import MemoryMeasure
from kvconform.oracles import theil_sen

NOISY_TOLERANCE_BYTES = 16 * 2**20
NOISY_SLOPE_BYTES = 2 * 2**20
COUNT_BOUND = 0.5  # counted things (leftover processes): not one may be left
# For the release gate: between two runs, RSS moving less than this is allocator noise (clean
# runs moved 0.1-3 MB); exact measures get no tolerance.
RSS_GATE_TOLERANCE_BYTES = 4 * 2**20
RSS_GATE_SLOPE_TOLERANCE_BYTES = 1 * 2**20
# A noisy slope whose band straddles its bound: churn on, up to this many times the cycles asked.
MAX_CYCLE_FACTOR = 3


@dataclass(frozen=True)
class Bounds:
    exact_tolerance: float
    exact_slope: float
    noisy_tolerance: float
    noisy_slope: float

    def tolerance(self, measure: MemoryMeasure) -> float:
        if measure.unit != "bytes":
            return COUNT_BOUND
        return self.exact_tolerance if measure.exact else self.noisy_tolerance

    def gate_tolerance(self, measure: MemoryMeasure, slope: bool = False) -> float:
        if measure.exact or measure.unit != "bytes":
            return 0.0
        return RSS_GATE_SLOPE_TOLERANCE_BYTES if slope else RSS_GATE_TOLERANCE_BYTES

    def slope(self, measure: MemoryMeasure) -> float:
        if measure.unit != "bytes":
            return COUNT_BOUND
        return self.exact_slope if measure.exact else self.noisy_slope


def bounds_for(config: pytest.Config, engine: EngineAdapter) -> Bounds:
    half_block = engine.deployment.model.block_bytes(deployed_block_size(engine)) / 2
    slope = config.getoption("--leak-slope-bytes")
    tolerance = config.getoption("--memory-tolerance-bytes")
    return Bounds(
        exact_tolerance=tolerance if tolerance is not None else half_block,
        exact_slope=slope if slope is not None else half_block,
        noisy_tolerance=NOISY_TOLERANCE_BYTES,
        noisy_slope=NOISY_SLOPE_BYTES,
    )


def undecided(
    kinds: Mapping[str, MemoryMeasure],
    baseline: Mapping[str, float],
    values: Mapping[str, Sequence[float]],
    bounds: Bounds,
) -> list[str]:
    """Noisy measures whose Theil-Sen band still straddles the slope bound."""
    out = []
    for name, series in values.items():
        kind = kinds[name]
        if kind.exact:
            continue
        trend = theil_sen([baseline[name], *series])
        if trend.low <= bounds.slope(kind) < trend.high:
            out.append(name)
    return out
