"""A local server shaped after TensorRT-LLM's `trtllm-serve` (see fakes.py for the common part)."""

from __future__ import annotations

import time
from typing import Any

from tests.contract.fakes import FakeServer, Reply, block_hash, f32


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
