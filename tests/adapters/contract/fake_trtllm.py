"""A local server shaped after TensorRT-LLM's `trtllm-serve`, per release (fakes.py: the common part).

Each release answers only with what that release serves (sources named where each payload is
built; paths in NVIDIA/TensorRT-LLM):

- 1.2.1: `/metrics` rows with `kvCacheStats` and no `kvCacheIterationStats`; kvCacheStats
  reuse counters include the warmup requests; `/prometheus/metrics` has the five unprefixed
  request metrics only (tensorrt_llm/metrics/collector.py), labels model_name="undefined",
  engine_type="undefined".
- 1.3.0rc29: rows add `kvCacheIterationStats` keyed by window size (#12413); the counters
  exclude warmup (#12132); `/prometheus/metrics` adds the `trtllm_*` KV and token metrics
  (#11243, #12132, #12413, #12545, #12636).

Both: `/prometheus/metrics` exists only with return_perf_metrics (openai_server.py
register_routes -> mount_metrics); `/perf_metrics` keeps records only with return_perf_metrics
and perf_metrics_max_requests > 0 (llm_args.py Field(default=0)), else answers []; KV events
only with event_buffer_max_size > 0 (the oldest dropped past it); `/metrics`,
`/kv_cache_events` and `/perf_metrics` hand each item to one reader once (drained).

Faults (self.mode): "pool" used+free != max, "hit_rate" rate over the wrong window,
"redeliver" /metrics repeats its last row, "skip_iter" an iteration number is skipped.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from tests.adapters.contract.fakes import FakeServer, Reply, block_hash, f32

RELEASE_12 = "1.2.1"
RELEASE_13 = "1.3.0rc29"
RELEASES = (RELEASE_12, RELEASE_13)
WINDOW = 4096  # the attention window (max_seq_len) the iteration stats and events are keyed by
LABELS = 'model_name="undefined",engine_type="undefined"'  # collector.py defaults in 1.2.1
# Histograms of the five request metrics both releases register (collector.py).
REQUEST_HISTOGRAMS = (
    ("e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.", 0.004),
    ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", 0.003),
    ("time_per_output_token_seconds", "Histogram of time per output token in seconds.", 0.001),
    ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", 0.0),
)


class FakeTrtllm(FakeServer):
    """trtllm-serve of one release, started with the options the adapter writes in launch mode
    (enable_iter_perf_stats, return_perf_metrics, event_buffer_max_size) unless told otherwise;
    perf_metrics_max_requests defaults to 0 as upstream."""

    def __init__(
        self,
        release: str = RELEASE_12,
        tokens_per_block: int = 8,
        max_blocks: int = 256,
        mode: str = "",
        *,
        perf_metrics_max_requests: int = 0,
        return_perf_metrics: bool = True,
        enable_iter_perf_stats: bool = True,
        event_buffer_max_size: int = 16384,
        warmup_blocks: int = 1,
    ) -> None:
        super().__init__()
        if release not in RELEASES:
            raise ValueError(f"no fake for TensorRT-LLM {release} (have {', '.join(RELEASES)})")
        self.release, self.v13 = release, release.startswith("1.3")
        self.tpb, self.max_blocks, self.mode = tokens_per_block, max_blocks, mode
        self.enable_iter_perf_stats = enable_iter_perf_stats
        self.cached: set[int] = set()
        self.reused = self.missed = self.alloc_total = self.alloc_new = 0
        # The server's warmup request allocates blocks before the first real request; 1.2.1
        # counts them as missed, 1.3 (#12132) leaves them out of reusedBlocks/missedBlocks.
        self.alloc_total = self.alloc_new = warmup_blocks
        self.warmup_missed = 0 if self.v13 else warmup_blocks
        self.missed = self.warmup_missed
        self.iter = 0
        self.iterations: list[dict[str, Any]] = []
        self.event_buffer_max_size = event_buffer_max_size
        self.events: deque[dict[str, Any]] = deque(maxlen=event_buffer_max_size or None)
        self.next_event = 0
        self._event({"type": "created", "num_blocks_per_cache_level": [max_blocks, 0]})
        keep_perf = return_perf_metrics and perf_metrics_max_requests > 0
        self.perf: deque[dict[str, Any]] | None = (
            deque(maxlen=perf_metrics_max_requests) if keep_perf else None
        )
        self.prompt_tokens = self.cached_tokens = self.requests = 0
        self.last_row: dict[str, Any] | None = None
        self.route("GET", "/health", lambda q, b, h: (200, None, {}))
        self.route("GET", "/version", lambda q, b, h: (200, {"version": self.release}, {}))
        self.route("GET", "/v1/models", lambda q, b, h: (200, self._models(), {}))
        self.route("GET", "/metrics", self._drain_metrics)
        self.route("POST", "/kv_cache_events", self._drain_events)
        self.route("GET", "/perf_metrics", self._drain_perf)
        if return_perf_metrics:  # openai_server.py register_routes: mount_metrics only then
            self.route("GET", "/prometheus/metrics", self._prometheus)
        self.route("POST", "/v1/completions", self._complete)

    def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "tiny", "object": "model", "owned_by": "tensorrt_llm"}]}

    # ---- drained endpoints ----------------------------------------------------------------
    def _drain_metrics(self, q: dict, b: Any, h: dict) -> Reply:
        rows, self.iterations = self.iterations, []
        if self.mode == "redeliver" and self.last_row is not None:
            rows = [self.last_row, *rows]
        if rows:
            self.last_row = rows[-1]
        return 200, rows, {}

    def _drain_events(self, q: dict, b: Any, h: dict) -> Reply:
        events = list(self.events)
        self.events.clear()
        return 200, events, {}

    def _drain_perf(self, q: dict, b: Any, h: dict) -> Reply:
        if self.perf is None:
            return 200, [], {}  # openai_server.py get_perf_metrics: no deque -> []
        perf = list(self.perf)
        self.perf.clear()
        return 200, perf, {}

    def _event(self, data: dict[str, Any]) -> None:
        """tensorrt_llm/_utils.py KVCacheEventSerializer; kvCacheEventManager.cpp: one id per
        event from 0, nothing kept when event_buffer_max_size is 0, the oldest dropped past it."""
        if self.event_buffer_max_size > 0:
            self.events.append({"event_id": self.next_event, "data": data, "window_size": WINDOW})
        self.next_event += 1

    # ---- iteration stats: cpp/tensorrt_llm/executor/jsonSerialization.cpp ---------------
    def _row(self, used: int, iter_reused: int, iter_missed: int, iter_alloc: int) -> dict[str, Any]:
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
        row: dict[str, Any] = {
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
        }
        if self.v13:  # #12413: per-window gauges and this iteration's deltas
            looked = iter_reused + iter_missed
            row["kvCacheIterationStats"] = {
                str(WINDOW): {
                    "primaryMaxNumBlocks": self.max_blocks,
                    "primaryFreeNumBlocks": free,
                    "primaryUsedNumBlocks": used,
                    "secondaryMaxNumBlocks": 0,
                    "secondaryFreeNumBlocks": 0,
                    "secondaryUsedNumBlocks": 0,
                    "iterAllocTotalBlocks": iter_alloc,
                    "iterAllocNewBlocks": iter_missed,
                    "iterReusedBlocks": iter_reused,
                    "iterFullReusedBlocks": iter_reused,
                    "iterPartialReusedBlocks": 0,
                    "iterMissedBlocks": iter_missed,
                    "iterCacheHitRate": f32(iter_reused / looked) if looked else 0.0,
                    "iterGenAllocBlocks": 0,
                    "iterOnboardBlocks": 0,
                    "iterOnboardBytes": 0,
                    "iterOffloadBlocks": 0,
                    "iterOffloadBytes": 0,
                    "iterIntraDeviceCopyBlocks": 0,
                    "iterIntraDeviceCopyBytes": 0,
                }
            }
        return row

    def _iteration(self, used: int, iter_reused: int, iter_missed: int, iter_alloc: int) -> None:
        row = self._row(used, iter_reused, iter_missed, iter_alloc)
        if self.enable_iter_perf_stats:  # default False upstream: no stats, /metrics answers []
            self.iterations.append(row)

    # ---- requests -------------------------------------------------------------------------
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
            self._event(
                {
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
                }
            )
            self.cached.update(x for _, x in new)
        self._iteration(total_blocks, reused, missed, total_blocks)  # context phase
        self._iteration(0, 0, 0, 0)  # request finished, blocks back in the pool
        self.requests += 1
        self.prompt_tokens += len(prompt)
        self.cached_tokens += reused * b
        if self.perf is not None:
            self.perf.append(
                {
                    "request_id": self.requests,
                    "perf_metrics": {
                        "first_iter": self.iter - 1,
                        "last_iter": self.iter,
                        "timing_metrics": {
                            "arrival_time": 1.0,
                            "first_scheduled_time": 1.0,
                            "first_token_time": 1.1,
                            "last_token_time": 1.1,
                        },
                        "kv_cache_metrics": {
                            "num_total_allocated_blocks": total_blocks,
                            "num_new_allocated_blocks": missed,
                            "num_reused_blocks": reused,
                            "num_missed_blocks": missed,
                        },
                    },
                }
            )
        # usage.prompt_tokens_details.cached_tokens: 1.2.x and 1.3 (serve/openai_protocol.py)
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

    # ---- /prometheus/metrics: tensorrt_llm/metrics/collector.py -------------------------
    def _prometheus(self, q: dict, b: Any, h: dict) -> Reply:
        lines = [
            "# HELP request_success_total Count of successfully processed requests.",
            "# TYPE request_success_total counter",
        ]
        if self.requests:
            lines.append(f'request_success_total{{{LABELS},finished_reason="length"}} {float(self.requests)}')
        for name, help_text, seconds in REQUEST_HISTOGRAMS:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            lines.append(f'{name}_bucket{{{LABELS},le="+Inf"}} {float(self.requests)}')
            lines.append(f"{name}_count{{{LABELS}}} {float(self.requests)}")
            lines.append(f"{name}_sum{{{LABELS}}} {seconds * self.requests}")
        if self.v13:
            lines += self._prometheus_13()
        return 200, "\n".join(lines) + "\n", {}

    def _prometheus_13(self) -> list[str]:
        looked_up = self.reused + self.missed
        used = 0  # between requests every block is back in the pool
        values = [
            (
                "trtllm_kv_cache_hit_rate",
                "gauge",
                "KV cache hit rate",
                self.reused / looked_up if looked_up else 0.0,
            ),
            ("trtllm_kv_cache_utilization", "gauge", "KV cache utilization", used / self.max_blocks),
            ("trtllm_kv_cache_reused_blocks_total", "counter", "KV cache blocks reused", self.reused),
            ("trtllm_kv_cache_missed_blocks_total", "counter", "KV cache blocks missed", self.missed),
            ("trtllm_kv_cache_onboard_bytes_total", "counter", "Bytes onboarded host to device", 0),
            ("trtllm_kv_cache_offload_bytes_total", "counter", "Bytes offloaded device to host", 0),
            ("trtllm_kv_cache_host_utilization", "gauge", "Host KV cache utilization", 0.0),
            ("trtllm_prompt_tokens_total", "counter", "Prompt tokens processed", self.prompt_tokens),
            ("trtllm_kv_cache_max_blocks", "gauge", "Maximum KV cache blocks", self.max_blocks),
            ("trtllm_kv_cache_free_blocks", "gauge", "Free KV cache blocks", self.max_blocks - used),
            ("trtllm_kv_cache_used_blocks", "gauge", "Used KV cache blocks", used),
            ("trtllm_gpu_memory_usage_bytes", "gauge", "GPU memory in use", 2_000_000_000),
            (
                "trtllm_prompt_cached_tokens_total",
                "counter",
                "Prompt tokens served from KV cache",
                self.cached_tokens,
            ),
        ]
        lines = []
        for name, kind, help_text, value in values:
            lines += [
                f"# HELP {name} {help_text}",
                f"# TYPE {name} {kind}",
                f"{name}{{{LABELS}}} {float(value)}",
            ]
        return lines
