"""An engine's radix prefix cache, driven as its scheduler drives it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class RadixSizes:
    """Token counts of a radix cache and its pool."""

    capacity: int
    total: int  # cached in the tree
    available: int  # free in the pool
    evictable: int  # cached and locked by no request
    protected: int  # cached and locked


@dataclass(frozen=True)
class RadixMatch:
    prefix_len: int  # tokens of the query the cache holds, from the start
    handle: int  # the deepest matched node, for lock and unlock


@dataclass(frozen=True)
class CacheEvent:
    """One KV event a cache published: blocks stored (with their tokens), removed, or all
    cleared."""

    kind: Literal["stored", "removed", "cleared"]
    block_hashes: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()  # stored: the blocks' tokens, in order
    block_size: int = 0  # stored
    parent_hash: int | None = None  # stored: the block the first one extends


class RadixCache(ABC):
    """An engine's radix prefix cache, driven as its scheduler drives it (RADIX_CACHE_MODEL):
    a finished request's tokens inserted, a new request's prefix matched and locked while it
    runs, eviction of unlocked leaves when the pool needs room."""

    @abstractmethod
    def insert(self, tokens: list[int]) -> int:
        """Cache `tokens`; returns the prefix length that was cached already."""

    @abstractmethod
    def match(self, tokens: list[int]) -> RadixMatch: ...

    @abstractmethod
    def lock(self, handle: int) -> None: ...

    @abstractmethod
    def unlock(self, handle: int) -> None: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> None: ...

    @abstractmethod
    def sizes(self) -> RadixSizes: ...

    @abstractmethod
    def take_events(self, router_hashes: bool = False) -> list[CacheEvent]:
        """The KV events since the last call. `router_hashes`: as the engine publishes them
        to an external KV router (block hashes the router recomputes from the tokens)."""


class RadixCacheModel(ABC):
    """The engine's radix-cache code, from which the suite makes caches to drive
    (RADIX_CACHE_MODEL)."""

    @abstractmethod
    def new_cache(self, page_size: int, capacity_tokens: int) -> RadixCache:
        """A new, empty cache of `capacity_tokens` in pages of `page_size` tokens."""
