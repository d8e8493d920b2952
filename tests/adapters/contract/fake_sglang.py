"""A local HTTP server that answers as `python -m sglang.launch_server --enable-metrics` does.

The suite's own code (stdlib http.server through tests/adapters/contract/fakes.py FakeServer), shaped
after SGLang 0.5.23's source; each payload below names the file it copies its shape from
(paths under the installed `sglang` package). It models a paged radix prefix cache just far
enough for the adapter's numbers to mean something: the match stops one token short of the
prompt and at a page boundary, full pages are cached, least recently used leaves are evicted
past `max_total_num_tokens`. Contract tests only: never a run of SGLang.

Faults (`mode`): "partial_loss" reports 0 cached tokens whenever the cached prefix ends
before the prompt's last full page (hits lost to page granularity, vllm-ascend #12589 style);
"bos" counts one more prompt token than the input_ids sent; "no_cached" leaves
meta_info.cached_tokens out. `busy_flushes` makes that many /flush_cache calls answer 400.

Shape switches: `enable_metrics=False` is a server without --enable-metrics (no /metrics);
`storage_backend="HiCacheFile"` (or any backend class name) is HiCache storage on, adding
"storage" and the backend's name to cached_tokens_details; `cache_details=False` is a path
that reports no cached_tokens_details, so sglang:cached_tokens_total falls back to
cache_source="total".
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any

import msgpack
import zmq

from tests.adapters.contract.fakes import FakeServer, Reply, block_hash

VERSION = "0.5.23+contract-fake"  # never mistaken for a real SGLang in a results file
MODEL = "tiny"
CACHE_TYPE = "UnifiedRadixCache"  # RadixCacheMetricsCollector's cache_type: the cache class name


class FakeSglang(FakeServer):
    def __init__(
        self,
        page_size: int = 32,
        max_total_tokens: int = 4096,
        mode: str = "",
        legacy: bool = False,
        *,
        enable_metrics: bool = True,
        storage_backend: str | None = None,
        cache_details: bool = True,
    ) -> None:
        super().__init__()
        self.page_size, self.capacity, self.mode = page_size, max_total_tokens, mode
        self.enable_metrics = enable_metrics
        self.storage_backend = storage_backend
        self.cache_details = cache_details
        self.cached_by_source: dict[str, int] = {}  # sglang:cached_tokens_total{cache_source}
        self.pages: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.busy_flushes = 0
        self.flushes = 0
        self.bodies: list[dict[str, Any]] = []
        self.prompt_tokens = self.cached_tokens = self.requests = self.evicted_tokens = 0
        self.streaming_prompt_tokens = 0
        self.last_hit_rate = 0.0
        self.route("GET", "/health", lambda q, b, h: (200, None, {}))
        self.route("GET", "/model_info", lambda q, b, h: (200, self._model_info(), {}))
        self.route("GET", "/get_server_info", lambda q, b, h: (200, self._server_info(), {}))
        if not legacy:  # older servers have only /get_server_info
            self.route("GET", "/server_info", lambda q, b, h: (200, self._server_info(), {}))
        self.route("POST", "/generate", self._generate)
        self.route("POST", "/v1/completions", self._completions)
        self.route("POST", "/flush_cache", self._flush)
        self.route("GET", "/flush_cache", self._flush)
        if enable_metrics:  # http_server.py mounts /metrics only with --enable-metrics
            self.route("GET", "/metrics", self._metrics)

    # srt/entrypoints/http_server.py model_info()
    def _model_info(self) -> dict[str, Any]:
        return {
            "model_path": "/models/tiny",
            "served_model_name": MODEL,
            "tokenizer_path": "/models/tiny",
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "load_format": "dummy",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
        }

    # srt/entrypoints/http_server.py server_info(): build_server_info (srt/utils/common.py) =
    # server_args.resolved_dict() + launch_command + scheduler info (scheduler.py
    # get_init_info) + kv_events (runtime_context.py describe_kv_events_publisher), then
    # startup_time, internal_states (one per DP rank), version, frontend.
    def _server_info(self) -> dict[str, Any]:
        args = {
            "model_path": "/models/tiny",
            "tokenizer_path": "/models/tiny",
            "served_model_name": MODEL,
            "load_format": "dummy",
            "skip_tokenizer_init": True,
            "host": "127.0.0.1",
            "port": self.httpd.server_address[1],
            "page_size": self.page_size,
            "max_total_tokens": self.capacity,
            "mem_fraction_static": 0.8,
            "disable_radix_cache": False,
            "enable_metrics": self.enable_metrics,
            "enable_cache_report": False,
            "kv_events_config": None,
            "tp_size": 1,
            "dp_size": 1,
            "attention_backend": "fa3",
            "enable_dp_attention": False,
        }
        return {
            **args,
            "launch_command": "python -m sglang.launch_server --model-path /models/tiny"
            + (" --enable-metrics" if self.enable_metrics else ""),
            "status": "ready",
            "max_total_num_tokens": self.capacity,
            "max_req_input_len": self.capacity - 1,
            "hicache_object_layout": {"enabled": False, "reason": "Hierarchical cache is disabled"},
            "kv_events": None,
            "startup_time": 12.5,
            "internal_states": [{**args, "world_size": 1, "last_gen_throughput": 0.0}],
            "version": VERSION,
            "frontend": "python",
        }

    # ---- the cache model ---------------------------------------------------------------
    def _page_hashes(self, ids: list[int], salt: str = "") -> list[int]:
        # a salted request's pages chain from the salt (utils.py storage_namespace_seed)
        hashes, parent, p = [], (block_hash(None, [ord(c) for c in salt]) if salt else None), self.page_size
        for i in range(len(ids) // p):
            parent = block_hash(parent, ids[i * p : (i + 1) * p])
            hashes.append(parent)
        return hashes

    def _serve(self, ids: list[int], salt: str = "") -> int:
        p = self.page_size
        hashes = self._page_hashes(ids, salt)
        usable = (len(ids) - 1) // p  # schedule_batch.py _compute_max_prefix_len: input_len - 1
        matched = 0
        while matched < usable and hashes[matched] in self.pages:
            matched += 1
        cached = matched * p
        if self.mode == "partial_loss" and 0 < matched < usable:
            cached = 0
        for h in reversed(hashes):  # deepest first: the root stays the most recently used
            self.pages[h] = None
            self.pages.move_to_end(h)
        while len(self.pages) * p > self.capacity:
            self.pages.popitem(last=False)
            self.evicted_tokens += p
        return cached

    # srt/managers/tokenizer_manager.py _handle_batch_output: out_dict = {text, output_ids,
    # meta_info}; meta_info from id/finish_reason/prompt_tokens/weight_version/num_retractions,
    # then reasoning_tokens/completion_tokens/cached_tokens, cached_tokens_details
    # (scheduler_components/output_streamer.py get_cached_tokens_details; io_struct.py types it
    # Dict[str, int | str]): {"device", "host"} when any token was cached, plus "storage" (int)
    # and "storage_backend" (the backend class name, a string) with HiCache storage on; the
    # key is present as null when nothing was cached.
    # entrypoints/openai/serving_completions.py with --enable-cache-report: usage carries
    # prompt_tokens_details.cached_tokens; `cache_salt` (protocol.py CompletionRequest) keeps a
    # salt's pages apart; `return_token_ids` adds the answer's ids to the choice.
    def _completions(self, q: dict, body: Any, h: dict) -> Reply:
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), list):
            return 400, {"error": "prompt must be a list of token ids here"}, {}
        ids, n_out = body["prompt"], int(body.get("max_tokens", 1))
        cached = self._serve(ids, str(body.get("cache_salt") or ""))
        self.requests += 1
        self.prompt_tokens += len(ids)
        self.cached_tokens += cached
        usage = {
            "prompt_tokens": len(ids),
            "completion_tokens": n_out,
            "total_tokens": len(ids) + n_out,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        choice: dict[str, Any] = {"index": 0, "text": " w17" * n_out}
        if body.get("return_token_ids"):  # 0.5.23 protocol.py CompletionResponseChoice.token_ids
            choice["token_ids"] = [17 + i % 5 for i in range(n_out)]
        return 200, {"choices": [choice], "usage": usage}, {}

    def _generate(self, q: dict, body: Any, h: dict) -> Reply:
        if not isinstance(body, dict) or not isinstance(body.get("input_ids"), list):
            return 400, {"error": "Either text or input_ids should be provided."}, {}
        self.bodies.append(body)
        ids = body["input_ids"]
        params = body.get("sampling_params") or {}
        n_out = int(params.get("max_new_tokens", 1))
        cached = self._serve(ids)
        stream = bool(body.get("stream"))
        self.requests += 1
        self.prompt_tokens += len(ids)
        if stream:
            self.streaming_prompt_tokens += len(ids)
        self.cached_tokens += cached
        self.last_hit_rate = cached / len(ids)
        meta: dict[str, Any] = {
            "id": uuid.uuid4().hex,
            "finish_reason": {"type": "length", "length": n_out},
            "prompt_tokens": len(ids) + (1 if self.mode == "bos" else 0),
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": n_out,
            "cached_tokens": cached,
            "e2e_latency": 0.004,
        }
        details: dict[str, int | str] | None = None
        if cached and self.cache_details:
            details = {"device": cached, "host": 0}
            if self.storage_backend is not None:
                details.update(storage=0, storage_backend=self.storage_backend)
        meta["cached_tokens_details"] = details
        if cached:
            # metrics_collector.py: per request with cached_tokens > 0, each int source of the
            # details is counted under its cache_source; without details, all under "total".
            sources = {k: v for k, v in (details or {"total": cached}).items() if isinstance(v, int)}
            for source, tokens in sources.items():
                self.cached_by_source[source] = self.cached_by_source.get(source, 0) + tokens
        if self.mode == "no_cached":
            del meta["cached_tokens"]
        output = [17 + i % 5 for i in range(n_out)]
        if not stream:
            return 200, {"text": " w17" * n_out, "output_ids": output, "meta_info": meta}, {}
        # http_server.py stream_results: b"data: " + json + b"\n\n" per step, then [DONE]
        chunks = []
        for k in range(1, n_out + 1):
            # finish_reason is None until the last step (output_streamer.py: `req.finished_reason.to_json()
            # if req.finished_reason else None`)
            step = {
                **meta,
                "completion_tokens": k,
                "finish_reason": meta["finish_reason"] if k == n_out else None,
            }
            chunks.append(
                "data: " + json.dumps({"text": " w17", "output_ids": output[k - 1 : k], "meta_info": step})
            )
        chunks.append("data: [DONE]")
        return 200, "\n\n".join(chunks) + "\n\n", {"Content-Type": "text/event-stream"}

    # srt/entrypoints/http_server.py flush_cache: 200 with this text, or 400 with the
    # scheduler's message (scheduler_components/flush_wrapper.py) when not idle.
    # A negative ?timeout= fails FastAPI's validation (422) before the handler runs.
    def _flush(self, q: dict, body: Any, h: dict) -> Reply:
        timeout = (q.get("timeout") or [None])[0]
        if timeout is not None:
            try:
                bad = float(timeout) < 0
            except ValueError:
                bad = True
            if bad:
                detail = [{"type": "greater_than_equal", "loc": ["query", "timeout"], "input": timeout}]
                return 422, {"detail": detail}, {}
        self.flushes += 1
        if self.busy_flushes > 0:
            self.busy_flushes -= 1
            return 400, "Timed out waiting for idle state.", {"Content-Type": "text/plain"}
        self.pages.clear()
        text = (
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )
        return 200, text, {"Content-Type": "text/plain"}

    # srt/observability/metrics_collector.py: TokenizerMetricsCollector labels model_name and
    # engine_type (+ is_streaming, cache_source); SchedulerMetricsCollector adds tp_rank,
    # pp_rank, moe_ep_rank; RadixCacheMetricsCollector (evicted tokens) labels cache_type (the
    # cache class name), tp_rank, pp_rank, dp_rank only. A labelled counter has no sample
    # until its first inc().
    def _metrics(self, q: dict, b: Any, h: dict) -> Reply:
        tok = f'engine_type="unified",model_name="{MODEL}"'
        sched = f'engine_type="unified",model_name="{MODEL}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
        radix = f'cache_type="{CACHE_TYPE}",dp_rank="0",pp_rank="0",tp_rank="0"'
        lines = [
            "# HELP sglang:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE sglang:prompt_tokens_total counter",
        ]
        if self.requests:
            plain = float(self.prompt_tokens - self.streaming_prompt_tokens)
            lines.append(f'sglang:prompt_tokens_total{{{tok},is_streaming="false"}} {plain}')
            if self.streaming_prompt_tokens:
                lines.append(
                    f'sglang:prompt_tokens_total{{{tok},is_streaming="true"}} '
                    f"{float(self.streaming_prompt_tokens)}"
                )
        lines += [
            "# HELP sglang:cached_tokens_total Number of cached prompt tokens by source"
            " (device/host/storage).",
            "# TYPE sglang:cached_tokens_total counter",
        ]
        for source, tokens in self.cached_by_source.items():
            lines.append(f'sglang:cached_tokens_total{{cache_source="{source}",{tok}}} {float(tokens)}')
        lines += [
            "# HELP sglang:num_requests_total Number of requests processed.",
            "# TYPE sglang:num_requests_total counter",
        ]
        if self.requests:
            lines.append(f'sglang:num_requests_total{{{tok},is_streaming="false"}} {float(self.requests)}')
        lines += [
            "# HELP sglang:token_usage The token usage.",
            "# TYPE sglang:token_usage gauge",
            f"sglang:token_usage{{{sched}}} 0.0",
            "# HELP sglang:cache_hit_rate The prefix cache hit rate.",
            "# TYPE sglang:cache_hit_rate gauge",
            f"sglang:cache_hit_rate{{{sched}}} {self.last_hit_rate}",
            "# HELP sglang:page_size The number of tokens in a page.",
            "# TYPE sglang:page_size gauge",
            f"sglang:page_size{{{sched}}} {float(self.page_size)}",
            "# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.",
            "# TYPE sglang:max_total_num_tokens gauge",
            f"sglang:max_total_num_tokens{{{sched}}} {float(self.capacity)}",
            "# HELP sglang:evicted_tokens_total The number of device KV token slots freed by eviction.",
            "# TYPE sglang:evicted_tokens_total counter",
        ]
        if self.evicted_tokens:
            lines.append(f"sglang:evicted_tokens_total{{{radix}}} {float(self.evicted_tokens)}")
        return 200, "\n".join(lines) + "\n", {}


class FakeSglangPublisher:
    """KV events as SGLang's ZmqEventPublisher sends them (srt/disaggregation/kv_events.py):
    PUB frames (topic, 8-byte big-endian seq, msgpack EventBatch), EventBatch an array
    [ts, events, attn_dp_rank], each event a map tagged "type" with None fields omitted
    (msgspec omit_defaults); replays on a ROUTER: (id, b"", topic, seq, payload) per batch,
    then (id, b"", b"", END_SEQ, b"")."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: dict[str, Any]) -> None:
        self.topic = str(config.get("topic", "")).encode()
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.connect(config["endpoint"])  # a concrete host: connect, as the publisher does
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.replay.bind(config["replay_endpoint"])
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0

    def publish(self, events: list[dict[str, Any]], send: bool = True) -> int:
        payload = msgpack.packb([time.time(), events, 0])
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart((self.topic, seq.to_bytes(8, "big"), payload))
        return seq

    def serve_replay(self, timeout_ms: int = 3000) -> bool:
        if not self.replay.poll(timeout_ms):
            return False
        client, _, start = self.replay.recv_multipart()
        first = int.from_bytes(start, "big")
        for seq, payload in self.buffer:
            if seq >= first:
                self.replay.send_multipart((client, b"", self.topic, seq.to_bytes(8, "big"), payload))
        self.replay.send_multipart((client, b"", b"", self.END_SEQ, b""))
        return True

    def close(self) -> None:
        self.pub.close(0)
        self.replay.close(0)


def stored(hashes: list[int], parent: int | None, tokens: list[int], page_size: int) -> dict[str, Any]:
    """BlockStored as msgspec encodes it (tag "type"; lora_id None is kept: no default)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": page_size,
        "lora_id": None,
        "medium": "GPU",
    }


def removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
