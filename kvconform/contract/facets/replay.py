"""A recorded request trace replayed through an engine's own scheduler or simulator."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class TracedRequest:
    """One request of a replay trace. Its prompt is named block by block: one id per block of
    the replay's block size, the partial last block included (its own id); equal ids mean
    equal content, so two requests share a prefix as far as their ids agree."""

    arrival_ms: float
    input_length: int
    output_length: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class ReplaySetup:
    """One worker per role, a cache of `cache_blocks` blocks, requests one at a time.
    Disaggregated: a prefill worker hands each prompt's KV to a decode worker over a link of
    `link_gbps` decimal GB/s (1 GB/s moves 1e6 bytes per ms), `kv_bytes_per_token` a token."""

    block_size: int
    cache_blocks: int
    disaggregated: bool = False
    kv_bytes_per_token: int = 0
    link_gbps: float = 0.0


@dataclass(frozen=True)
class Handoff:
    """A disaggregated request's KV hand-off, in simulated milliseconds (None: not reported)."""

    transfer_ms: float | None
    destination_reserved_ms: float | None
    destination_activated_ms: float | None
    decode_admitted_ms: float | None


@dataclass(frozen=True)
class ReplayedRequest:
    arrival_ms: float
    input_length: int
    reused_input_tokens: int  # prompt tokens served from cache, as the engine counted them
    completed: bool
    handoff: Handoff | None = None  # disaggregated replays only


class TraceReplay(ABC):
    """An engine's offline replay of a request trace in simulated time (TRACE_REPLAY): what
    each request reused from the cache the earlier ones left, and, where the engine simulates
    disaggregated serving, each request's KV hand-off."""

    simulates_handoff: bool = False

    @abstractmethod
    def replay(self, trace: list[TracedRequest], setup: ReplaySetup) -> list[ReplayedRequest]:
        """Every request of `trace`, in arrival order."""
