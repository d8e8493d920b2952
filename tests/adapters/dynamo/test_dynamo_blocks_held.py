"""Dynamo's exact long-session measure: the blocks the mockers' requests hold, from each
mocker's own usage gauge, read only once no request is open."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconform.adapters.dynamo import adapter as dynamo_adapter
from kvconform.adapters.dynamo.adapter import GPU_BLOCKS, DynamoAdapter
from kvconform.contract import AdapterContext
from kvconform.errors import EngineError
from kvconform.metrics import MetricSnapshot


def usage_snapshot(*per_mocker: float) -> MetricSnapshot:
    snap = MetricSnapshot(taken_at=0.0)
    snap.samples["vllm:kv_cache_usage_perc"] = {
        frozenset({("mocker", str(i))}): value for i, value in enumerate(per_mocker)
    }
    return snap


@pytest.fixture
def dynamo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DynamoAdapter:
    monkeypatch.setattr(dynamo_adapter, "GAUGE_SETTLE_S", 0.0)
    monkeypatch.setattr(dynamo_adapter, "DRAIN_TIMEOUT_S", 0.3)
    return DynamoAdapter(AdapterContext(workdir=tmp_path))


def test_held_blocks_sum_the_mockers_and_count_in_blocks(
    dynamo: DynamoAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dynamo, "requests_in_flight", lambda: 0)
    monkeypatch.setattr(dynamo, "metrics", lambda: usage_snapshot(4 / GPU_BLOCKS, 1 / GPU_BLOCKS))
    block_bytes = dynamo.deployment.model.block_bytes(dynamo.deployment.block_size)
    assert dynamo.kv_blocks_held_bytes() == 5 * block_bytes
    monkeypatch.setattr(dynamo, "metrics", lambda: usage_snapshot(0.0, 0.0))
    assert dynamo.kv_blocks_held_bytes() == 0


def test_a_stack_that_never_drains_is_an_error_not_a_reading(
    dynamo: DynamoAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dynamo, "requests_in_flight", lambda: 1)
    monkeypatch.setattr(dynamo, "metrics", lambda: usage_snapshot(0.0))
    monkeypatch.setattr(dynamo, "logs", lambda lines=80: {})
    with pytest.raises(EngineError, match="requests still open"):
        dynamo.kv_blocks_held_bytes()


def test_a_fresh_frontend_has_nothing_in_flight_until_it_served(
    dynamo: DynamoAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The frontend's in-flight gauge appears with its first request: absent before, it is 0;
    absent after a request, an error naming the gauge."""
    snap = usage_snapshot(0.0)
    idle = {frozenset({("mocker", "0"), ("dynamo_endpoint", "generate")}): 0.0}
    for family in dynamo.worker_metric_families:  # metrics() fills a mocker's unserved families with 0
        snap.samples.setdefault(family, dict(idle))
    monkeypatch.setattr(dynamo, "metrics", lambda: snap)
    assert dynamo.requests_in_flight() == 0
    assert dynamo.kv_blocks_held_bytes() == 0
    snap.samples["dynamo_frontend_requests_total"] = {frozenset({("model", "m")}): 3.0}
    with pytest.raises(EngineError, match="lacks dynamo_frontend_inflight_requests after 3 requests"):
        dynamo.requests_in_flight()
    snap.samples["dynamo_frontend_inflight_requests"] = {frozenset({("model", "m")}): 2.0}
    assert dynamo.requests_in_flight() == 2
