"""Offload read/write gauges tell the truth (vLLM #47666 semantics).

usage counts host chunks pinned by in-flight transfers, write the pending stores, and
read = usage - write. Invariants at every 20 Hz sample: each gauge in [0, 1], write <= usage,
read == usage - write; all drain to 0 once transfers finish. A gauge that lies (stuck,
> 100 %, negative: vllm-ascend #10048 showed -0.39) sends operators after the wrong problem.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import pytest

from kvconform.contract import Capability as C
from kvconform.contract import (
    EngineAdapter,
    EngineConfig,
    OffloadTier,
    deployed_block_size,
    ensure,
    facet,
    metric_delta,
    supported,
)
from kvconform.prompts import PromptFactory
from kvconform.results import Verdict
from kvconform.suites.offload_metrics.conftest import OffloadRun
from kvconform.suites.offload_metrics.gauges import GaugeSampler, gauge_vs_transfers, in_flight_windows
from kvconform.suites.prefix_reuse.answers import judge_least_agreeing

# Gated per check: the host-hit check needs no gauges, only what it reads.
pytestmark = pytest.mark.engine_config(offload=True)

EPS = 1e-6
DRAIN_BOUND_S = 5.0
MIN_RATE_HZ = 20.0
# How far a gauge may lag what the transfer worker knows: the scheduler hearing of a finished
# transfer at its next step, the metrics publish, one scrape (vLLM 0.32.0 read 0 samples outside
# it, quiet and in the loaded seven-engine session).
TRANSFER_SLACK_S = 0.5


def attach(verdict: Verdict, sampler: GaugeSampler) -> None:
    for field in ("usage", "write", "read"):
        verdict.add_series(f"offload {field} gauge", [(s.t, getattr(s, field)) for s in sampler.samples])


def judge_against_transfers(engine: EngineAdapter, sampler: GaugeSampler, verdict: Verdict) -> None:
    """The write gauge against the stores the engine's transfer worker had in flight, the read
    gauge against its loads: above 0 only around a transfer (a gauge stuck after its transfers
    ended is VIOLATED)."""
    log = facet(engine, OffloadTier).transfer_log()
    if log is None:
        verdict.record(
            "transfer_log", f"engine {engine.name}'s transfer worker does not say what it has in flight"
        )
        return
    for gauge, kind, column in (("write", "store", 1), ("read", "load", 2)):
        resolved = 2 * sampler.interval_s  # what scrapes at the sampler's rate can resolve
        windows = in_flight_windows([(row[0], int(row[column])) for row in log], sampler.origin, resolved)
        points = [(s.t, getattr(s, gauge)) for s in sampler.samples]
        phantom, unseen = gauge_vs_transfers(points, windows, TRANSFER_SLACK_S, resolved)
        verdict.record(
            f"{kind}_windows", len(windows), note="stretches with transfers in flight (the worker's log)"
        )
        verdict.equal(
            f"samples_{gauge}_without_{kind}_in_flight",
            len(phantom),
            0,
            note=f"{gauge} gauge > 0 with no {kind} in flight within {TRANSFER_SLACK_S} s; "
            + "; ".join(phantom[:3]),
        )
        # Recorded, not judged: vLLM 0.32.0 in a loaded session once showed no read gauge over a
        # 0.46 s stretch of loads that a quiet run showed; until the cause is known it would
        # be a coin toss, not a verdict.
        verdict.record(
            f"{kind}s_in_flight_unseen_by_{gauge}_gauge",
            len(unseen),
            note=f"not judged; {kind} stretches the {gauge} gauge never showed: " + "; ".join(unseen[:3]),
        )


@pytest.mark.requires(C.OFFLOAD_GAUGES)
def test_gauges_consistent_under_load(
    engine: EngineAdapter, offload_run: OffloadRun, verdict: Verdict
) -> None:
    samples = offload_run.sampler.samples
    out_of_range = [s for s in samples if not all(-EPS <= g <= 1 + EPS for g in (s.usage, s.write, s.read))]
    write_over = [s for s in samples if s.write > s.usage + EPS]
    not_derived = [s for s in samples if abs(s.read - max(s.usage - s.write, 0.0)) > EPS]
    verdict.record("samples", len(samples))
    verdict.require("sample_rate", offload_run.sampler.rate_hz(), ">=", MIN_RATE_HZ, "Hz")
    verdict.require(
        "samples_with_transfers_in_flight",
        sum(s.usage > 0 for s in samples),
        ">=",
        1,
        note="the scenario must move the gauges, or the samples below judge nothing",
    )
    verdict.equal("samples_out_of_[0,1]", len(out_of_range), 0, note=_first(out_of_range))
    verdict.equal("samples_write_above_usage", len(write_over), 0, note=_first(write_over))
    if engine.traits.read_gauge_is_usage_minus_write:
        verdict.record(
            "samples_read_not_usage_minus_write",
            len(not_derived),
            note=f"engine {engine.name} computes read = max(usage - write, 0) itself: not judged",
        )
    else:
        verdict.equal("samples_read_not_usage_minus_write", len(not_derived), 0, note=_first(not_derived))
    judge_against_transfers(engine, offload_run.sampler, verdict)
    verdict.record("max_usage", max((s.usage for s in samples), default=0.0))
    verdict.record("min_read", min((s.read for s in samples), default=0.0))
    attach(verdict, offload_run.sampler)
    verdict.conclude()


@pytest.mark.requires(C.OFFLOAD_GAUGES)
def test_gauges_drain_after_load(offload_run: OffloadRun, verdict: Verdict) -> None:
    idle = [s for s in offload_run.sampler.samples if s.t >= offload_run.load_ended_at]
    busy_after = [s for s in idle if s.usage > EPS or s.write > EPS or s.read > EPS]
    drained_at = (busy_after[-1].t - offload_run.load_ended_at) if busy_after else 0.0
    last = idle[-1] if idle else None
    verdict.record("idle_samples", len(idle))
    verdict.expect("drain_time", drained_at, "<=", DRAIN_BOUND_S, "s", better="lower", tolerance=0.5)
    if last is not None:
        verdict.equal("usage_at_idle", last.usage, 0.0, abs_tol=EPS)
        verdict.equal("write_at_idle", last.write, 0.0, abs_tol=EPS)
        verdict.equal("read_at_idle", last.read, 0.0, abs_tol=EPS)
    else:
        verdict.expect("idle_samples_taken", 0, ">=", 1)
    attach(verdict, offload_run.sampler)
    verdict.conclude()


@pytest.mark.requires(C.OFFLOAD_GAUGES)  # the byte counters come with the gauges (vLLM #47666)
def test_offload_byte_counters_match_blocks(
    engine: EngineAdapter, offload_run: OffloadRun, verdict: Verdict
) -> None:
    """Stored/loaded bytes = blocks moved x block bytes, block bytes from the model shape."""
    block_bytes = facet(engine, OffloadTier).block_bytes()
    stored = metric_delta(engine, "offload_store_bytes", offload_run.before, offload_run.after)
    loaded = metric_delta(engine, "offload_load_bytes", offload_run.before, offload_run.after)
    expected_loaded_blocks = offload_run.expected_host_hit_tokens // offload_run.block_size
    verdict.record("block_bytes_from_model_shape", block_bytes, "bytes")
    verdict.equal(
        "store_bytes_delta",
        stored,
        offload_run.expected_stored_blocks * block_bytes,
        "bytes",
        note=f"{offload_run.expected_stored_blocks} full blocks offloaded once each",
    )
    verdict.equal(
        "load_bytes_delta",
        loaded,
        expected_loaded_blocks * block_bytes,
        "bytes",
        note=f"{expected_loaded_blocks} blocks loaded back",
    )
    series = offload_run.sampler.samples
    for name in offload_run.sampler.counter_names:
        drops = sum(1 for a, b in itertools.pairwise(series) if b.counters[name] < a.counters[name])
        verdict.equal(f"{name}_decreases", drops, 0, note="counters are monotone")
    verdict.conclude()


@pytest.mark.requires(C.OFFLOAD_HOST_HITS)
def test_offloaded_prefix_returns_as_host_hit(
    engine: EngineAdapter, offload_run: OffloadRun, verdict: Verdict, has: Callable[[C], bool]
) -> None:
    expected = offload_run.expected_host_hit_tokens
    cached = sum(s.cached_tokens for s in offload_run.reserved)
    verdict.equal(
        "cached_tokens_after_device_reset",
        cached,
        expected,
        "tokens",
        note="every full block comes back from the host tier (dropped from the device by "
        + ("its reset)" if C.RESET_PREFIX_CACHE in supported(engine) else "LRU eviction)"),
    )
    if "cached_by_source_host" in engine.traits.metric_map:
        host = metric_delta(engine, "cached_by_source_host", offload_run.before, offload_run.after)
        verdict.equal("host_source_counter_delta", host, expected, "tokens")
    else:
        verdict.record(
            "host_source_counter_delta", "no host-source counter", note=f"engine {engine.name} has none"
        )
    if "external_prefix_hits" in engine.traits.metric_map:
        external = metric_delta(engine, "external_prefix_hits", offload_run.before, offload_run.after)
        verdict.equal("external_prefix_hits_delta", external, expected, "tokens")
    # A host hit that loads the wrong bytes, or into the wrong slots, counts right: only the
    # answer shows it.
    pairs = list(zip(offload_run.reserved, offload_run.cold, strict=True))
    judge_least_agreeing(verdict, "answer_from_host_vs_cold", pairs, has)
    verdict.conclude()


@pytest.mark.requires(C.OFFLOAD_STORE_FAILURE, C.OFFLOAD_GAUGES)
def test_failed_store_releases_pending_write(
    engine: EngineAdapter, prompts: PromptFactory, verdict: Verdict
) -> None:
    ensure(engine, EngineConfig(offload=True))
    before = engine.metrics()
    facet(engine, OffloadTier).fail_stores(True)
    try:
        with GaugeSampler(engine) as sampler:
            for _ in range(3):
                engine.serve_prompt(prompts.fresh(6 * deployed_block_size(engine) + 1))
            ended = sampler.now()
            deadline = time.monotonic() + DRAIN_BOUND_S + 1
            while time.monotonic() < deadline:
                if sampler.samples and sampler.samples[-1].t > ended and sampler.samples[-1].write <= EPS:
                    break
                time.sleep(0.05)
            time.sleep(0.5)
    finally:
        facet(engine, OffloadTier).fail_stores(False)
    after = engine.metrics()
    failed = facet(engine, OffloadTier).failed_stores(before, after)
    idle = [s for s in sampler.samples if s.t >= ended]
    verdict.require("stores_failed", failed, ">=", 1, note="the failure path must really have run")
    # Not required: a failed store may end within one sampling interval (vLLM 0.32.0: no sample
    # at 40 Hz saw one pending, 18 failed stores, 2026-12-06). What shows the gauge can read a pending
    # write here is a store whose failure leaks it (failed_store_write_leaked: 0 -> 0.07).
    verdict.record(
        "samples_with_write_pending",
        sum(s.write > EPS for s in sampler.samples if s.t < ended),
        note="samples that saw a failing store's pending write (not judged)",
    )
    verdict.equal(
        "write_gauge_after_failures",
        idle[-1].write if idle else -1.0,
        0.0,
        abs_tol=EPS,
        note="a failed store must release its pending write",
    )
    verdict.equal("usage_gauge_after_failures", idle[-1].usage if idle else -1.0, 0.0, abs_tol=EPS)
    attach(verdict, sampler)
    verdict.conclude()


def _first(samples: list) -> str:
    if not samples:
        return ""
    s = samples[0]
    return f"first at t={s.t:.2f}s: usage={s.usage:.4f} write={s.write:.4f} read={s.read:.4f}"
