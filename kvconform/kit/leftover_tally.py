"""What a churn's teardowns found left (and removed), summed over its cycles, with how each stop
that needed a kill or left something went, in the teardown's own words."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from kvconform.processes import TeardownReport


@dataclass
class LeftoverTally:
    # an adapter may count more kinds (Dynamo: discovery registrations)
    counts: dict[str, int] = field(default_factory=lambda: {"processes": 0, "shm_bytes": 0})
    notes: list[str] = field(default_factory=list)

    def count(self, report: TeardownReport, not_the_engines: Container[str] = ()) -> None:
        """Add one teardown; `not_the_engines`: /dev/shm files it found that are its clients'."""
        shm = {name: size for name, size in report.leftover_shm.items() if name not in not_the_engines}
        self.counts["processes"] += len(report.leftover_processes)
        self.counts["shm_bytes"] += sum(shm.values())
        if report.leftover_processes or shm or report.forced_kill or report.notes:
            self.notes.append(report.describe())
