"""Deterministic KV content for drivers that store and retrieve real bytes (standard library
only: drivers run in engine environments). A chunk's bytes are a function of the whole token
prefix up to its end, so any process (one started after a restart too) can check them."""

from __future__ import annotations

import hashlib


def chunk_seed(token_ids: list[int], end: int, salt: str) -> int:
    """RNG seed of the KV of the chunk ending at token `end` (63 bits, for torch.Generator)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(salt.encode())
    h.update(b"|")
    h.update(",".join(str(t) for t in token_ids[:end]).encode())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)
