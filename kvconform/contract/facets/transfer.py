"""KV moving between requests and instances: transfers, disaggregated serving, releases,
aborts, and the events that announce them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from kvconform.contract.types import ReleaseTwice, ServedPrompt, TransferResult


class KvTransfer(ABC):
    """A prefill's KV handed to decode ranks (TRANSFER_ACCOUNTING, PAGE_INDEX): the pages it
    sent and the bytes each side counted. The class attributes say which transfers the engine
    makes; a check asking for another is skipped, naming it."""

    layouts: tuple[str, ...] = ("mha",)  # KV layouts (kvconform.oracles.KvLayout values)
    page_sizes: tuple[int, ...] = ()
    destinations: tuple[int, ...] = (1, 4)  # decode ranks one transfer can fan out to
    aborts: bool = False  # transfer(abort_after_pages=...) cuts a transfer mid-way

    @abstractmethod
    def transfer(
        self,
        tokens: list[int],
        layout: str,
        page_size: int,
        destinations: int,
        abort_after_pages: int | None = None,
    ) -> TransferResult:
        """Prefill `tokens` and transfer their KV to `destinations` decode ranks."""


# ---- facets an adapter usually implements itself (inherits) --------------------------------


class DisaggregatedServing(ABC):
    """A prefill -> decode deployment (DISAGG_SERVING, launched with EngineConfig(disaggregated))."""

    @abstractmethod
    def serve_disaggregated(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        """Serve a prompt through it: prompt_tokens as the decode side counted them,
        cached_tokens the prefix reuse the prefill side had, output the decode side's answer
        (`max_tokens` greedy ids, where ANSWERS_FROM_KV), and source["handoff"] the prompt
        tokens the decode side received from the prefill rather than computed, where the
        engine says (absent: not judged)."""


class ReleaseGuard(ABC):
    """The engine's guard against releasing one request's KV twice (RELEASE_GUARD)."""

    # What a running request holds in the engine's block pool: every block of its prompt
    # (False: the prompt is fresh, nothing cached, and the partial last block counts), or only
    # references on its cached prefix's whole blocks (True: the engine keeps a request's new KV
    # outside the pool, so the prompt is served once before the request under test).
    releases_cached_prefix: ClassVar[bool] = False

    @abstractmethod
    def release_twice(self, tokens: list[int]) -> ReleaseTwice:
        """Release one request's KV twice through the engine's own abort/failure release path,
        and say what each release did. The request is `tokens`: fresh, or (where
        releases_cached_prefix) served once before so its whole blocks are cached."""


class StreamAborts(ABC):
    """Streaming completions the suite cuts mid-way, and the engine's live count of the requests
    it runs (ABORT_REQUESTS). kvconform.kit.http_api.HttpApi implements the streams."""

    @abstractmethod
    def stream_and_disconnect(self, tokens: list[int], after_chunks: int, max_tokens: int = 256) -> int:
        """Start a streaming completion and drop the connection after `after_chunks` token
        chunks. Returns the token chunks received before the drop, 0 when the stream finished
        first (then no request was aborted)."""

    @abstractmethod
    def stream_outlives(self, tokens: list[int], max_tokens: int, seconds: float) -> bool:
        """Whether a streaming completion of `max_tokens` is still running `seconds` after it
        started (then the connection is dropped); False when it finished first."""

    def requests_in_flight(self) -> int | None:
        """Requests the engine runs or queues now, by its live count (not a gauge refreshed
        later); None where the engine has no live count (nothing is judged)."""
        return None


class KvEvents(ABC):
    """The KV events the engine publishes (KV_EVENTS), read into the adapter's `ledger`.
    kvconform.kit.event_feed.ZmqEventFeed is the ZMQ publisher's side of it."""

    @abstractmethod
    def drain_events(self) -> int:
        """Make sure every event emitted so far is in the ledger; fill transport gaps from the
        engine's replay where it has one. Returns how many batches replay filled."""
