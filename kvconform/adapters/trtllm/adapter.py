"""TensorRT-LLM (GPU runners only): `trtllm-serve` launched by the suite, or attached to.

What the server offers and how this adapter reads it (TensorRT-LLM 1.2,
tensorrt_llm/serve/openai_server.py, tensorrt_llm/commands/serve.py):

- `GET /metrics` is JSON: a list of iteration stats (`iter`, `gpuMemUsage`,
  `kvCacheStats{maxNumBlocks, freeNumBlocks, usedNumBlocks, tokensPerBlock, allocTotalBlocks,
  allocNewBlocks, reusedBlocks, missedBlocks, cacheHitRate}`, newer builds also
  `kvCacheIterationStats{<window>: {iter*...}}`). It is DRAINED on read: each iteration is
  returned to one reader once. So exactly one consumer (a thread of this adapter) reads it,
  keeps every iteration, and serves copies to the suites. Rows are keyed by
  (attentionDpRank, iter): a row seen twice is dropped, a jump in `iter` is counted as a gap
  (another reader, or the server's bounded buffer overflowed).
- `kvCacheStats.reusedBlocks/missedBlocks` are cumulative BlockManager counters and
  `cacheHitRate` = reused / (reused + missed) over them (0 when reused is 0), a float32
  (cpp/include/tensorrt_llm/batch_manager/kvCacheManager.h, getKvCacheStats).
- `POST /kv_cache_events` drains KV cache events, a list of
  `{event_id, data: {type: created|stored|removed|updated, ...}, window_size[, attention_dp_rank]}`
  (tensorrt_llm/_utils.py KVCacheEventSerializer). `event_id` is one counter per KV cache
  event manager, +1 per event from 0; consecutive removals are merged into one event; the
  oldest events are dropped when `event_buffer_max_size` overflows
  (cpp/tensorrt_llm/batch_manager/kvCacheEventManager.cpp).
- `GET /perf_metrics` drains per-request records with `perf_metrics.kv_cache_metrics
  {num_total_allocated_blocks, num_new_allocated_blocks, num_reused_blocks, num_missed_blocks}`.
- `/prometheus/metrics` (only with `return_perf_metrics: true`): `trtllm_*` Prometheus text
  (tensorrt_llm/metrics/collector.py).
- `/v1/completions` takes a token-id list as `prompt` and answers
  `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, ClassVar

from kvconform.contract import (
    AdapterContext,
    BlockPoolStats,
    Capability,
    EngineAdapter,
    EngineConfig,
    ServedPrompt,
)
from kvconform.errors import EngineError, KvconformError
from kvconform.events import EventLedger, KvEvent, hash_text
from kvconform.kit.server import LaunchedServer
from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport, free_port

C = Capability
DEFAULT_MODEL = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
MEDIUM_BY_CACHE_LEVEL = {0: "device", 1: "host"}  # kPrimaryLevel, kSecondaryLevel
HOST_CACHE_BYTES = 2 * 2**30


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} is {value!r}, not a number")
    return int(value)


class IterationStore:
    """Every iteration drained from /metrics, each kept once, in arrival order."""

    def __init__(self) -> None:
        self._rows: list[dict[str, Any]] = []
        self._last_iter: dict[int, int] = {}  # attention-DP rank -> last iter seen
        self.duplicates = 0
        self.gaps: list[tuple[int, int]] = []  # (last iter kept, next iter seen)
        self.restarts = 0
        self._lock = threading.Lock()

    def add(self, rows: list[Any]) -> int:
        added = 0
        with self._lock:
            for row in rows:
                if isinstance(row, str):  # some builds return the serialized JSON string
                    row = json.loads(row)
                if not isinstance(row, dict):
                    raise ValueError(f"iteration stat is {type(row).__name__}, not an object")
                rank = int(row.get("attentionDpRank", 0) or 0)
                it = row.get("iter")
                if it is not None:
                    it = _int(it, "iter")
                    last = self._last_iter.get(rank)
                    if last is not None and it <= last:
                        if it > 1:  # a row delivered again (or out of order): keep it once
                            self.duplicates += 1
                            continue
                        self.restarts += 1  # iter starts over: a new engine instance
                    elif last is not None and it > last + 1:
                        self.gaps.append((last, it))
                    self._last_iter[rank] = it
                self._rows.append(row)
                added += 1
        return added

    def rows(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._rows)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rows)


def parse_kv_event(raw: Any, medium_of: dict[str, str]) -> list[KvEvent]:
    """One TensorRT-LLM KV cache event -> ledger events (several for a tier move).

    `medium_of` tracks each block hash's current tier: removals do not carry a cache level.
    Events that change no residency (created, priority-only updates) become an empty store
    so their event_id still occupies its place in the sequence.
    """
    if not isinstance(raw, dict) or "event_id" not in raw or not isinstance(raw.get("data"), dict):
        raise ValueError(f"not a KV cache event: {str(raw)[:160]}")
    seq = _int(raw["event_id"], "event_id")
    data = raw["data"]
    kind = data.get("type")
    if kind == "created":
        medium_of.clear()
        return [KvEvent(seq, "cleared")]
    if kind == "stored":
        by_medium: dict[str, list[str]] = {}
        tokens = 0
        for block in data.get("blocks") or []:
            block_hash = hash_text(block["block_hash"])
            medium = MEDIUM_BY_CACHE_LEVEL.get(int(block.get("cache_level", 0) or 0), "device")
            medium_of[block_hash] = medium
            by_medium.setdefault(medium, []).append(block_hash)
            tokens += len(block.get("tokens") or [])
        parent = data.get("parent_hash")
        parent_text = None if parent is None else hash_text(parent)
        if not by_medium:
            return [KvEvent(seq, "stored", (), parent_text)]
        return [
            KvEvent(seq, "stored", tuple(hashes), parent_text, medium, tokens, sub)
            for sub, (medium, hashes) in enumerate(sorted(by_medium.items()))
        ]
    if kind == "removed":
        by_medium = {}
        for value in data.get("block_hashes") or []:
            block_hash = hash_text(value)
            by_medium.setdefault(medium_of.pop(block_hash, "device"), []).append(block_hash)
        if not by_medium:
            return [KvEvent(seq, "removed", ())]
        return [
            KvEvent(seq, "removed", tuple(hashes), medium=medium, sub=sub)
            for sub, (medium, hashes) in enumerate(sorted(by_medium.items()))
        ]
    if kind == "updated":
        block_hash = hash_text(data["block_hash"])
        level = data.get("cache_level")
        if isinstance(level, dict) and level.get("old_value") != level.get("new_value"):
            old = MEDIUM_BY_CACHE_LEVEL.get(int(level.get("old_value") or 0), "device")
            new = MEDIUM_BY_CACHE_LEVEL.get(int(level.get("new_value") or 0), "device")
            medium_of[block_hash] = new
            return [
                KvEvent(seq, "removed", (block_hash,), medium=old, sub=0),
                KvEvent(seq, "stored", (block_hash,), medium=new, sub=1),
            ]
        return [KvEvent(seq, "stored", ())]
    raise ValueError(f"unknown KV cache event type {kind!r} (event_id {seq})")


def pool_stats_of(row: dict[str, Any]) -> BlockPoolStats | None:
    """kvCacheStats of one iteration row (None when the iteration carries none)."""
    kv = row.get("kvCacheStats")
    if not isinstance(kv, dict):
        return None
    it = row.get("iter")
    return BlockPoolStats(
        max_blocks=_int(kv["maxNumBlocks"], "kvCacheStats.maxNumBlocks"),
        free_blocks=_int(kv["freeNumBlocks"], "kvCacheStats.freeNumBlocks"),
        used_blocks=_int(kv["usedNumBlocks"], "kvCacheStats.usedNumBlocks"),
        reused_blocks=_int(kv["reusedBlocks"], "kvCacheStats.reusedBlocks"),
        missed_blocks=_int(kv["missedBlocks"], "kvCacheStats.missedBlocks"),
        hit_rate=float(kv["cacheHitRate"]),
        tokens_per_block=_int(kv["tokensPerBlock"], "kvCacheStats.tokensPerBlock"),
        iteration=None if it is None else int(it),
        cumulative=True,
    )


class DrainingConsumer:
    """The one reader of the server's drained-on-read endpoints, in a background thread.

    poll() may also be called directly (under the same lock), so a suite that asks for
    stats sees everything drained up to that moment, and nothing twice.
    """

    def __init__(self, adapter: TrtllmAdapter, interval_s: float) -> None:
        self.adapter = adapter
        self.interval_s = interval_s
        self.iterations = IterationStore()
        self.perf: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.polls = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trtllm-drain", daemon=True)
        self._thread.start()

    def poll(self) -> None:
        a = self.adapter
        with self._lock:
            rows = a.get_json("/metrics")
            if not isinstance(rows, list):
                raise EngineError(a.name, f"/metrics returned {type(rows).__name__}, not a list")
            try:
                self.iterations.add(rows)
            except (ValueError, KeyError) as exc:
                raise EngineError(a.name, f"/metrics iteration stats malformed: {exc}") from None
            events = a.post_json("/kv_cache_events")
            if not isinstance(events, list):
                raise EngineError(a.name, f"/kv_cache_events returned {type(events).__name__}, not a list")
            a._ingest_events(events)
            if a.read_perf_metrics:
                perf = a.get_json("/perf_metrics")
                if not isinstance(perf, list):
                    raise EngineError(a.name, f"/perf_metrics returned {type(perf).__name__}, not a list")
                self.perf.extend(perf)
            self.polls += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll()
            except KvconformError as exc:
                self.errors.append(str(exc).splitlines()[0])
                del self.errors[:-50]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class TrtllmAdapter(EngineAdapter):
    name = "trtllm"
    env_spec = "trtllm"
    # TensorRT-LLM's default tokens_per_block; the adapter reads the real one from kvCacheStats.
    default_block_size = 32
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.PREFIX_HIT_COUNTERS,
            C.BLOCK_POOL_STATS,
            C.KV_EVENTS,
            C.RESTART,
            C.HOST_MEMORY,
        }
    )
    metric_names: ClassVar[dict[str, str]] = {
        # per-request token counters, fed from each finished request's metrics
        "prefix_queries": "trtllm_prompt_tokens_total",
        "prefix_hits": "trtllm_prompt_cached_tokens_total",
        "kv_usage": "trtllm_kv_cache_utilization",
        "blocks_total": "trtllm_kv_cache_max_blocks",
        "offload_store_bytes": "trtllm_kv_cache_offload_bytes_total",
        "offload_load_bytes": "trtllm_kv_cache_onboard_bytes_total",
    }
    poll_interval_s: ClassVar[float] = float(os.environ.get("KVCONFORM_TRTLLM_POLL_S", "0.25"))
    read_perf_metrics: ClassVar[bool] = True

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.server: LaunchedServer | None = None
        self.consumer: DrainingConsumer | None = None
        self._served_model: str | None = None
        self._medium_of: dict[str, str] = {}
        self._events_lock = threading.Lock()
        self.event_rows = 0

    # ---- identity -----------------------------------------------------------------------
    def attached_version(self) -> str:
        try:
            return str(self.get_json("/version", timeout=5).get("version", "unknown"))
        except (EngineError, AttributeError):
            return "unknown (attached)"

    def model_name(self) -> str:
        if self._served_model is None:
            data = self.get_json("/v1/models")
            try:
                self._served_model = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise EngineError(self.name, f"/v1/models lists no model: {str(data)[:200]}") from None
        return self._served_model

    # ---- lifecycle ----------------------------------------------------------------------
    def ensure(self, config: EngineConfig | None = None) -> None:
        super().ensure(config)
        self._consumer()

    def _consumer(self) -> DrainingConsumer:
        if self.consumer is None:
            self.consumer = DrainingConsumer(self, self.poll_interval_s)
        return self.consumer

    def llm_api_options(self, config: EngineConfig) -> dict[str, Any]:
        """The --extra_llm_api_options file (YAML; JSON is YAML). Names from
        tensorrt_llm/llmapi/llm_args.py (KvCacheConfig, TorchLlmArgs)."""
        kv: dict[str, Any] = {
            "enable_block_reuse": True,
            "free_gpu_memory_fraction": 0.5,
            "event_buffer_max_size": 16384,
        }
        if config.offload:
            kv["host_cache_size"] = HOST_CACHE_BYTES
        return {
            "enable_iter_perf_stats": True,
            "return_perf_metrics": True,
            "kv_cache_config": kv,
        }

    def server_argv(self, config: EngineConfig, port: int, options_path: Path) -> list[str]:
        model = os.environ.get("KVCONFORM_TRTLLM_MODEL", DEFAULT_MODEL)
        return [
            str(self.env().bin("trtllm-serve")),
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend",
            "pytorch",
            "--max_seq_len",
            "4096",
            "--extra_llm_api_options",
            str(options_path),
        ]

    def start(self, config: EngineConfig) -> None:
        if config.persistent:
            raise NotImplementedError("TensorRT-LLM has no persistent prefix tier wired here")
        if config.block_size not in (None, self.default_block_size):
            raise NotImplementedError("block size is fixed at the engine default here")
        port = free_port()
        workdir = self.ctx.workdir
        workdir.mkdir(parents=True, exist_ok=True)
        options = workdir / "trtllm-options.yaml"
        options.write_text(json.dumps(self.llm_api_options(config), indent=1))
        self.base_url = f"http://127.0.0.1:{port}"
        self._reset_instance_state()
        self.server = LaunchedServer(
            self.name,
            "trtllm-serve",
            self.server_argv(config, port, options),
            workdir,
            self.url("/health"),
            env={"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0")},
            timeout_s=self.ctx.start_timeout_s,
            session=self.http,
        )
        self.config = config
        self._consumer()

    def _reset_instance_state(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None
        self.ledger = EventLedger()  # one ledger per engine instance: event ids restart at 0
        self._medium_of = {}
        self._served_model = None

    def stop(self) -> list[TeardownReport]:
        reports = []
        if self.consumer is not None:
            self.consumer.close()
            self.consumer = None
        if self.server is not None:
            reports.append(self.server.stop())
            self.server = None
        self.config = None
        return reports

    def close(self) -> None:
        if self.attached:
            if self.consumer is not None:
                self.consumer.close()
                self.consumer = None
            return
        self.stop()

    def running(self) -> bool:
        return self.server is not None and self.server.process.alive()

    # ---- requests -----------------------------------------------------------------------
    def completion_body(self, tokens: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
        return {
            "model": self.model_name(),
            "prompt": list(tokens),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }

    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        return self.openai_completion(tokens, max_tokens)

    def metrics(self) -> MetricSnapshot:
        return self.scrape("/prometheus/metrics")

    # ---- drained JSON endpoints ---------------------------------------------------------
    def poll_now(self) -> None:
        """Drain /metrics, /kv_cache_events (and /perf_metrics) into the adapter now."""
        self._consumer().poll()

    def iteration_stats(self) -> list[dict[str, Any]]:
        self.poll_now()
        return self._consumer().iterations.rows()

    def perf_metrics(self) -> list[dict[str, Any]]:
        """Per-request records drained from /perf_metrics, each kept once."""
        self.poll_now()
        return list(self._consumer().perf)

    def block_pool_stats(self) -> list[BlockPoolStats]:
        out = []
        for row in self.iteration_stats():
            try:
                stats = pool_stats_of(row)
            except (KeyError, ValueError, TypeError) as exc:
                what = f"kvCacheStats malformed in iteration {row.get('iter')}: {exc}"
                raise EngineError(self.name, what) from None
            if stats is not None:
                out.append(stats)
        return out

    def block_size(self) -> int:
        if self.consumer is not None:
            for row in reversed(self.consumer.iterations.rows()):
                kv = row.get("kvCacheStats")
                if isinstance(kv, dict) and kv.get("tokensPerBlock"):
                    return int(kv["tokensPerBlock"])
        return super().block_size()

    def cache_capacity_tokens(self) -> int:
        pools = self.block_pool_stats()
        if not pools:
            raise NotImplementedError("no iteration stats seen yet: pool size unknown")
        return pools[-1].max_blocks * pools[-1].tokens_per_block

    def resident_blocks_reported(self) -> int | None:
        return None  # kvCacheStats counts blocks in use, not cached-and-free blocks

    def _ingest_events(self, events: list[Any]) -> None:
        parsed: list[KvEvent] = []
        with self._events_lock:
            for raw in events:
                try:
                    parsed.extend(parse_kv_event(raw, self._medium_of))
                except (KeyError, TypeError, ValueError) as exc:
                    raise EngineError(self.name, f"/kv_cache_events: {exc}") from None
            self.event_rows += len(events)
        self.ledger.extend(parsed)

    def drain_events(self) -> int:
        """Events leave the engine once per iteration: wait a moment, then drain them all.
        There is no replay endpoint, so a gap stays a gap (returns 0 filled)."""
        time.sleep(0.3)
        self.poll_now()
        return 0

    # ---- memory -------------------------------------------------------------------------
    def engine_pids(self) -> list[int]:
        return self.server.pids() if self.server else []

    def log_tail(self, lines: int = 40) -> str:
        return self.server.log_tail(lines) if self.server else ""

    def describe_logs(self) -> dict[str, str]:
        out = {"trtllm-serve": self.log_tail(80)} if self.server else {}
        if self.consumer is not None and self.consumer.errors:
            out["drain errors"] = "\n".join(self.consumer.errors[-20:])
        return out
