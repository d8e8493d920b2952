"""Values exchanged between suites and adapters, and what oracles are computed from."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvconform.oracles import KvLayout


@dataclass(frozen=True)
class ModelShape:
    """What KV sizes are computed from, independently of what the engine reports."""

    layers: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    dtype_bytes: int = 2  # bfloat16
    mla: bool = False  # MLA keeps one latent vector per token instead of K and V
    latent_dim: int = 576  # MLA: kv_lora_rank 512 + rope dim 64 (DeepSeek-V2/V3 shapes)
    state_item_bytes: int = 4096  # per layer, for layouts with a per-request state

    def kv_bytes_per_token(self) -> int:
        per_layer = self.kv_heads * self.head_dim * self.dtype_bytes
        return self.layers * per_layer * (1 if self.mla else 2)

    def block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token() * block_size

    def page_bytes(self, layout: KvLayout, page_size: int) -> int:
        return layout.page_bytes(
            self.layers, self.kv_heads, self.head_dim, self.dtype_bytes, self.latent_dim, page_size
        )

    def state_bytes(self, layout: KvLayout) -> int:
        return layout.state_bytes(self.layers, self.state_item_bytes)


@dataclass(frozen=True)
class EngineConfig:
    """How the suite wants the engine to run. Adapters restart only when this changes."""

    block_size: int | None = None  # None: the adapter's default
    offload: bool = False  # enable the host offload tier
    fail_stores: bool = False  # offload stores fail (failed-store path)
    persistent: bool = False  # enable the persistent (disk) tier
    disaggregated: bool = False  # separate prefill and decode instances, KV handed off between

    def with_(self, **changes: Any) -> EngineConfig:
        return replace(self, **changes)


@dataclass
class ServedPrompt:
    prompt_tokens: int
    cached_tokens: int
    output: list[int] = field(default_factory=list)
    source: dict[str, int] = field(default_factory=dict)  # cached tokens by tier, if known


@dataclass
class TransferResult:
    kv_indices: list[int]
    page_indices: list[int]
    bytes_sent: int  # what the sender counted
    bytes_received: int | None = None  # what the receiver counted (None: no receiver)
    state_indices: int = 0
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BlockPoolStats:
    """One engine iteration's KV block pool, as the engine reports it (BLOCK_POOL_STATS).

    max/free/used are the pool at that iteration. reused/missed count prefix-reuse lookups in
    blocks; `cumulative` says whether they (and hit_rate) run since engine start (TensorRT-LLM
    kvCacheStats) or cover this iteration only.
    """

    max_blocks: int
    free_blocks: int
    used_blocks: int
    reused_blocks: int
    missed_blocks: int
    hit_rate: float
    tokens_per_block: int
    iteration: int | None = None
    cumulative: bool = True


@dataclass
class AdapterContext:
    workdir: Path
    url: str | None = None  # attach mode
    start_timeout_s: float = 300.0
    request_timeout_s: float = 60.0
    env_name: str | None = None  # override the environment spec (e.g. another version)
    # The adapter's own pytest options (its class's `pytest_options`), by dest.
    options: dict[str, Any] = field(default_factory=dict)
