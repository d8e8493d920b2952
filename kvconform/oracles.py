"""What should be true, computed from first principles — never from the engine's own numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def prefix_hit_tokens(shared: int, prompt_len: int, block: int, recomputes_last_token: bool) -> int:
    """Tokens a block-granular prefix cache can serve: whole blocks of the shared prefix.

    A serving engine computes at least the prompt's last token (it needs its logits), so a
    prompt that is entirely cached is served from one token fewer.
    """
    usable = min(shared, prompt_len - 1 if recomputes_last_token else prompt_len)
    return max(usable, 0) // block * block


def pages(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


def page_indices(kv_indices: Sequence[int], page_size: int) -> list[int]:
    """Page index of each page a request's KV slots touch, in order of first appearance."""
    seen: list[int] = []
    for slot in kv_indices:
        page = slot // page_size
        if not seen or seen[-1] != page:
            seen.append(page)
    return seen


@dataclass(frozen=True)
class Trend:
    slope: float  # per cycle
    low: float
    high: float  # confidence band of the slope
    intercept: float


def theil_sen(values: Sequence[float]) -> Trend:
    """Robust slope of values over cycle index (Theil-Sen, via scipy)."""
    from scipy.stats import theilslopes

    if len(values) < 2:
        return Trend(0.0, 0.0, 0.0, float(values[0]) if values else 0.0)
    result = theilslopes(list(values), list(range(len(values))))
    return Trend(
        float(result.slope), float(result.low_slope), float(result.high_slope), float(result.intercept)
    )
