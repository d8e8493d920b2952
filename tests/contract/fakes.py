"""Small local HTTP servers that answer as TensorRT-LLM's and oMLX's servers document it.

They are the suite's own code (stdlib http.server on 127.0.0.1, a free port), shaped after
the engines' sources: payload keys, drained-on-read endpoints, session vs all-time scopes.
They model a block-granular prefix cache just far enough for the adapters' numbers to mean
something; faults make them lie in one specific way each.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

Reply = tuple[int, Any, dict[str, str]]


def f32(value: float) -> float:
    """A value as a C++ float survives its JSON trip."""
    return struct.unpack("f", struct.pack("f", value))[0]


def block_hash(parent: int | None, tokens: list[int]) -> int:
    digest = hashlib.sha256(repr((parent, tokens)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # a size_t, JSON-safe


class FakeServer:
    """Routes (method, path) -> handler(query, body, headers) -> (status, payload, headers)."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Callable[[dict, Any, dict], Reply]] = {}
        self.faults: dict[str, str] = {}  # path -> "garbage" | "500"
        self.log: list[tuple[str, str]] = []
        self.lock = threading.RLock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return

            def _serve(self, method: str) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                server.log.append((method, self.path))
                fault = server.faults.get(parts.path)
                if fault == "500":
                    self._send(500, b"Internal Server Error", "text/plain")
                    return
                if fault == "garbage":
                    self._send(200, b"{not json", "application/json")
                    return
                handler = server.routes.get((method, parts.path))
                if handler is None:
                    self._send(404, json.dumps({"detail": "Not Found"}).encode(), "application/json")
                    return
                body = json.loads(raw) if raw else None
                with server.lock:
                    status, payload, headers = handler(parse_qs(parts.query), body, dict(self.headers))
                if isinstance(payload, str):
                    data, ctype = payload.encode(), headers.pop("Content-Type", "text/plain; version=0.0.4")
                elif payload is None:
                    data, ctype = b"", "text/plain"
                else:
                    data, ctype = json.dumps(payload).encode(), "application/json"
                self._send(status, data, ctype, headers)

            def _send(
                self, status: int, data: bytes, ctype: str, headers: dict[str, str] | None = None
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def route(self, method: str, path: str, fn: Callable[[dict, Any, dict], Reply]) -> None:
        self.routes[(method, path)] = fn

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class FakeTrtllm(FakeServer):
    """trtllm-serve with enable_iter_perf_stats, return_perf_metrics and KV events on.

    /metrics, /kv_cache_events and /perf_metrics hand each item to one reader once (drained).
    Faults (self.mode): "pool" used+free != max, "hit_rate" rate over the wrong window,
    "redeliver" /metrics repeats its last row, "skip_iter" an iteration number is skipped.
    """

    def __init__(self, tokens_per_block: int = 8, max_blocks: int = 256, mode: str = "") -> None:
        super().__init__()
        self.tpb, self.max_blocks, self.mode = tokens_per_block, max_blocks, mode
        self.cached: set[int] = set()
        self.reused = self.missed = self.alloc_total = self.alloc_new = 0
        self.iter = 0
        self.iterations: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = [
            {
                "event_id": 0,
                "data": {"type": "created", "num_blocks_per_cache_level": [max_blocks, 0]},
                "window_size": 4096,
            }
        ]
        self.next_event = 1
        self.perf: list[dict[str, Any]] = []
        self.prompt_tokens = self.cached_tokens = self.requests = 0
        self.last_row: dict[str, Any] | None = None
        self.route("GET", "/health", lambda q, b, h: (200, None, {}))
        self.route("GET", "/version", lambda q, b, h: (200, {"version": "1.2.1"}, {}))
        self.route("GET", "/v1/models", lambda q, b, h: (200, self._models(), {}))
        self.route("GET", "/metrics", self._drain_metrics)
        self.route("POST", "/kv_cache_events", self._drain_events)
        self.route("GET", "/perf_metrics", self._drain_perf)
        self.route("GET", "/prometheus/metrics", self._prometheus)
        self.route("POST", "/v1/completions", self._complete)

    def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "tensorrt_llm"}]}

    def _drain_metrics(self, q: dict, b: Any, h: dict) -> Reply:
        rows, self.iterations = self.iterations, []
        if self.mode == "redeliver" and self.last_row is not None:
            rows = [self.last_row, *rows]
        if rows:
            self.last_row = rows[-1]
        return 200, rows, {}

    def _drain_events(self, q: dict, b: Any, h: dict) -> Reply:
        events, self.events = self.events, []
        return 200, events, {}

    def _drain_perf(self, q: dict, b: Any, h: dict) -> Reply:
        perf, self.perf = self.perf, []
        return 200, perf, {}

    def _row(self, used: int, iter_reused: int, iter_missed: int) -> dict[str, Any]:
        self.iter += 1
        if self.mode == "skip_iter" and self.iter == 3:
            self.iter += 1
        free = self.max_blocks - used
        if self.mode == "pool":
            free -= 1  # one block neither free nor used
        looked_up = self.reused + self.missed
        rate = self.reused / looked_up if self.reused else 0.0
        if self.mode == "hit_rate":
            rate = iter_reused / (iter_reused + iter_missed) if iter_reused else 0.0
        return {
            "timestamp": time.strftime("%m-%d-%Y %H:%M:%S"),
            "iter": self.iter,
            "iterLatencyMS": 3.5,
            "newActiveRequestsQueueLatencyMS": 0.0,
            "numNewActiveRequests": 1,
            "numActiveRequests": 1 if used else 0,
            "numQueuedRequests": 0,
            "numCompletedRequests": 0 if used else 1,
            "maxNumActiveRequests": 64,
            "maxBatchSizeStatic": 64,
            "maxBatchSizeTunerRecommended": 64,
            "maxBatchSizeRuntime": 64,
            "maxNumTokensStatic": 8192,
            "maxNumTokensTunerRecommended": 8192,
            "maxNumTokensRuntime": 8192,
            "gpuMemUsage": 2_000_000_000,
            "cpuMemUsage": 0,
            "pinnedMemUsage": 0,
            "kvCacheStats": {
                "maxNumBlocks": self.max_blocks,
                "freeNumBlocks": free,
                "usedNumBlocks": used,
                "tokensPerBlock": self.tpb,
                "allocTotalBlocks": self.alloc_total,
                "allocNewBlocks": self.alloc_new,
                "reusedBlocks": self.reused,
                "missedBlocks": self.missed,
                "cacheHitRate": f32(rate),
            },
            "staticBatchingStats": None,
            "inflightBatchingStats": {
                "numScheduledRequests": 1 if used else 0,
                "numContextRequests": 1 if used else 0,
                "numGenRequests": 0,
                "numPausedRequests": 0,
                "numCtxTokens": 0,
                "microBatchId": 0,
                "avgNumDecodedTokensPerIter": 1.0,
            },
            "specDecodingStats": None,
            "attentionDpRank": 0,
            "kvCacheIterationStats": {
                "4096": {
                    "primaryMaxNumBlocks": self.max_blocks,
                    "primaryFreeNumBlocks": free,
                    "primaryUsedNumBlocks": used,
                    "iterReusedBlocks": iter_reused,
                    "iterMissedBlocks": iter_missed,
                    "iterCacheHitRate": f32(iter_reused / (iter_reused + iter_missed))
                    if iter_reused + iter_missed
                    else 0.0,
                }
            },
        }

    def _complete(self, q: dict, body: Any, h: dict) -> Reply:
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            return 400, {"error": "prompt must be token ids here"}, {}
        b = self.tpb
        usable_blocks = (len(prompt) - 1) // b  # the last prompt token is always computed
        total_blocks = -(-len(prompt) // b)
        hashes, parent = [], None
        for i in range(len(prompt) // b):
            parent = block_hash(parent, prompt[i * b : (i + 1) * b])
            hashes.append(parent)
        reused = 0
        for i in range(usable_blocks):
            if hashes[i] not in self.cached:
                break
            reused += 1
        missed = total_blocks - reused
        self.reused += reused
        self.missed += missed
        self.alloc_total += total_blocks
        self.alloc_new += missed
        new = [(i, x) for i, x in enumerate(hashes) if x not in self.cached]
        if new:
            first = new[0][0]
            self.events.append(
                {
                    "event_id": self.next_event,
                    "data": {
                        "type": "stored",
                        "parent_hash": hashes[first - 1] if first else None,
                        "blocks": [
                            {
                                "type": "stored_block",
                                "block_hash": x,
                                "tokens": [
                                    {"type": "unique_token", "token_id": t, "token_extra_id": 0}
                                    for t in prompt[i * b : (i + 1) * b]
                                ],
                                "cache_level": 0,
                                "priority": 35,
                            }
                            for i, x in new
                        ],
                    },
                    "window_size": 4096,
                }
            )
            self.next_event += 1
            self.cached.update(x for _, x in new)
        self.iterations.append(self._row(total_blocks, reused, missed))  # context phase
        self.iterations.append(self._row(0, 0, 0))  # request finished, blocks back in the pool
        self.requests += 1
        self.prompt_tokens += len(prompt)
        self.cached_tokens += reused * b
        self.perf.append(
            {
                "request_id": self.requests,
                "perf_metrics": {
                    "first_iter": self.iter - 1,
                    "last_iter": self.iter,
                    "timing_metrics": {"arrival_time": 1.0, "first_token_time": 1.1, "last_token_time": 1.1},
                    "kv_cache_metrics": {
                        "num_total_allocated_blocks": total_blocks,
                        "num_new_allocated_blocks": missed,
                        "num_reused_blocks": reused,
                        "num_missed_blocks": missed,
                    },
                },
            }
        )
        usage = {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + 1,
            "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": reused * b},
        }
        choice = {"index": 0, "text": " a", "token_ids": [17], "finish_reason": "length", "stop_reason": None}
        return (
            200,
            {
                "id": "cmpl-1",
                "object": "text_completion",
                "model": "tiny",
                "choices": [choice],
                "usage": usage,
            },
            {},
        )

    def _prometheus(self, q: dict, b: Any, h: dict) -> Reply:
        labels = 'model_name="tiny",engine_type="pytorch"'
        looked_up = self.reused + self.missed
        lines = [
            "# HELP trtllm_prompt_tokens_total Cumulative number of prompt (input) tokens processed.",
            "# TYPE trtllm_prompt_tokens_total counter",
            f"trtllm_prompt_tokens_total{{{labels}}} {float(self.prompt_tokens)}",
            "# HELP trtllm_prompt_cached_tokens_total Total prompt tokens served from KV cache.",
            "# TYPE trtllm_prompt_cached_tokens_total counter",
            f"trtllm_prompt_cached_tokens_total{{{labels}}} {float(self.cached_tokens)}",
            "# HELP trtllm_kv_cache_hit_rate KV cache hit rate",
            "# TYPE trtllm_kv_cache_hit_rate gauge",
            f"trtllm_kv_cache_hit_rate{{{labels}}} {self.reused / looked_up if looked_up else 0.0}",
            "# HELP trtllm_kv_cache_reused_blocks_total Cumulative number of KV cache blocks reused",
            "# TYPE trtllm_kv_cache_reused_blocks_total counter",
            f"trtllm_kv_cache_reused_blocks_total{{{labels}}} {float(self.reused)}",
            "# HELP trtllm_kv_cache_max_blocks Maximum number of KV cache blocks",
            "# TYPE trtllm_kv_cache_max_blocks gauge",
            f"trtllm_kv_cache_max_blocks{{{labels}}} {float(self.max_blocks)}",
            "# HELP trtllm_kv_cache_utilization KV cache utilization",
            "# TYPE trtllm_kv_cache_utilization gauge",
            f"trtllm_kv_cache_utilization{{{labels}}} 0.0",
        ]
        return 200, "\n".join(lines) + "\n", {}


class FakeOmlx(FakeServer):
    """`omlx serve`: word-level model, paged SSD prefix cache, session vs all-time stats.

    restart() is a new server life: session counters start at 0, all-time counters and the
    SSD tier survive. All-time counters start large, so reading the wrong scope shows.
    """

    ALLTIME_SEED = 1_000_000

    def __init__(self, block_size: int = 16, api_key: str = "") -> None:
        super().__init__()
        self.block_size, self.api_key = block_size, api_key
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
                return 401, {"detail": "API key required"}, {}
            return fn(q, b, h)

        return wrapped

    def _admin(self, fn: Callable[[dict, Any, dict], Reply]) -> Callable[[dict, Any, dict], Reply]:
        def wrapped(q: dict, b: Any, h: dict) -> Reply:
            if self.api_key and f"omlx_admin_session={self.cookie}" not in h.get("Cookie", ""):
                return 401, {"detail": "Admin authentication required"}, {"WWW-Authenticate": "Cookie"}
            return fn(q, b, h)

        return wrapped

    def _login(self, q: dict, body: Any, h: dict) -> Reply:
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
        return {
            "base_path": "/Users/ci/.omlx",
            "ssd_cache_dir": "/Users/ci/.omlx/cache",
            "response_state_dir": "/Users/ci/.omlx/cache/response-state",
            "models": [{"id": "tiny", "block_size": self.block_size, "indexed_blocks": len(self.ssd)}],
            "total_num_files": len(self.ssd),
            "total_size_bytes": len(self.ssd) * 4096,
            "effective_block_sizes": [self.block_size],
            "disk_max_bytes": 4 * 2**30,
            "hot_cache_max_bytes": 0,
            "hot_cache_size_bytes": 0,
            "hot_cache_entries": 0,
        }

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
        usable = (len(tokens) - 1) // self.block_size
        hits = 0
        for x in hashes[:usable]:
            if x not in self.ssd:
                break
            hits += 1
        self.ssd.update(hashes)
        cached = hits * self.block_size
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
            "cached_tokens": cached,
            "time_to_first_token": 0.01,
        }
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
