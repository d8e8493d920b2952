"""What a serving engine's API offers beyond a prompt: salts, a cache reset, a server to attach to."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvconform.contract.types import ServedPrompt


class SaltedPrompts(ABC):
    """The engine's documented per-request cache salt (CACHE_SALT)."""

    def salted_answers(self) -> bool:
        """serve_salted returns the answer's token ids (ServedPrompt.output), as serve_prompt
        does with ANSWERS_FROM_KV; False where the engine's salted path cannot."""
        return True

    @abstractmethod
    def serve_salted(self, tokens: list[int], salt: str, max_tokens: int = 1) -> ServedPrompt:
        """serve_prompt under `salt`, which keeps the prompt's cached prefix apart from every
        other salt's."""


class CacheReset(ABC):
    """The engine's own reset of its prefix cache (RESET_PREFIX_CACHE)."""

    @abstractmethod
    def reset_prefix_cache(self) -> None: ...


class AttachedServer(ABC):
    """A running server the suite attaches to instead of launching it (--engine-url): how it is
    reached and what it says of itself. kvconform.kit.http_api.HttpApi implements
    check_reachable; an engine with no server API cannot be attached."""

    @abstractmethod
    def check_reachable(self) -> None:
        """One quick request to the server; a UsageError names the engine and the URL."""

    def attach(self) -> None:
        """The suite starts judging this server (its first check; again once it answers after
        a request failed): open what reading it needs beyond its URL, e.g. an RPC client or
        the drain of a bounded event buffer. Idempotent. Preflight only checks the server is
        reachable, on an adapter it then drops."""
        return None  # nothing beyond the URL by default

    def attached_version(self) -> str:
        return "unknown (attached)"

    def attached_block_size(self) -> int | None:
        """The block size the running server reports (None: it does not say; the adapter's
        default is taken)."""
        return None
