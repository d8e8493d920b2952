"""Dynamo's router-events measure reads the counter 1.6.1 exports, and fails when it should."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconform.adapters.dynamo.adapter import DynamoAdapter
from kvconform.contract import AdapterContext
from kvconform.errors import EngineError
from kvconform.metrics import parse_prometheus

NAME = "dynamo_component_kv_cache_events_applied"  # no _total: Rust's prometheus crate


def snapshot(rows: dict[str, float]) -> object:
    lines = [f"# TYPE {NAME} counter"] if rows else []
    for status, value in rows.items():
        lines.append(f'{NAME}{{dynamo_component="router",event_type="stored",status="{status}"}} {value}')
    lines.append("dynamo_frontend_requests_total 1")
    return parse_prometheus("\n".join(lines) + "\n", "dynamo", "/metrics")


@pytest.fixture
def dynamo(tmp_path: Path) -> DynamoAdapter:
    return DynamoAdapter(AdapterContext(workdir=tmp_path))


def test_applied_events_are_counted_by_status(dynamo: DynamoAdapter) -> None:
    before = snapshot({"ok": 3})
    after = snapshot({"ok": 10, "parent_block_not_found": 2})
    assert dynamo.router_event_status(before, after) == {"ok": 7, "parent_block_not_found": 2}


def test_no_applied_event_reads_as_zero_ok_which_the_check_fails(dynamo: DynamoAdapter) -> None:
    status = dynamo.router_event_status(snapshot({"ok": 4}), snapshot({"ok": 4}))
    assert status == {"ok": 0}, "the check demands ok >= 1 after routed traffic"


def test_an_absent_counter_is_an_error_naming_it(dynamo: DynamoAdapter) -> None:
    with pytest.raises(EngineError, match=NAME):
        dynamo.router_event_status(snapshot({}), snapshot({}))
    assert not snapshot({"ok": 1}).has(NAME + "_total"), "the old _total name reads nothing on 1.6.1"
