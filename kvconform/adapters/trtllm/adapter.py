"""TensorRT-LLM (GPU runners only): `trtllm-serve` launched by the suite, or attached to.

The adapter is version-aware: it knows which release line it speaks to (1.2.x or 1.3.0rcN)
and reads only names that line serves (`Release` below). The version comes from the built
environment in launch mode (its pinned `tensorrt-llm==` when not built yet) and from
`GET /version` when attached (tensorrt_llm/serve/openai_server.py `version`). Capabilities
whose data a release lacks are unsupported for that version, with the release named
(`unsupported()`).

What the server offers and how this adapter reads it (tensorrt_llm/serve/openai_server.py,
tensorrt_llm/commands/serve.py):

- `GET /metrics` is JSON (only with `enable_iter_perf_stats`, default False): a list of
  iteration stats (`iter`, `gpuMemUsage`, `kvCacheStats{maxNumBlocks, freeNumBlocks,
  usedNumBlocks, tokensPerBlock, allocTotalBlocks, allocNewBlocks, reusedBlocks, missedBlocks,
  cacheHitRate}` in 1.2.1 and 1.3, cpp/tensorrt_llm/executor/jsonSerialization.cpp; 1.3 also
  `kvCacheIterationStats{<window>: {primary*, iter*...}}`, #12413). It is DRAINED on read in
  both (1.2.1 reads the executor's stats queue; 1.3 after #13405 a background loop buffers and
  /metrics returns and clears the buffer): each iteration reaches one reader once. So exactly
  one consumer (a thread of this adapter) reads it, keeps every iteration, and serves copies
  to the suites. Rows are keyed by (attentionDpRank, iter): a row seen twice is dropped, a
  jump in `iter` is counted as a gap (another reader, or the server's bounded buffer overflowed).
- `kvCacheStats.reusedBlocks/missedBlocks` are cumulative BlockManager counters and
  `cacheHitRate` = reused / (reused + missed) over them (0 when reused is 0), a float32
  (cpp/include/tensorrt_llm/batch_manager/kvCacheManager.h, getKvCacheStats). In 1.3 (#12132)
  they exclude the warmup requests; in 1.2.1 they include them.
- `POST /kv_cache_events` drains KV cache events, a list of
  `{event_id, data: {type: created|stored|removed|updated, ...}, window_size[, attention_dp_rank]}`
  (tensorrt_llm/_utils.py KVCacheEventSerializer), only with
  `kv_cache_config.event_buffer_max_size` > 0 (default 0: no events). `event_id` is one
  counter per KV cache event manager, +1 per event from 0; consecutive removals are merged
  into one event; the oldest events are dropped when `event_buffer_max_size` overflows
  (cpp/tensorrt_llm/batch_manager/kvCacheEventManager.cpp).
- `GET /perf_metrics` drains per-request records `{request_id, perf_metrics: {first_iter,
  last_iter, timing_metrics, kv_cache_metrics{num_total_allocated_blocks,
  num_new_allocated_blocks, num_reused_blocks, num_missed_blocks}}}`; the server keeps them
  only when `return_perf_metrics` and `perf_metrics_max_requests` > 0 (Field(default=0),
  tensorrt_llm/llmapi/llm_args.py), else it answers `[]`. Read only when this adapter wrote
  that option (launch mode) or is told the attached server has it.
- `/prometheus/metrics` is mounted only with `return_perf_metrics: true`
  (openai_server.py register_routes -> mount_metrics; tensorrt_llm/metrics/collector.py). 1.2.1
  has five unprefixed request metrics and no KV metric; 1.3.0rc adds `trtllm_kv_cache_*`,
  `trtllm_prompt_tokens_total`, `trtllm_prompt_cached_tokens_total` (see RELEASE_13).
- `/v1/completions` takes a token-id list as `prompt` and answers
  `usage.prompt_tokens_details.cached_tokens` (1.2.x and 1.3, openai_protocol.py).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from kvconform import envs
from kvconform.contract import (
    AdapterContext,
    BlockPoolStats,
    Capability,
    Deployment,
    EngineAdapter,
    EngineConfig,
    EngineTraits,
    KvEvents,
    KvPool,
    MetricMap,
    ServedPrompt,
    apply_launch_profile,
)
from kvconform.errors import EngineError, KvconformError, UsageError
from kvconform.events import EventLedger, KvEvent, hash_text
from kvconform.kit.engine_env import EngineEnv
from kvconform.kit.http_api import HttpApi
from kvconform.kit.server import LaunchedServer
from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport, free_port

C = Capability
DEFAULT_MODEL = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
# trtllm-serve's click command (tensorrt_llm/commands/serve.py `serve`), parsed without running
# it (run inside the TensorRT-LLM environment by envs.check_argv): an unknown option fails with
# its name (click.NoSuchOption).
SERVE_PARSER_CODE = """
def check(argv):
    from tensorrt_llm.commands.serve import serve

    serve.make_context("trtllm-serve", list(argv))
