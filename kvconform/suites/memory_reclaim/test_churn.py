"""Memory returns to baseline after instance churn, through every release path.

One create -> delete cycle proves little (vLLM's own test does one); a leak shows as a slope
over many. Each cycle creates an instance, loads it with prefix-sharing requests and releases
it; memory of the engine's own processes is sampled continuously, the baseline is taken
after a warm-up cycle, and each cycle's post-release minimum is kept. Verdict per measure:
final delta vs baseline within a tolerance, and a Theil-Sen leak slope below a bound.

No coin tosses: an exact measure (mapped bytes, counts, per-process GPU memory) moves only
when memory is held, so its slope is judged as is. A noisy one (RSS) is judged by the
slope's 95 % confidence band: the churn goes on, a few cycles at a time (up to
MAX_CYCLE_FACTOR x the requested cycles, as far as the release path allows), until the whole
band is on one side of the bound; if it still straddles the bound, the check fails as
INCONCLUSIVE (its own outcome in results.json), never a pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import (
    EngineAdapter,
    EngineConfig,
    InstanceChurn,
    ReclaimProbe,
    deployed_block_size,
    ensure,
    facet,
)
from kvconform.memory import MemoryMeasure
from kvconform.oracles import theil_sen
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict
from kvconform.sampling import PeriodicSampler
from kvconform.suites.memory_reclaim.bounds import MAX_CYCLE_FACTOR, bounds_for, undecided

pytestmark = pytest.mark.requires(C.INSTANCE_CHURN)

RELEASE_PATHS = ("unregister", "reaper", "close", "restart", "destroy")
Probe = Callable[[], dict[str, MemoryMeasure]]


def settled(
    probe: Probe, baseline: dict[str, MemoryMeasure] | None, window_s: float = 2.0
) -> dict[str, float]:
    """Per-measure minimum over a short window (early exit once back at baseline)."""
    best: dict[str, float] = {}
    deadline = time.monotonic() + window_s
    while True:
        for name, measure in probe().items():
            best[name] = min(best.get(name, measure.value), measure.value)
        back = baseline is not None and all(best[n] <= baseline[n].value for n in baseline if n in best)
        if back or time.monotonic() > deadline:
            return best
        time.sleep(0.1)


class ContinuousSampler(PeriodicSampler):
    """Every measure of the engine's reclaim probe, over time."""

    def __init__(self, probe: Probe, interval_s: float = 0.25) -> None:
        super().__init__(interval_s)
        self.probe = probe
        self.points: dict[str, list[tuple[float, float]]] = {}

    def sample(self) -> None:
        t = self.now()
        for name, measure in self.probe().items():  # raises between instances: recorded, skipped
            self.points.setdefault(name, []).append((t, measure.value))


@pytest.mark.parametrize("path", RELEASE_PATHS)
def test_churn_returns_to_baseline(
    engine: EngineAdapter, path: str, prompts: PromptFactory, verdict: Verdict, request: pytest.FixtureRequest
) -> None:
    churn = facet(engine, InstanceChurn)
    if path not in churn.paths:
        pytest.skip(f"engine {engine.name} has no release path {path!r} (has {', '.join(churn.paths)})")
    ensure(engine, EngineConfig())
    cycles = churn.cycles(path, request.config.getoption("--churn-cycles"))
    bounds = bounds_for(request.config, engine)
    block = deployed_block_size(engine)
    system = prompts.fresh(4 * block)
    for warmup in range(churn.warmup_cycles(path)):  # allocator pools and caches settle first
        churn.cycle(churn.warmup_path(path), -1 - warmup, prompts.extend(system, 6 * block))
    probe = partial(facet(engine, ReclaimProbe).reclaim_probe, path)  # what `path` leaves behind
    baseline_measures = probe()
    baseline = settled(probe, None, window_s=1.0)
    values: dict[str, list[float]] = {name: [] for name in baseline}
    most = max(cycles, churn.cycles(path, MAX_CYCLE_FACTOR * cycles))
    step = max(2, cycles // 2)
    done = 0
    with ContinuousSampler(probe) as sampler:
        target = cycles
        while True:
            for cycle in range(done + 1, target + 1):
                churn.cycle(path, cycle, prompts.extend(system, 6 * block + cycle))
                post = settled(probe, baseline_measures)
                for name in values:
                    values[name].append(post.get(name, float("nan")))
            done = target
            open_measures = undecided(baseline_measures, baseline, values, bounds)
            if not open_measures or done >= most:
                break
            target = min(most, done + step)  # the slope's band straddles its bound: churn on
    verdict.record("release_path", path)
    verdict.record("cycles", done)
    verdict.record("cycles_requested", cycles, note=f"extended up to {most} while a noisy slope is undecided")
    for name, series in values.items():
        kind = baseline_measures[name]
        unit = kind.unit
        trend = theil_sen([baseline[name], *series])
        verdict.record(f"{name}.baseline", baseline[name], unit)
        verdict.record(f"{name}.per_cycle", ", ".join(f"{v:.0f}" for v in series), unit)
        verdict.expect(
            f"{name}.final_delta",
            series[-1] - baseline[name],
            "<=",
            bounds.tolerance(kind),
            unit,
            better="lower",
            tolerance=bounds.gate_tolerance(kind),
            note="post-release minimum of the last cycle vs baseline",
        )
        if kind.exact:
            verdict.expect(
                f"{name}.leak_slope",
                trend.slope,
                "<=",
                bounds.slope(kind),
                f"{unit}/cycle",
                better="lower",
                tolerance=bounds.gate_tolerance(kind, slope=True),
                note=f"Theil-Sen, band [{trend.low:.0f}, {trend.high:.0f}]",
            )
        else:  # noisy: decided only when the whole confidence band is on one side
            verdict.expect_banded(
                f"{name}.leak_slope",
                trend.slope,
                (trend.low, trend.high),
                "<=",
                bounds.slope(kind),
                f"{unit}/cycle",
                better="lower",
                tolerance=bounds.gate_tolerance(kind, slope=True),
                note="Theil-Sen 95 %",
            )
        verdict.add_series(f"{name} over time", sampler.points.get(name, []))
    notes = churn.release_notes(path)
    if notes:  # what a leftover measure's reader needs first: which stop, and how it went
        verdict.record("release_notes", len(notes), "releases", note=" | ".join(notes))
    verdict.conclude()


@pytest.mark.requires(C.INSTANCE_REGISTRY)
def test_second_release_is_harmless(engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict) -> None:
    """Releasing an instance twice must be refused cleanly, and the engine stay healthy."""
    ensure(engine, EngineConfig())
    churn = facet(engine, InstanceChurn)
    result = churn.second_release(churn.paths[0], prompts.fresh(4 * deployed_block_size(engine)))
    verdict.record("answers", result.detail)
    verdict.equal("first_release_done", int(result.first_released), 1)
    verdict.equal("second_release_refused_cleanly", int(result.second_refused_cleanly), 1)
    verdict.equal("engine_healthy_after", int(engine.healthy()), 1)
    verdict.conclude()
