"""Routers and their indexes: the blocks a router believes each worker holds, and how it answers."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from kvconform.contract.types import ServedPrompt
from kvconform.metrics import MetricSnapshot


class Outcome(StrEnum):
    """How a service answered a request that changes its state."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"  # refused: the worker or request is already known
    UNKNOWN = "unknown"  # refused: no such worker or request
    FAILED = "failed"  # any other answer: an error, a malformed request, a crash


@dataclass(frozen=True)
class Answer:
    outcome: Outcome
    detail: str  # what the engine said, verbatim enough for a report

    def is_(self, outcome: Outcome) -> int:
        """1 where the answer is `outcome`, else 0 (a measure's value)."""
        return int(self.outcome is outcome)


class ActiveBlockTracker(ABC):
    """A router's account of the KV blocks live requests hold on its workers (BLOCK_TRACKER).

    Blocks are named by the prefix of sequence hashes up to them: a prefix two live requests
    share is held once, and held until the last of them is freed. Workers and requests are the
    tracker's own records, created and removed through these calls only.
    """

    @abstractmethod
    def register_worker(self, worker_id: int, block_size: int) -> Answer: ...

    @abstractmethod
    def unregister_worker(self, worker_id: int) -> Answer: ...

    @abstractmethod
    def add_request(
        self, request_id: str, worker_id: int, block_hashes: list[int], prompt_tokens: int
    ) -> Answer:
        """A request routed to `worker_id`, holding the blocks `block_hashes` name."""

    @abstractmethod
    def prefill_complete(self, request_id: str) -> Answer:
        """The request's prefill finished; it keeps its blocks while it decodes."""

    @abstractmethod
    def free_request(self, request_id: str) -> Answer: ...

    @abstractmethod
    def active_blocks(self) -> int:
        """Blocks held by live requests over all workers, as the tracker counts them."""


@dataclass(frozen=True)
class IndexBlock:
    """A block as a KV event names it to a router: the engine's block hash, and its content as
    tokens (the index hashes them its own way) or as a content hash already computed."""

    hash: int
    tokens: tuple[int, ...] = ()
    tokens_hash: int | None = None


@dataclass(frozen=True)
class IndexEvent:
    kind: Literal["stored", "removed", "cleared"]
    worker: int
    event_id: int
    parent: int | None = None  # stored: the engine hash of the block the first one extends
    blocks: tuple[IndexBlock, ...] = ()  # stored
    hashes: tuple[int, ...] = ()  # removed: engine hashes
    dp_rank: int = 0


@dataclass(frozen=True)
class Applied:
    applied: int
    rejected: int
    errors: tuple[str, ...] = ()  # why each rejected event was refused, in order


class RouterIndex(ABC):
    """A router-side prefix index fed by the workers' KV events (RADIX_INDEX). Trees are named
    and independent of each other; a query is a sequence of content hashes (content_hashes)."""

    @abstractmethod
    def new_tree(self, tree: str) -> None: ...

    @abstractmethod
    def apply(self, tree: str, events: list[IndexEvent]) -> Applied:
        """Apply in order; a refused event leaves the tree as it was and the batch goes on."""

    @abstractmethod
    def match(self, tree: str, content_hashes: list[int]) -> dict[int, int]:
        """Per worker holding a prefix of the query: its matched blocks (the longest over its
        data-parallel ranks)."""

    @abstractmethod
    def dump(self, tree: str) -> list[IndexEvent]:
        """The tree as events that rebuild it."""

    @abstractmethod
    def content_hashes(self, tokens: list[int], block_size: int) -> list[int]:
        """The index's own hashes of the full blocks of `tokens`."""

    @abstractmethod
    def resident_bytes(self) -> int:
        """Resident memory of the process holding the index, as the kernel counts it."""


class KvRouter(ABC):
    """A KV-aware router in front of workers (ROUTER_PREDICTION): the overlap it predicts for
    a request against what the worker it picked then reports."""

    @abstractmethod
    def serve_routed(self, tokens: list[int]) -> tuple[int, ServedPrompt]:
        """(tokens the router predicted cached, what the worker then reported)."""

    def router_event_status(self, before: MetricSnapshot, after: MetricSnapshot) -> dict[str, float] | None:
        """KV events the router applied between two snapshots, by status ("ok" and each way of
        failing); None: the engine does not say. An engine that says must export the metric:
        absent after routed traffic is an EngineError naming it, never zero events."""
        return None