"""
MEDIUM_BY_CACHE_LEVEL = {0: "device", 1: "host"}  # kPrimaryLevel, kSecondaryLevel
HOST_CACHE_BYTES = 2 * 2**30
PERF_METRICS_MAX_REQUESTS = 4096  # > 0, or the server keeps no /perf_metrics records
# Attach mode: the operator says the server's options set perf_metrics_max_requests > 0.
PERF_METRICS_ENV = "KVCONFORM_TRTLLM_PERF_METRICS"


@dataclass(frozen=True)
class Release:
    """What one TensorRT-LLM release line serves: the only names this adapter reads there."""

    line: str  # "1.2" or "1.3"
    # Logical metric -> Prometheus sample name on /prometheus/metrics.
    metric_names: Mapping[str, str]
    # /metrics rows carry kvCacheIterationStats (per-window, per-iteration deltas).
    iteration_kv_stats: bool
    # kvCacheStats.reusedBlocks/missedBlocks count the warmup requests too.
    counters_include_warmup: bool
    # Capability -> why this release cannot back it.
    gaps: Mapping[Capability, str] = field(default_factory=dict)


# 1.2.1: tensorrt_llm/metrics/collector.py (release/1.2 branch) registers exactly five
# unprefixed metrics (request_success_total{finished_reason}, e2e_request_latency_seconds,
# time_to_first_token_seconds, time_per_output_token_seconds, request_queue_time_seconds;
# labels model_name="undefined", engine_type="undefined"): none is a KV-cache metric, so no
# logical metric maps there. kvCacheStats in /metrics: cpp/tensorrt_llm/executor/jsonSerialization.cpp.
RELEASE_12 = Release(
    line="1.2",
    metric_names={},
    iteration_kv_stats=False,
    counters_include_warmup=True,
    gaps={
        C.PREFIX_HIT_COUNTERS: (
            "/prometheus/metrics has no trtllm_prompt_tokens_total or trtllm_prompt_cached_tokens_total "
            "(added in 1.3.0rc, NVIDIA/TensorRT-LLM #12545, #12636); 1.2 exports only five request metrics"
        ),
    },
)

# 1.3.0rcN (rc29 checked; merged to main Feb-Apr 2026), all in tensorrt_llm/metrics/collector.py:
#   trtllm_kv_cache_hit_rate, trtllm_kv_cache_utilization                     #11243
#   trtllm_kv_cache_reused_blocks_total, trtllm_kv_cache_missed_blocks_total  #12132
#   trtllm_kv_cache_onboard_bytes_total, trtllm_kv_cache_offload_bytes_total  #12413
#   trtllm_prompt_tokens_total, trtllm_kv_cache_max_blocks/_free_blocks/_used_blocks,
#   trtllm_gpu_memory_usage_bytes                                            #12545
#   trtllm_prompt_cached_tokens_total                                        #12636
# kvCacheIterationStats in /metrics: cpp/tensorrt_llm/executor/jsonSerialization.cpp (#12413).
RELEASE_13 = Release(
    line="1.3",
    metric_names={
        # per-request token counters, fed from each finished request's metrics
        "prefix_queries": "trtllm_prompt_tokens_total",  # #12545
        "prefix_hits": "trtllm_prompt_cached_tokens_total",  # #12636
        "kv_usage": "trtllm_kv_cache_utilization",  # #11243
        "blocks_total": "trtllm_kv_cache_max_blocks",  # #12545
        "offload_store_bytes": "trtllm_kv_cache_offload_bytes_total",  # #12413
        "offload_load_bytes": "trtllm_kv_cache_onboard_bytes_total",  # #12413
    },
    iteration_kv_stats=True,
    counters_include_warmup=False,  # #12132
)

RELEASES = {"1.2": RELEASE_12, "1.3": RELEASE_13}
# Every logical metric some release maps, and the first line that has it (for error messages).
METRIC_SINCE = {
    logical: (release.line, name)
    for release in reversed(RELEASES.values())
    for logical, name in release.metric_names.items()
}


def release_line(version: str) -> str | None:
    """'1.2.1' -> '1.2'; '1.3.0rc29' (and anything newer) -> '1.3'; None when unparseable or
    older than 1.2 (a release this adapter was not written against)."""
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    if m is None:
        return None
    key = (int(m.group(1)), int(m.group(2)))
    if key < (1, 2):
        return None
    return "1.2" if key == (1, 2) else "1.3"


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
    """kvCacheStats of one iteration row (None when the iteration carries none).

    Fields: cpp/tensorrt_llm/executor/jsonSerialization.cpp KvCacheStats (1.2.1 and 1.3)."""
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


def iteration_pool_stats_of(row: dict[str, Any]) -> list[BlockPoolStats]:
    """kvCacheIterationStats of one 1.3 iteration row: one per-iteration (not cumulative)
    pool per attention window. Fields: cpp/tensorrt_llm/executor/jsonSerialization.cpp
    KvCacheIterationStats (1.3.0rc, NVIDIA/TensorRT-LLM #12413); absent in 1.2.1."""
    windows = row.get("kvCacheIterationStats")
    if not isinstance(windows, dict):
        raise KeyError("kvCacheIterationStats")
    kv = row.get("kvCacheStats") or {}
    tokens_per_block = _int(kv["tokensPerBlock"], "kvCacheStats.tokensPerBlock")
    it = row.get("iter")
    out = []
    for window in sorted(windows, key=lambda w: int(w)):
        w = windows[window]
        out.append(
            BlockPoolStats(
                max_blocks=_int(w["primaryMaxNumBlocks"], "primaryMaxNumBlocks"),
                free_blocks=_int(w["primaryFreeNumBlocks"], "primaryFreeNumBlocks"),
                used_blocks=_int(w["primaryUsedNumBlocks"], "primaryUsedNumBlocks"),
                reused_blocks=_int(w["iterReusedBlocks"], "iterReusedBlocks"),
                missed_blocks=_int(w["iterMissedBlocks"], "iterMissedBlocks"),
                hit_rate=float(w["iterCacheHitRate"]),
                tokens_per_block=tokens_per_block,
                iteration=None if it is None else int(it),
                cumulative=False,
            )
        )
    return out


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
            if a.reads_perf_metrics():
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


class TrtllmAdapter(EngineEnv, HttpApi, EngineAdapter, KvPool, KvEvents):
    name = "trtllm"
    env_spec = "trtllm"
    # TensorRT-LLM's default tokens_per_block; the pool's own (kvCacheStats) is judged against it.
    deployment = Deployment(block_size=32)
    # Every capability some release backs; unsupported() names those the release this
    # instance speaks to cannot back (Release.gaps), besides the attach-mode ones.
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,  # usage.prompt_tokens_details.cached_tokens, 1.2.x and 1.3
            C.PREFIX_HIT_COUNTERS,  # trtllm_prompt_(cached_)tokens_total, 1.3 only
            C.BLOCK_POOL_STATS,  # /metrics kvCacheStats, 1.2.1 and 1.3
            C.KV_EVENTS,  # /kv_cache_events, 1.2.1 and 1.3
            C.RESTART,
            C.HOST_MEMORY,
        }
    )
    poll_interval_s: ClassVar[float] = float(os.environ.get("KVCONFORM_TRTLLM_POLL_S", "0.25"))

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.profile = apply_launch_profile(self)
        self.server: LaunchedServer | None = None
        self.consumer: DrainingConsumer | None = None
        self._served_model: str | None = None
        self._medium_of: dict[str, str] = {}
        self._events_lock = threading.Lock()
        self.event_rows = 0
        self._attached_version: str | None = None
        self._options: dict[str, Any] | None = None  # the options file this adapter wrote

    # ---- identity and release -----------------------------------------------------------
    def attached_version(self) -> str:
        """GET /version -> {"version": tensorrt_llm.__version__} (openai_server.py version).
        Asked once per instance (capability skips ask at collection); a failed probe is kept
        too, until check_reachable() sees the server up."""
        if self._attached_version is None:
            try:
                self._attached_version = str(self.get_json("/version", timeout=5)["version"])
            except (EngineError, KeyError, TypeError):
                self._attached_version = "unknown (attached)"
        return self._attached_version

    def check_reachable(self) -> None:
        super().check_reachable()
        if self._attached_version == "unknown (attached)":
            self._attached_version = None  # ask /version again, now that the server answers

    def target_version(self) -> str:
        """The release this instance speaks to: the attached server's /version, else the built
        environment's version, else the version its spec pins (`tensorrt-llm==X`)."""
        if self.ctx.attached:
            return self.attached_version()
        try:
            return self.env().version
        except UsageError:
            pass
        try:
            spec = envs.load_spec(self.ctx.env_name or self.env_spec or self.name)
        except UsageError:
            return "unknown"
        for step in spec.data.get("steps", []):
            for req in step.get("pip", []):
                m = re.fullmatch(r"tensorrt[-_]llm==(\S+)", str(req).strip())
                if m:
                    return m.group(1)
        return "unknown"

    def release(self) -> Release:
        """The release line of target_version(); an unknown or unsupported version reads as
        1.2, the oldest line this adapter knows (it reads the fewest names)."""
        return RELEASES[release_line(self.target_version()) or "1.2"]

    def release_label(self) -> str:
        version = self.target_version()
        line = release_line(version)
        if line is None:
            return f"TensorRT-LLM {version} (not a known release: read as 1.2)"
        return f"TensorRT-LLM {version}"

    @property  # per instance: the release decides which metrics it exports
    def traits(self) -> EngineTraits:  # type: ignore[override]
        return EngineTraits(metric_map=self.release_metric_map())

    def release_metric_map(self) -> MetricMap:
        """Only names the release exports; one it exports but the scrape lacks is an error
        naming it, never 0 (trtllm has no lazily created counter this adapter reads)."""
        names = self.release().metric_names
        label = self.release_label()
        return MetricMap(
            dict(names),
            unmapped={
                logical: f"{label} exports no {name} (logical {logical!r}; first in TensorRT-LLM {line})"
                for logical, (line, name) in METRIC_SINCE.items()
                if logical not in names
            },
        )

    def unsupported(self) -> dict[Capability, str]:
        """Besides attach mode's: capabilities the class offers that this instance's release
        cannot back, with why (the release named)."""
        label = self.release_label()
        return {
            **super().unsupported(),
            **{cap: f"{label}: {why}" for cap, why in self.release().gaps.items()},
        }

    def reads_perf_metrics(self) -> bool:
        """/perf_metrics has records only when perf_metrics_max_requests > 0 (default 0,
        tensorrt_llm/llmapi/llm_args.py): read it when the options file this adapter wrote
        sets it, or (attached) when the operator says so with KVCONFORM_TRTLLM_PERF_METRICS=1."""
        if self.ctx.attached:
            return os.environ.get(PERF_METRICS_ENV, "") not in ("", "0")
        return bool(self._options and int(self._options.get("perf_metrics_max_requests", 0)) > 0)

    def model_name(self) -> str:
        if self._served_model is None:
            data = self.get_json("/v1/models")
            try:
                self._served_model = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise EngineError(self.name, f"/v1/models lists no model: {str(data)[:200]}") from None
        return self._served_model

    # ---- lifecycle ----------------------------------------------------------------------
    def attach(self) -> None:
        """Drain the server's bounded KV event and iteration-stats buffers from now on (start()
        does the same for a launched server)."""
        self._consumer()

    def _consumer(self) -> DrainingConsumer:
        if self.consumer is None:
            self.consumer = DrainingConsumer(self, self.poll_interval_s)
        return self.consumer

    def llm_api_options(self, config: EngineConfig) -> dict[str, Any]:
        """The --extra_llm_api_options file (YAML; JSON is YAML). Names from
        tensorrt_llm/llmapi/llm_args.py (KvCacheConfig, TorchLlmArgs)."""
        profile = self.profile
        kv: dict[str, Any] = {
            "enable_block_reuse": True,
            "free_gpu_memory_fraction": profile.gpu_memory_fraction or 0.5,
            "event_buffer_max_size": 16384,
        }
        if profile.block_size is not None:
            kv["tokens_per_block"] = profile.block_size
        if profile.kv_cache_bytes is not None:  # KvCacheConfig.max_tokens bounds the pool in tokens
            kv["max_tokens"] = profile.kv_cache_bytes // self.deployment.model.kv_bytes_per_token()
        if config.offload:
            kv["host_cache_size"] = HOST_CACHE_BYTES
        return {
            "enable_iter_perf_stats": True,  # GET /metrics iteration stats (default False)
            "return_perf_metrics": True,  # mounts /prometheus/metrics, keeps per-request metrics
            "perf_metrics_max_requests": PERF_METRICS_MAX_REQUESTS,  # > 0: /perf_metrics keeps records
            "kv_cache_config": kv,
        }

    def server_argv(self, config: EngineConfig, port: int, options_path: Path) -> list[str]:
        return [str(self.env().bin("trtllm-serve")), *self.serve_args(port, options_path)]

    def serve_args(self, port: int, options_path: Path) -> list[str]:
        """The arguments after `trtllm-serve`: the profile's model, parallelism and flags, else
        KVCONFORM_TRTLLM_MODEL (or a small default model)."""
        profile = self.profile
        model = profile.model or os.environ.get("KVCONFORM_TRTLLM_MODEL", DEFAULT_MODEL)
        argv = [
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend",
            "pytorch",
            "--max_seq_len",
            str(profile.max_model_len or 4096),
            "--extra_llm_api_options",
            str(options_path),
        ]
        if profile.tensor_parallel_size > 1:
            argv += ["--tp_size", str(profile.tensor_parallel_size)]
        if profile.tokenizer:
            argv += ["--tokenizer", profile.tokenizer]
        return [*argv, *profile.extra_args]

    def preflight(self) -> None:
        super().preflight()
        if not self.ctx.attached and not self.profile.is_default:
            self.check_command_line()

    def check_command_line(self) -> None:
        """The profile's command line against trtllm-serve's own click parser, in the launch env.
        Its module imports tensorrt_llm, which loads CUDA libraries: there is no CPU env to
        check in, so this runs where the GPU env is built (preflight on a GPU runner)."""
        env = self.env()
        argv = self.serve_args(8000, Path("/placeholder/options.yaml"))
        error = envs.check_argv(env, SERVE_PARSER_CODE, argv, self.profile.env_vars)
        if error:
            raise UsageError(
                f"launch profile {self.profile.name}: trtllm-serve ({env.version}) rejects its "
                f"command line: {error}\n  trtllm-serve {' '.join(argv)}"
            )

    def start(self, config: EngineConfig) -> None:
        if config.persistent:
            raise NotImplementedError("TensorRT-LLM has no persistent prefix tier wired here")
        if config.block_size not in (None, self.deployment.block_size):
            raise NotImplementedError("block size is fixed at the engine default here")
        port = free_port()
        workdir = self.ctx.workdir
        workdir.mkdir(parents=True, exist_ok=True)
        options = workdir / "trtllm-options.yaml"
        self._options = self.llm_api_options(config)
        options.write_text(json.dumps(self._options, indent=1))
        self.base_url = f"http://127.0.0.1:{port}"
        self._reset_instance_state()
        self.server = LaunchedServer(
            self.name,
            "trtllm-serve",
            self.server_argv(config, port, options),
            workdir,
            self.url("/health"),
            env={"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0"), **self.profile.env_vars},
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
        if self.ctx.attached:
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
        if not self.reads_perf_metrics():
            raise NotImplementedError(
                "/perf_metrics keeps records only with perf_metrics_max_requests > 0 (default 0): "
                + (
                    f"set it in the attached server's options and {PERF_METRICS_ENV}=1"
                    if self.ctx.attached
                    else "this instance was not started with it"
                )
            )
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

    def iteration_pool_stats(self) -> list[BlockPoolStats]:
        """1.3 only: every iteration's per-window pool and reuse deltas (kvCacheIterationStats,
        #12413), not cumulative. 1.2.1 has no such field; asking it is NotImplementedError."""
        release = self.release()
        if not release.iteration_kv_stats:
            raise NotImplementedError(
                f"engine {self.name}: {self.release_label()} serves no kvCacheIterationStats "
                "in /metrics (added in 1.3.0rc, NVIDIA/TensorRT-LLM #12413)"
            )
        out = []
        for row in self.iteration_stats():
            try:
                out.extend(iteration_pool_stats_of(row))
            except (KeyError, ValueError, TypeError) as exc:
                what = f"kvCacheIterationStats malformed or absent in iteration {row.get('iter')}: {exc}"
                raise EngineError(self.name, f"{what} ({self.release_label()} serves it)") from None
        return out

    def resolved_block_size(self) -> int | None:
        """The pool's tokensPerBlock from the iteration stats (None before one is seen): judged
        against the size the suite asked for, never taken as it (that made the pool-stats
        check's tokens-per-block measure an identity)."""
        if self.consumer is not None:
            for row in reversed(self.consumer.iterations.rows()):
                kv = row.get("kvCacheStats")
                if isinstance(kv, dict) and kv.get("tokensPerBlock"):
                    return int(kv["tokensPerBlock"])
        return None

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

    def logs(self, lines: int = 80) -> dict[str, str]:
        out = {"trtllm-serve": self.server.log_tail(lines)} if self.server else {}
        if self.consumer is not None and self.consumer.errors:
            out["drain errors"] = "\n".join(self.consumer.errors[-20:])
        return out
