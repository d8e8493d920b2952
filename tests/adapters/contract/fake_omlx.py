"""A local server shaped after `omlx serve` (see fakes.py for the common part)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from tests.adapters.contract.fakes import FakeServer, Reply, block_hash


class FakeOmlx(FakeServer):
    """`omlx serve`: word-level model, paged SSD prefix cache, session vs all-time stats.

    restart() is a new server life: session counters start at 0, all-time counters and the
    SSD tier survive. All-time counters start large, so reading the wrong scope shows.

    As current oMLX (0.7.x; flyto-mlx 0.7.0 measured on Linux): usage carries
    prompt_tokens_details.cached_tokens; an exact block-aligned hit is served from N-1 tokens
    (the cache is trimmed by one token to recompute the last); POST /admin/api/login answers
    400 when the server has no API key, and then the admin routes answer 401 unless its
    settings skip API key verification (the default here when no key is given, as on a Mac
    set up that way). `legacy=True` is a build before oMLX #922: usage.cached_tokens only, no
    /admin/api/hot-cache/clear (404) and no runtime_cache.hot_cache_* keys.
    """

    ALLTIME_SEED = 1_000_000

    def __init__(
        self,
        block_size: int = 16,
        api_key: str = "",
        skip_verification: bool | None = None,
        legacy: bool = False,
    ) -> None:
        super().__init__()
        self.block_size, self.api_key, self.legacy = block_size, api_key, legacy
        self.skip_verification = not api_key if skip_verification is None else skip_verification
        self.ssd: set[int] = set()
        self.session = self._zero()
        self.alltime = {k: self.ALLTIME_SEED for k in self.session}
        self.cookie = "s3ss10n"
        self.started = time.time()
        self.route("GET", "/health", lambda q, b, h: (200, self._health(), {}))
        self.route("GET", "/api/status", self._status)
        self.route("GET", "/v1/models", self._guard(lambda q, b, h: (200, self._models(), {})))
        self.route("POST", "/v1/completions", self._guard(self._complete))
        self.route("POST", "/admin/api/login", self._login)
        self.route("GET", "/admin/api/stats", self._admin(self._stats))
        self.route("POST", "/admin/api/ssd-cache/clear", self._admin(self._clear_ssd))
        if not legacy:
            self.route("POST", "/admin/api/hot-cache/clear", self._admin(self._clear_hot))
        self.route("POST", "/admin/api/cache/probe", self._admin(self._probe))

    @staticmethod
    def _zero() -> dict[str, int]:
        return {"prompt": 0, "completion": 0, "cached": 0, "requests": 0}

    def restart(self) -> None:
        with self.lock:
            self.session = self._zero()
            self.started = time.time()

    def _health(self) -> dict[str, Any]:
        return {"status": "healthy", "default_model": "tiny", "engine_pool": None, "mcp": None}

    def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "omlx"}]}

    def _guard(self, fn: Callable[[dict, Any, dict], Reply]) -> Callable[[dict, Any, dict], Reply]:
        def wrapped(q: dict, b: Any, h: dict) -> Reply:
            if self.api_key and h.get("Authorization") != f"Bearer {self.api_key}":
                error = {"message": "API key required", "type": "authentication_error"}
                return 401, {"error": {**error, "param": None, "code": None}}, {}
            return fn(q, b, h)

        return wrapped

    def _admin(self, fn: Callable[[dict, Any, dict], Reply]) -> Callable[[dict, Any, dict], Reply]:
        def wrapped(q: dict, b: Any, h: dict) -> Reply:
            if self.skip_verification:
                return fn(q, b, h)
            if not self.api_key or f"omlx_admin_session={self.cookie}" not in h.get("Cookie", ""):
                return 401, {"detail": "Admin authentication required"}, {"WWW-Authenticate": "Cookie"}
            return fn(q, b, h)

        return wrapped

    def _login(self, q: dict, body: Any, h: dict) -> Reply:
        if not self.api_key:
            return 400, {"detail": "No API key configured. Please set up an API key first."}, {}
        if not body or body.get("api_key") != self.api_key:
            return 401, {"detail": "Invalid API key"}, {}
        return 200, {"success": True}, {"Set-Cookie": f"omlx_admin_session={self.cookie}; HttpOnly; Path=/"}

    def _snapshot(self, c: dict[str, int]) -> dict[str, Any]:
        prompt, cached = c["prompt"], c["cached"]
        return {
            "total_tokens_served": prompt + c["completion"],
            "total_cached_tokens": cached,
            "cache_efficiency": round(cached / prompt * 100, 1) if prompt else 0.0,
            "total_prompt_tokens": prompt,
            "total_completion_tokens": c["completion"],
            "total_requests": c["requests"],
            "avg_prefill_tps": 100.0,
            "avg_generation_tps": 50.0,
            "uptime_seconds": round(time.time() - self.started, 1),
        }

    def _status(self, q: dict, b: Any, h: dict) -> Reply:
        if self.api_key and h.get("Authorization") != f"Bearer {self.api_key}":
            return 401, {"detail": "API key required"}, {}
        snap = self._snapshot(self.session)  # /api/status reads the session snapshot
        return (
            200,
            {
                "status": "ok",
                "version": "0.7.1",
                "uptime_seconds": snap["uptime_seconds"],
                "models_discovered": 1,
                "models_loaded": 1,
                "models_loading": 0,
                "default_model": "tiny",
                "loaded_models": ["tiny"],
                "total_requests": snap["total_requests"],
                "active_requests": 0,
                "waiting_requests": 0,
                "total_prompt_tokens": snap["total_prompt_tokens"],
                "total_completion_tokens": snap["total_completion_tokens"],
                "total_cached_tokens": snap["total_cached_tokens"],
                "cache_efficiency": snap["cache_efficiency"],
                "avg_prefill_tps": snap["avg_prefill_tps"],
                "avg_generation_tps": snap["avg_generation_tps"],
                "model_memory_used": 123_456_789,
                "model_memory_max": 8_000_000_000,
                "model_memory_used_formatted": "117.7MB",
                "model_memory_max_formatted": "7.45GB",
            },
            {},
        )

    def _runtime_cache(self) -> dict[str, Any]:
        runtime: dict[str, Any] = {
            "base_path": "/Users/ci/.omlx",
            "ssd_cache_dir": "/Users/ci/.omlx/cache",
            "response_state_dir": "/Users/ci/.omlx/cache/response-state",
            "models": [{"id": "tiny", "block_size": self.block_size, "indexed_blocks": len(self.ssd)}],
            "total_num_files": len(self.ssd),
            "total_size_bytes": len(self.ssd) * 4096,
            "effective_block_sizes": [self.block_size],
            "disk_max_bytes": 4 * 2**30,
        }
        if not self.legacy:
            runtime.update(hot_cache_max_bytes=0, hot_cache_size_bytes=0, hot_cache_entries=0)
        return runtime

    def _stats(self, q: dict, b: Any, h: dict) -> Reply:
        scope = (q.get("scope") or ["session"])[0]
        counters = self.alltime if scope == "alltime" else self.session
        payload = {
            **self._snapshot(counters),
            "host": "127.0.0.1",
            "port": 8000,
            "api_key": self.api_key,
            "cli_prefix": "omlx",
            "engines": {},
            "active_models": {"models": [], "model_memory_used": 0, "model_memory_max": 0},
            "runtime_cache": self._runtime_cache(),
        }
        return 200, payload, {}

    def _clear_ssd(self, q: dict, b: Any, h: dict) -> Reply:
        deleted = len(self.ssd)
        self.ssd.clear()
        return 200, {"status": "ok", "total_deleted": deleted, "distributed_ranks": 0}, {}

    def _clear_hot(self, q: dict, b: Any, h: dict) -> Reply:
        return 200, {"status": "ok", "total_cleared": 0, "bytes_reclaimed": 0, "distributed_ranks": 0}, {}

    def _blocks(self, tokens: list[str]) -> list[int]:
        hashes, parent = [], None
        n = self.block_size
        for i in range(len(tokens) // n):
            parent = block_hash(parent, [int(t[1:]) for t in tokens[i * n : (i + 1) * n]])
            hashes.append(parent)
        return hashes

    def _probe(self, q: dict, body: Any, h: dict) -> Reply:
        tokens = " ".join(str(m.get("content", "")) for m in body.get("messages", [])).split()
        hashes = self._blocks(tokens)
        hits = 0
        for x in hashes:
            if x not in self.ssd:
                break
            hits += 1
        total_blocks = -(-len(tokens) // self.block_size)
        return (
            200,
            {
                "model_id": body.get("model_id"),
                "model_loaded": True,
                "total_tokens": len(tokens),
                "block_size": self.block_size,
                "total_blocks": total_blocks,
                "blocks_ssd_hot": 0,
                "blocks_ssd_disk": hits,
                "blocks_cold": total_blocks - hits,
                "ssd_hit_tokens": hits * self.block_size,
                "cold_tokens": len(tokens) - hits * self.block_size,
            },
            {},
        )

    def _complete(self, q: dict, body: Any, h: dict) -> Reply:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return 422, {"detail": "prompt must be a string"}, {}
        tokens = prompt.split()
        hashes = self._blocks(tokens)
        hits = 0
        for x in hashes:
            if x not in self.ssd:
                break
            hits += 1
        self.ssd.update(hashes)
        # an exact hit (every token in cached blocks) is trimmed by one: the last is recomputed
        cached = min(hits * self.block_size, len(tokens) - 1)
        for c in (self.session, self.alltime):
            c["prompt"] += len(tokens)
            c["completion"] += 1
            c["cached"] += cached
            c["requests"] += 1
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": 1,
            "total_tokens": len(tokens) + 1,
            "input_tokens": len(tokens),
            "output_tokens": 1,
            "total_time": 0.01,
        }
        if self.legacy:
            usage["cached_tokens"] = cached
        else:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return (
            200,
            {
                "id": "cmpl-1a2b3c4d",
                "object": "text_completion",
                "created": int(time.time()),
                "model": "tiny",
                "choices": [{"index": 0, "text": " w42", "finish_reason": "length"}],
                "usage": usage,
            },
            {},
        )
