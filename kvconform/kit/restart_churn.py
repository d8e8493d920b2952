"""Instance churn by whole-server restarts, for an engine whose instance is its server: start
(if not running), load, stop; the process tree must be gone and its /dev/shm files removed,
every cycle. An adapter keeps one (it counts the leftovers across cycles) and returns it from
instance_churn(); its ReclaimProbe reports leftover_measures()."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvconform.contract import EngineConfig, InstanceChurn, ensure
from kvconform.kit.leftover_tally import LeftoverTally
from kvconform.memory import MemoryMeasure
from kvconform.processes import TeardownReport

if TYPE_CHECKING:
    from kvconform.contract import EngineAdapter

RESTART = "restart"


class RestartChurn(InstanceChurn):
    paths = (RESTART,)

    def __init__(self, engine: EngineAdapter, restart_cycles: int = 2) -> None:
        # Each cycle is a server start of 35-65 s on CPU. Every restart measure is exact and
        # cumulative (leftover processes and files, the pool's block count), so one leak shows
        # in the final delta from the first cycle on; a second cycle gives the slope its third
        # point.
        self.engine = engine
        self.restart_cycles = restart_cycles
        self.tally = LeftoverTally()  # what the stopped servers left, cumulative over cycles

    def cycle(self, path: str, index: int, tokens: list[int]) -> None:
        if path != RESTART:
            raise NotImplementedError(f"engine {self.engine.name} has no release path {path!r}")
        ensure(self.engine, self.engine.config or EngineConfig())
        for shift in range(3):
            self.engine.serve_prompt(tokens[: len(tokens) - shift])
        self.count(self.engine.stop())

    def count(self, reports: list[TeardownReport]) -> None:
        for report in reports:
            self.tally.count(report)

    def release_notes(self, path: str) -> list[str]:
        return list(self.tally.notes)

    def cycles(self, path: str, requested: int) -> int:
        return min(requested, self.restart_cycles)

    def warmup_cycles(self, path: str) -> int:
        # Every restart measure is exact (leftovers counted at teardown, the pool's own block
        # count): nothing to settle. One cycle still runs, so the baseline, like every cycle
        # after it, is read with the server stopped.
        return 1

    def leftover_measures(self) -> dict[str, MemoryMeasure]:
        left = self.tally.counts
        return {
            # Counted at teardown, so they cannot move inside one server's life: a long session
            # judges the KV an engine holds, never these (holds_kv False).
            "restart_leftover_processes": MemoryMeasure(left["processes"], True, "processes", holds_kv=False),
            "restart_leftover_shm_bytes": MemoryMeasure(left["shm_bytes"], True, holds_kv=False),
        }
