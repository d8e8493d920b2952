"""What should be true, computed from first principles — never from the engine's own numbers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class LastToken(StrEnum):
    """What an engine does when every token of a prompt is cached: it still needs the last
    token's logits, so it recomputes something (an engine's documented design, not a number)."""

    NONE = "none"  # a cache store, not a server: every stored block is returned
    BLOCK = "block"  # the last token is recomputed with its whole block (vLLM, SGLang)
    TOKEN = "token"  # the KV is trimmed by one token, the rest is served (oMLX)


def prefix_hit_tokens(
    shared: int, prompt_len: int, block: int, recomputes_last_token: bool | LastToken
) -> int:
    """Tokens a block-granular prefix cache can serve: whole blocks of the shared prefix.

    A serving engine computes at least the prompt's last token (it needs its logits), so a
    prompt that is entirely cached is served from one token fewer: the whole last block on a
    block-granular cache (True = LastToken.BLOCK), that token alone where the engine trims
    its KV (LastToken.TOKEN).
    """
    rule = (
        LastToken(recomputes_last_token)
        if isinstance(recomputes_last_token, str)
        else (LastToken.BLOCK if recomputes_last_token else LastToken.NONE)
    )
    whole = max(min(shared, prompt_len), 0) // block * block
    if rule is LastToken.NONE or whole < prompt_len:
        return whole
    return prompt_len - 1 if rule is LastToken.TOKEN else max(prompt_len - 1, 0) // block * block


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


@dataclass(frozen=True)
class KvLayout:
    """How one token's KV is laid out, for transfer accounting.

    mha: K and V per layer, kv_heads x head_dim each; every destination gets its own heads,
         so fan-out does not multiply bytes.
    mla: one latent vector per layer (kv_lora_rank + rope dim), replicated to every
         destination rank that needs it, so bytes scale with the fan-out.
    mla_state: mla plus a per-request state buffer (e.g. a recurrent state) per layer,
         replicated like the latent KV.
    """

    name: str

    def page_bytes(
        self, layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, latent_dim: int, page_size: int
    ) -> int:
        if self.name == "mha":
            return layers * 2 * kv_heads * head_dim * dtype_bytes * page_size
        return layers * latent_dim * dtype_bytes * page_size

    def state_bytes(self, layers: int, state_item_bytes: int) -> int:
        return layers * state_item_bytes if self.name == "mla_state" else 0

    def replica_factor(self, destinations: int) -> int:
        return destinations if self.name.startswith("mla") else 1


def transfer_bytes(
    layout: KvLayout, pages: int, page_bytes: int, state_indices: int, state_bytes: int, destinations: int
) -> int:
    return (pages * page_bytes + state_indices * state_bytes) * layout.replica_factor(destinations)
