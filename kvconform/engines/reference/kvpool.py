"""Paged KV block pool with a prefix hash chain and LRU eviction of cached-but-free blocks.

A block's hash covers its parent's hash and its own tokens, so equal hashes mean equal
prefixes. Blocks are cached (hash registered, `stored` event) as soon as they are full and
computed; eviction of an unreferenced cached block emits `removed`.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

EventSink = Callable[[str, list[str], str | None, int], None]  # kind, hashes, parent, tokens


def chain_hashes(tokens: list[int], block_size: int, salt: str = "") -> list[str]:
    """Hash of every *full* block of `tokens`, each covering all blocks before it."""
    hashes: list[str] = []
    parent = salt
    for start in range(0, len(tokens) - len(tokens) % block_size, block_size):
        digest = hashlib.sha256(parent.encode())
        digest.update(",".join(map(str, tokens[start : start + block_size])).encode())
        parent = digest.hexdigest()[:32]
        hashes.append(parent)
    return hashes


@dataclass
class Block:
    block_id: int
    ref: int = 0
    hash: str | None = None
    parent: str | None = None


@dataclass
class PoolStats:
    total: int
    free: int
    cached_free: int
    in_use: int
    evictions: int = 0
    released_twice: int = 0
    free_list_len: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        width: int,
        device: str,
        on_event: EventSink,
        faults: frozenset[str] = frozenset(),
    ) -> None:
        self.block_size = block_size
        self.width = width
        self.faults = faults
        self.on_event = on_event
        self.kv = torch.zeros((num_blocks, block_size, width), dtype=torch.bfloat16, device=device)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.index: dict[str, int] = {}
        self.free: deque[int] = deque(range(num_blocks))
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    # ---- lookup -------------------------------------------------------------------------
    def match(self, hashes: list[str]) -> list[int]:
        """Longest prefix of `hashes` resident in the pool; the blocks are referenced."""
        found: list[int] = []
        for h in hashes:
            block_id = self.index.get(h)
            if block_id is None:
                break
            if self.blocks[block_id].hash != h and "stale_index_after_evict" not in self.faults:
                break
            found.append(block_id)
        for block_id in found:
            self._ref(block_id)
        return found

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref == 0:
            self.lru.pop(block_id, None)
        block.ref += 1

    # ---- allocation ---------------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        if count > len(self.free) + len(self.lru):
            raise MemoryError(f"need {count} blocks, {len(self.free)} free + {len(self.lru)} evictable")
        out = []
        for _ in range(count):
            if self.free:
                block_id = self.free.popleft()
            else:
                block_id, _ = self.lru.popitem(last=False)
                self._evict(block_id)
            block = self.blocks[block_id]
            block.ref = 1
            out.append(block_id)
        return out

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.hash is not None:
            if "stale_index_after_evict" not in self.faults:
                self.index.pop(block.hash, None)
            if "eviction_unannounced" not in self.faults:
                self.on_event("removed", [block.hash], None, 0)
            self.evictions += 1
        block.hash = None
        block.parent = None

    def commit(self, block_id: int, block_hash: str, parent: str | None) -> None:
        """Register a full, computed block in the prefix index."""
        current = self.index.get(block_hash)
        if current is not None and self.blocks[current].hash == block_hash:
            if "copy_stored_once_removed_each" not in self.faults:
                return  # another request cached the same prefix meanwhile; keep the first
            # The duplicate physical copy keeps the hash, unannounced (stores de-duplicated);
            # each copy's eviction still announces the hash's removal.
            block = self.blocks[block_id]
            block.hash, block.parent = block_hash, parent
            return
        block = self.blocks[block_id]
        block.hash, block.parent = block_hash, parent
        self.index[block_hash] = block_id
        self.on_event("stored", [block_hash], parent, self.block_size)

    def release(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref -= 1
            if block.ref > 0:
                continue
            if block.hash is not None:
                self.lru[block_id] = None
            else:
                self.free.append(block_id)

    def discard(self, block_ids: list[int]) -> None:
        """Drop blocks from the prefix cache and free them (their content is not trusted)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.index.get(block.hash) == block_id:
                    del self.index[block.hash]
                self.on_event("removed", [block.hash], None, 0)
            block.ref = 0
            if "abort_drop_announced_then_evicted" in self.faults:
                self.lru[block_id] = None  # hash kept: its eviction announces the removal again
                continue
            self.lru.pop(block_id, None)
            block.hash = block.parent = None
            self.free.append(block_id)

    def reset(self) -> bool:
        """Forget every cached-but-free block (the prefix cache reset). False if busy."""
        if any(b.ref > 0 for b in self.blocks):
            return False
        if "reset_keeps_prefix" in self.faults:
            return True
        for block_id in list(self.lru):
            block = self.blocks[block_id]
            block.hash = block.parent = None
            self.free.append(block_id)
        self.lru.clear()
        self.index.clear()
        self.on_event("cleared", [], None, 0)
        return True

    def stats(self) -> PoolStats:
        in_use = sum(1 for b in self.blocks if b.ref > 0)
        return PoolStats(
            total=len(self.blocks),
            free=len(set(self.free)),
            cached_free=len(self.lru),
            in_use=in_use,
            evictions=self.evictions,
            free_list_len=len(self.free),
        )
