"""The chaos table: every chaos test adds its row (fault x outcome) to
<--results-dir>/chaos/chaos-table.md, shared by the xdist workers of one run."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.system.chaos.harness import Row, add_row, table_dir


@pytest.fixture(scope="session")
def chaos_table(request: pytest.FixtureRequest) -> Callable[[Row], Path]:
    directory = table_dir(request.config)

    def add(row: Row) -> Path:
        path = add_row(directory, row)
        print(f"\n[chaos] {row.fault}: {row.verdict[:160]} ({row.time_to_verdict_s} s) -> {path}")
        return path

    return add
