"""An engine's memory: its KV pool, instances that come and go, what it holds after they left."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvconform.contract.types import BlockPoolStats, SecondRelease
from kvconform.memory import MemoryMeasure


class InstanceChurn(ABC):
    """Engine instances made, loaded and released over and over (INSTANCE_CHURN), through each
    release path the engine has (unregister, a reaper, close, destroy, a whole restart...).
    What a release left behind is what the adapter's reclaim_probe(path) reads next."""

    paths: tuple[str, ...] = ()

    @abstractmethod
    def cycle(self, path: str, index: int, tokens: list[int]) -> None:
        """One instance lifecycle: create, load with `tokens`, release through `path`; a
        release that fails raises."""

    def cycles(self, path: str, requested: int) -> int:
        """Cycles to run for a release path (slow paths, e.g. a 30 s reaper, may run fewer)."""
        return requested

    def warmup_path(self, path: str) -> str:
        """Release path of the warm-up cycles (a cheaper one where the path is slow)."""
        return path

    def warmup_cycles(self, path: str) -> int:
        """Cycles run before the baseline, so allocator pools and caches settle (RSS-like
        measures); fewer where every measure of the path is exact."""
        return 2

    def release_notes(self, path: str) -> list[str]:
        """What the releases through `path` so far left that a reviewer needs to read a leftover
        measure (the stop that needed a kill, the process and files left): the engine's words,
        not numbers."""
        return []

    def second_release(self, path: str, tokens: list[int]) -> SecondRelease:
        """INSTANCE_REGISTRY: release one instance through `path`, then release it again;
        what each answer was."""
        raise NotImplementedError(f"{type(self).__name__} has no instance registry")


class KvPool(ABC):
    """The device KV pool the suite configured, and what the engine says is in it
    (FORCED_EVICTION, LONG_SESSION, BLOCK_POOL_STATS; the KV-event ledger's completeness check
    where the engine counts its cached blocks). A cache server's pool (LMCache) is its L1."""

    @abstractmethod
    def cache_capacity_tokens(self) -> int:
        """Device prefix-cache capacity, from the configuration the suite gave the engine."""

    def kv_pool_bytes(self) -> int:
        """Bytes of the device KV pool the suite configured (LONG_SESSION)."""
        raise NotImplementedError(f"{type(self).__name__} does not size its KV pool in bytes")

    def resident_blocks_reported(self) -> int | None:
        """Cached blocks the engine says it holds (None: it does not say)."""
        return None

    def block_pool_stats(self) -> list[BlockPoolStats]:
        """Every iteration's block-pool stats reported by this engine instance, oldest first
        (BLOCK_POOL_STATS)."""
        raise NotImplementedError(f"{type(self).__name__} reports no block-pool stats")


class ReclaimProbe(ABC):
    """Memory that must come back after a release and stay flat over a long session
    (INSTANCE_CHURN, LONG_SESSION), by measure."""

    @abstractmethod
    def reclaim_probe(self, path: str | None = None) -> dict[str, MemoryMeasure]:
        """The measures now. `path`: the release path whose cycles the caller is running (what
        that path leaves behind is what is read); None outside instance churn (the engine's
        memory as it serves)."""


class SelfChecks(ABC):
    """The engine's own built-in invariant checks (e.g. SGLang's idle pool audit): each check
    on the engine judges that none raised an alarm while it ran."""

    @abstractmethod
    def self_check_alarms(self, *, settle: bool = True) -> list[str] | None:
        """The alarms raised since the last call (the engine's lines); None where the checks
        cannot be read in this mode (nothing is judged). settle=False reads without waiting
        for the engine's next audit (a check's start only drains what came before it)."""
