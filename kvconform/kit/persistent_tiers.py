"""The two shapes a PersistentTier takes: files under one directory (most engines), or the
objects of a store the suite runs (an engine whose persistent tier is remote)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvconform.contract import PersistentTier, RemoteStore


def _nothing_in_flight() -> None:
    return None


@dataclass
class FileTier(PersistentTier):
    """The files under `root` that match `pattern` (a glob; `**/` reaches subdirectories);
    `settle` waits until the engine's writes have landed."""

    root: Path
    pattern: str
    bytes_per_block: int
    settle: Callable[[], None] = field(default=_nothing_in_flight)

    def files(self) -> list[Path]:
        if not self.root.exists():
            return []
        return sorted(p for p in self.root.glob(self.pattern) if p.is_file())

    def sizes(self) -> dict[str, int]:
        sizes = {}
        for path in self.files():
            with contextlib.suppress(FileNotFoundError):  # evicted between the listing and now
                sizes[str(path)] = path.stat().st_size
        return sizes

    def block_bytes(self) -> int:
        return self.bytes_per_block

    def flush(self) -> None:
        self.settle()


@dataclass
class StoreTier(PersistentTier):
    """The objects of a remote store as the persistent tier."""

    store: RemoteStore
    bytes_per_block: int
    settle: Callable[[], None] = field(default=_nothing_in_flight)

    def sizes(self) -> dict[str, int]:
        return self.store.entries()

    def block_bytes(self) -> int:
        return self.bytes_per_block

    def flush(self) -> None:
        self.settle()
