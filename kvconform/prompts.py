"""Token-id prompts that never collide across checks (so one check's cache never feeds
another's numbers), and prompts that share exact prefixes with each other."""

from __future__ import annotations

import hashlib
import random

LOW_TOKEN = 10  # below this: special tokens of the tiny models
HIGH_TOKEN = 4000  # the tiny models' vocabulary is 4096


class PromptFactory:
    def __init__(self, salt: str, low: int = LOW_TOKEN, high: int = HIGH_TOKEN) -> None:
        seed = int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "big")
        self._rng = random.Random(seed)
        self.low, self.high = low, high

    def fresh(self, length: int) -> list[int]:
        return [self._rng.randrange(self.low, self.high) for _ in range(length)]

    def extend(self, prefix: list[int], total: int) -> list[int]:
        """`prefix` followed by fresh tokens up to `total`; the first new token differs from
        any token a sibling prompt may have put there, so the shared prefix is exact."""
        if total < len(prefix):
            raise ValueError("total shorter than the prefix")
        return prefix + self.fresh(total - len(prefix))
