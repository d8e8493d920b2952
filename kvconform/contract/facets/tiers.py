"""Where KV goes beyond the device pool: the offload tier, the persistent tier, a remote store."""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport


class OffloadTier(ABC):
    """The host tier a device KV cache offloads to (OFFLOAD_*), beside the gauges and counters
    the engine exports of it: when its stores have settled, the host block size the byte
    counters are judged in, what the engine's transfer worker knew, and the store failure the
    suite injects. kvconform.kit.offload_tier.MetricOffloadTier is the usual shape."""

    @abstractmethod
    def wait_idle(self, timeout_s: float = 15.0, quiet_s: float = 1.0) -> None:
        """Wait until the tier's stores stop moving (never on the gauges under test)."""

    @abstractmethod
    def block_bytes(self) -> int:
        """Bytes of one block in the host tier."""

    def transfer_log(self) -> list[tuple[float, int, int]] | None:
        """What the engine's transfer worker knew, at each change since the engine started:
        (time.monotonic() seconds, chunks of stores in flight, chunks of loads in flight).
        Where the worker can say it, the offload gauges are judged against it; None: it cannot."""
        return None

    def fail_stores(self, fail: bool) -> None:
        """While on, every store to the tier fails (OFFLOAD_STORE_FAILURE)."""
        raise NotImplementedError(f"{type(self).__name__} cannot fail stores")

    def failed_stores(self, before: MetricSnapshot, after: MetricSnapshot) -> float:
        """Blocks whose store failed between two snapshots, by the engine's own count."""
        raise NotImplementedError(f"{type(self).__name__} counts no failed stores")


class PersistentTier(ABC):
    """Where an engine keeps KV across its own restarts (PERSISTENT_PREFIX, CORRUPT_PERSISTED,
    TIERED_STORE_METRICS): files on disk, or objects in a store the suite runs. The suite reads
    what landed there and, where the tier is files, damages them."""

    @abstractmethod
    def flush(self) -> None:
        """Wait until what the engine stored has reached the tier (writes are asynchronous)."""

    @abstractmethod
    def sizes(self) -> dict[str, int]:
        """Each entry of the tier (a file, an object) -> its bytes."""

    @abstractmethod
    def block_bytes(self) -> int:
        """What one full block takes in the tier, from the model's shape and the tier's
        documented format (a format that adds a header says so here)."""

    def files(self) -> list[Path]:
        """The tier's files, for the suite to damage; a tier of objects has none."""
        raise NotImplementedError(f"{type(self).__name__} keeps objects, not files")


class RemoteStore(ABC):
    """The remote KV store an engine offloads to (REMOTE_TIER: Redis, Valkey...), run by the
    suite and read with the store's own client: what the engine wrote there, the store's own
    accounting, and the faults a store really has (damaged values, paused or refused writes,
    the server gone)."""

    @abstractmethod
    def entries(self) -> dict[str, int]:
        """The engine's objects in the store -> the bytes each value holds."""

    @abstractmethod
    def objects_total(self) -> int:
        """Every object in the store, the engine's or not."""

    @abstractmethod
    def memory_usage(self, key: str) -> int:
        """What the store says one object costs (key, value and its own overhead)."""

    @abstractmethod
    def read(self, key: str) -> bytes:
        """One stored value, read straight from the store."""

    @abstractmethod
    def write(self, key: str, data: bytes) -> None:
        """Overwrite one stored value behind the engine's back (to damage it)."""

    @abstractmethod
    def capacity_bytes(self) -> int:
        """The capacity the adapter configured the engine's remote tier with."""

    @abstractmethod
    def wipe(self) -> None:
        """The engine stopped and the store emptied out of band (the store keeps running)."""

    @abstractmethod
    def down(self) -> TeardownReport:
        """The store's server stopped under a running engine; its teardown report."""

    @abstractmethod
    def pause_writes(self, seconds: float) -> None:
        """The store holds every write for `seconds` (reads go on): the engine's stores stay in
        flight that long, whatever its own counters say."""

    @abstractmethod
    def refuse_writes(self, refuse: bool) -> None:
        """While on, the store refuses every write with an error (reads go on)."""

    @abstractmethod
    def refused_writes(self) -> int:
        """The store's own count of writes it refused."""
