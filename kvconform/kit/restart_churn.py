"""Instance churn by whole-server restarts, for an engine whose instance is its server: start
(if not running), load, stop; the process tree must be gone and its /dev/shm files removed,
every cycle. An adapter composes it before EngineAdapter in its bases."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from kvconform.contract import EngineConfig
from kvconform.memory import MemoryMeasure

if TYPE_CHECKING:
    from kvconform.contract import EngineAdapter

    _Base = EngineAdapter
else:
    _Base = object

RESTART = "restart"


class RestartChurn(_Base):
    churn_paths: ClassVar[tuple[str, ...]] = (RESTART,)
    # Each cycle is a server start of 35-65 s on CPU. Every restart measure is exact and
    # cumulative (leftover processes and files, the pool's block count), so one leak shows in
    # the final delta from the first cycle on; a second cycle gives the slope its third point.
    restart_cycles: ClassVar[int] = 2

    def churn_cycle(self, path: str, index: int, tokens: list[int]) -> None:
        if path != RESTART:
            raise NotImplementedError(f"engine {self.name} has no release path {path!r}")
        self.ensure(self.config or EngineConfig())
        for shift in range(3):
            self.serve_prompt(tokens[: len(tokens) - shift])
        reports = self.stop()
        left = self.restart_leftovers()
        for report in reports:
            left["processes"] += len(report.leftover_processes)
            left["shm_bytes"] += sum(report.leftover_shm.values())

    def churn_cycles(self, path: str, requested: int) -> int:
        return min(requested, self.restart_cycles)

    def churn_warmup_path(self, path: str) -> str:
        return path

    def churn_warmup_cycles(self, path: str) -> int:
        # Every restart measure is exact (leftovers counted at teardown, the pool's own block
        # count): nothing to settle. One cycle still runs, so the baseline, like every cycle
        # after it, is read with the server stopped.
        return 1

    def restart_leftovers(self) -> dict[str, int]:
        """What the stopped servers left (and the teardown removed), cumulative over cycles."""
        if not hasattr(self, "_restart_leftovers"):
            self._restart_leftovers = {"processes": 0, "shm_bytes": 0}
        return self._restart_leftovers

    def restart_leftover_measures(self) -> dict[str, MemoryMeasure]:
        left = self.restart_leftovers()
        return {
            # Counted at teardown, so they cannot move inside one server's life: a long session
            # judges the KV an engine holds, never these (holds_kv False).
            "restart_leftover_processes": MemoryMeasure(left["processes"], True, "processes", holds_kv=False),
            "restart_leftover_shm_bytes": MemoryMeasure(left["shm_bytes"], True, holds_kv=False),
        }
