"""SGLang in-process (`sglang`); its subclass in kvconform.adapters.sglang_server speaks the server.

In-process: SGLang's own radix cache, allocators and
disaggregation accounting, driven step by step through drivers/sglang_driver.py. On
CPU the SGLang server cannot start (sgl_kernel ships CUDA builds only), but the code under
test is SGLang's own: RadixCache + (Paged)TokenToKVPoolAllocator + release_kv_cache on the
scheduler's path, kv_to_page_indices and CommonKVSender.get_transfer_metric.

Server mode (`sglang-server`) speaks the HTTP API of `python -m sglang.launch_server`, attached
(`--engine-url`) or launched (environment spec sglang-server unless `--engine-env
sglang-server=<spec>` names another). What it reads (SGLang 0.5.23):

- `POST /generate` with `input_ids` (srt/entrypoints/http_server.py generate_request; request
  schema sglang/api/v1/api_types.py GenerateRequest) answers `{"text", "output_ids",
  "meta_info": {"prompt_tokens", "cached_tokens", "cached_tokens_details"?, ...}}`
  (srt/managers/tokenizer_manager.py _handle_batch_output). `cached_tokens` is always there;
  the OpenAI `/v1/completions` reports `usage.prompt_tokens_details` only with
  `--enable-cache-report` (srt/entrypoints/openai/usage_processor.py), so /generate is used.
  `cached_tokens_details` ({"device", "host"[, "storage"]}) appears when cached_tokens > 0
  (srt/managers/scheduler_components/output_streamer.py get_cached_tokens_details).
  The prefix match stops one token short of the prompt and at a page boundary
  (srt/managers/schedule_batch.py _compute_max_prefix_len): the suite's block oracle.
- `POST /flush_cache[?timeout=S]` answers 200 (text "Cache flushed...") or 400 (text: the
  scheduler's message) when requests are still running or waiting (scheduler.py flush_cache,
  scheduler_components/flush_wrapper.py): retried until RESET_RETRY_S.
- `GET /server_info` (older servers: `/get_server_info`): the resolved server args
  (`page_size`, ...), the scheduler's `max_total_num_tokens`, `version`, and `kv_events`
  (srt/utils/common.py build_server_info, srt/runtime_context.py describe_kv_events_publisher).
- `GET /metrics` with `--enable-metrics` (srt/observability/metrics_collector.py):
  `sglang:prompt_tokens_total{is_streaming}` and `sglang:cached_tokens_total{cache_source}`
  per finished request (TokenizerMetricsCollector.observe_one_finished_request; the cached
  series exists only after the first hit), `sglang:token_usage`, `sglang:cache_hit_rate`,
  `sglang:evicted_tokens_total`.
- KV events with `--kv-events-config '{"publisher":"zmq",...}'`: SGLang's ZmqEventPublisher
  (srt/disaggregation/kv_events.py) sends vLLM's wire format (topic, 8-byte big-endian seq,
  msgpack [ts, [tagged events], dp_rank]) and serves replays on a ROUTER socket, so
  kvconform/zmq_events.py reads it. A concrete-host endpoint makes the publisher connect:
  the suite binds first and misses nothing. Attached, the suite binds no socket: no events.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, ClassVar

import requests

from kvconform import envs
from kvconform.contract import (
    AdapterContext,
    Capability,
    EngineAdapter,
    EngineConfig,
    ModelShape,
    ServedPrompt,
    TransferResult,
)
from kvconform.errors import EngineError, UsageError
from kvconform.events import EventLedger, KvEvent, hash_text
from kvconform.kit.drivers import DriverProcess, engine_side_script
from kvconform.kit.server import LaunchedServer
from kvconform.metrics import MetricSnapshot, snapshot_from_values
from kvconform.processes import TeardownReport, free_port

DRIVERS = Path(__file__).resolve().parent / "drivers"  # run inside the engine's environment

C = Capability
CAPACITY_TOKENS = 4096
STATE_COMPONENT_INDICES = 1

MODEL_ENV = "KVCONFORM_SGLANG_MODEL"  # launch mode: a model path/id instead of the tiny dummy one
SERVER_ENV_SPEC = "sglang-server"
SERVER_PAGE_SIZE = 32  # the page size launch mode starts with (attached: what /server_info says)
SERVER_CAPACITY_TOKENS = 8192  # --max-total-tokens in launch mode: eviction is reachable
SERVER_MODEL_NAME = "tiny"
RESET_RETRY_S = 10.0  # /flush_cache answers 400 while requests are running or waiting
FLUSH_WAIT_S = 2.0  # ?timeout= asks the scheduler to wait this long for idle itself

INPROCESS_CAPABILITIES = frozenset(
    {
        C.PREFIX_CACHE,
        C.RESET_PREFIX_CACHE,
        C.BLOCK_SIZE_CONFIG,
        C.FORCED_EVICTION,
        C.HOST_MEMORY,
        C.KV_EVENTS,
        C.PAGE_INDEX,
        C.TRANSFER_ACCOUNTING,
        C.RELEASE_GUARD,
        C.RADIX_CACHE_MODEL,
    }
)
# What works over HTTP against a server the suite launched (attach mode removes the rest).
SERVER_CAPABILITIES = frozenset(
    {
        C.PREFIX_CACHE,
        C.PREFIX_HIT_COUNTERS,
        C.RESET_PREFIX_CACHE,
        C.BLOCK_SIZE_CONFIG,  # --page-size at launch
        C.RESTART,
        C.FORCED_EVICTION,  # capacity: max_total_num_tokens from /server_info
        C.HOST_MEMORY,
        C.KV_EVENTS,  # launch mode binds the subscriber before the server starts
        C.ABORT_REQUESTS,
    }
)
# Only the in-process driver reaches these engine internals.
INPROCESS_ONLY = frozenset({C.PAGE_INDEX, C.TRANSFER_ACCOUNTING, C.RELEASE_GUARD, C.RADIX_CACHE_MODEL})

SERVER_METRICS: dict[str, str] = {
    "prefix_queries": "sglang:prompt_tokens_total",
    "prefix_hits": "sglang:cached_tokens_total",  # summed over cache_source (device/host/storage)
    "prefix_hits_host": "sglang:cached_tokens_total{cache_source=host}",
    "kv_usage": "sglang:token_usage",
    "cache_hit_rate": "sglang:cache_hit_rate",
    "evicted_tokens": "sglang:evicted_tokens_total",
    "requests": "sglang:num_requests_total",
}


def _int_field(data: Any, key: str, where: str) -> int:
    value = data.get(key) if isinstance(data, dict) else None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{where}.{key} is {value!r}, not an integer")
    return value


class SglangAdapter(EngineAdapter):
    name = "sglang"
    env_spec = "sglang"
    default_block_size = 16  # SGLang's page size in-process (server mode: SERVER_PAGE_SIZE)
    model: ClassVar[ModelShape] = ModelShape(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2)
    capabilities = INPROCESS_CAPABILITIES
    server_mode: ClassVar[bool] = False  # the `sglang-server` adapter speaks the HTTP server
    attach_capabilities_removed = (
        EngineAdapter.attach_capabilities_removed
        | INPROCESS_ONLY
        | {
            C.KV_EVENTS,  # attached, the suite binds no event socket
            C.ABORT_REQUESTS,  # its check judges the event ledger
        }
    )
    transfer_layouts: ClassVar[tuple[str, ...]] = ("mha", "mla", "mla_state")
    transfer_page_sizes: ClassVar[tuple[int, ...]] = (1, 4, 16)

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        if ctx.url is not None and not self.server_mode:
            raise UsageError("engine sglang is in-process: attach to a server with --engine sglang-server")
        self.driver: DriverProcess | None = None
        self.seq = 0
        # server mode
        self.server: LaunchedServer | None = None
        self._server_info: dict[str, Any] | None = None
        self._model_dir: Path | None = None
        self.metric_names = dict(SERVER_METRICS) if self.server_mode else {}
        self.lazy_counters = frozenset(
            {"prefix_queries", "prefix_hits", "prefix_hits_host", "evicted_tokens", "requests"}
        )

    @property
    def version(self) -> str:
        if self.driver is not None:
            return self.driver.version
        return super().version

    def preflight(self) -> None:
        if not self.server_mode:  # before the environment is looked for: name the real mistake
            spec = envs.load_spec(self.ctx.env_name or str(self.env_spec))
            if spec.data.get("adapter_mode") == "server":
                raise UsageError(
                    f"engine sglang: environment {spec.name!r} is a server environment; "
                    "the SGLang server is the engine sglang-server (--engine sglang-server)"
                )
        super().preflight()
        if self.attached:
            self.server_info()  # the page size and version come from here: fail now, not per check

    # ---- lifecycle ----------------------------------------------------------------------
    def ensure(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        if config.offload or config.persistent:
            where = "server mode" if self.server_mode else "in-process"
            raise NotImplementedError(f"SGLang {where} has no offload or persistent tier wired here")
        if self.server_mode:
            super().ensure(config)
            return
        if self.config == config and self.running():
            return
        self.start(config)

    def start(self, config: EngineConfig) -> None:
        if self.server_mode:
            self._start_server(config)
            return
        if self.driver is None or not self.driver.process.alive():
            self.driver = DriverProcess(
                self.name,
                self.env().python,
                DRIVERS / "sglang_driver.py",
                self.ctx.workdir / "logs" / "sglang-driver.log",
            )
        self.new_cache(config.block_size or self.default_block_size)
        self.config = config

    def new_cache(self, page_size: int, capacity_tokens: int = CAPACITY_TOKENS) -> dict[str, Any]:
        """A fresh RadixCache over the model shape; its creation event starts a new ledger."""
        assert self.driver is not None
        allocator = "token" if page_size == 1 else "paged"
        info = self.driver.call(
            "new_cache",
            page_size=page_size,
            capacity_tokens=capacity_tokens,
            allocator=allocator,
            kv_pool="mha",
            head_num=self.model.kv_heads,
            head_dim=self.model.head_dim,
            layer_num=self.model.layers,
            max_requests=64,
        )
        self.ledger = EventLedger()
        self.seq = 0
        self.drain_events()
        return info

    def stop(self) -> list[TeardownReport]:
        reports = []
        if self.driver is not None:
            reports.append(self.driver.close())
            self.driver = None
        if self.server is not None:
            reports.append(self.server.stop())
            self.server = None
        self.close_event_subscriber()
        self.config = None
        return reports

    def running(self) -> bool:
        if self.server_mode:
            if self.attached:
                return self.config is not None
            return self.server is not None and self.server.process.alive()
        return self.driver is not None and self.driver.process.alive()

    def call(self, op: str, **args: Any) -> Any:
        if self.server_mode:
            raise NotImplementedError(f"SGLang op {op!r} needs the in-process driver (--engine sglang)")
        if self.driver is None:
            raise EngineError(self.name, f"op {op!r} before the driver started")
        return self.driver.call(op, **args)

    # ---- server mode: launch ----------------------------------------------------------
    def model_dir(self) -> Path:
        """The tiny Llama-shaped model (config + word-level tokenizer), loaded with dummy weights."""
        if self._model_dir is None:
            out = self.ctx.workdir / "model"
            if not (out / "config.json").exists():
                m = self.model
                subprocess.run(
                    [
                        str(self.env().python),
                        str(engine_side_script("make_tiny_model.py")),
                        str(out),
                        *("--layers", str(m.layers), "--heads", str(m.kv_heads)),
                        *("--kv-heads", str(m.kv_heads), "--head-dim", str(m.head_dim)),
                    ],
                    check=True,
                    capture_output=True,
                    timeout=300,
                )
            self._model_dir = out
        return self._model_dir

    def kv_events_config(self, events: str, replay: str) -> dict[str, Any]:
        """A concrete host (not `*`): SGLang's publisher connects to the suite's bound SUB."""
        return {
            "publisher": "zmq",
            "endpoint": events,
            "bind": False,
            "replay_endpoint": replay,
            "topic": "kv",
        }

    def server_argv(self, config: EngineConfig, port: int, events: str, replay: str) -> list[str]:
        model = os.environ.get(MODEL_ENV)
        model_args = ["--model-path", model] if model else ["--model-path", str(self.model_dir())]
        if not model:
            model_args += ["--load-format", "dummy", "--skip-tokenizer-init"]
        return [
            str(self.env().python),
            "-m",
            "sglang.launch_server",
            *model_args,
            *("--served-model-name", SERVER_MODEL_NAME),
            *("--host", "127.0.0.1", "--port", str(port)),
            "--enable-metrics",
            *("--page-size", str(config.block_size or self.default_block_size)),
            *("--max-total-tokens", str(SERVER_CAPACITY_TOKENS)),
            *("--kv-events-config", json.dumps(self.kv_events_config(events, replay))),
            "--skip-server-warmup",
        ]

    def _start_server(self, config: EngineConfig) -> None:
        if self.attached:
            raise EngineError(self.name, "attached: the suite does not start the server")
        port = free_port()
        events, replay = self.open_event_subscriber()
        self._server_info = None
        self.base_url = f"http://127.0.0.1:{port}"
        env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "0" if os.environ.get(MODEL_ENV) else "1")}
        try:
            self.server = LaunchedServer(
                self.name,
                "sglang-server",
                self.server_argv(config, port, events, replay),
                self.ctx.workdir,
                self.url("/health"),
                env=env,
                timeout_s=self.ctx.start_timeout_s,
                session=self.http,
            )
        except Exception:
            self.close_event_subscriber()
            raise
        self.config = config

    # ---- server mode: what the server says about itself --------------------------------
    def server_info(self) -> dict[str, Any]:
        """GET /server_info (older servers: /get_server_info), kept for the server's life."""
        if self._server_info is None:
            try:
                resp = self.http.get(self.url("/server_info"), timeout=self.ctx.request_timeout_s)
                if resp.status_code == 404:
                    resp = self.http.get(self.url("/get_server_info"), timeout=self.ctx.request_timeout_s)
            except requests.RequestException as exc:
                raise EngineError(self.name, f"GET /server_info failed: {exc}", self.log_tail()) from None
            if resp.status_code != 200:
                what = f"GET /server_info -> HTTP {resp.status_code}: {resp.text[:200]}"
                raise EngineError(self.name, what, self.log_tail())
            info = self._json(resp, "/server_info")
            if not isinstance(info, dict):
                raise EngineError(self.name, f"/server_info returned {type(info).__name__}, not an object")
            try:
                page = _int_field(info, "page_size", "/server_info")
                if page <= 0:
                    raise ValueError(f"/server_info.page_size is {page}")
            except ValueError as exc:
                raise EngineError(self.name, str(exc)) from None
            self._server_info = info
            if self.attached:
                self.default_block_size = page  # the attached server runs at its own page size
        return self._server_info

    def attached_version(self) -> str:
        try:
            return str(self.server_info().get("version") or "unknown (attached)")
        except EngineError:
            return "unknown (attached)"

    def attached_block_size(self) -> int:
        return int(self.server_info()["page_size"])

    def block_size(self) -> int:
        if self.server_mode and self.server is not None:
            return int(self.server_info()["page_size"])  # what the launched server resolved
        return super().block_size()

    # ---- requests -----------------------------------------------------------------------
    def generate_body(self, tokens: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
        return {
            "input_ids": list(tokens),
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
            "stream": stream,
        }

    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        if self.server_mode:
            answer = self.post_json("/generate", self.generate_body(tokens, max_tokens))
            return self.served_from_generate(answer, tokens)
        result = self.call("insert", token_ids=tokens)  # match, lock, allocate, release_kv_cache
        return ServedPrompt(len(tokens), int(result["prefix_len"]), [])

    def served_from_generate(self, data: Any, tokens: list[int]) -> ServedPrompt:
        """One /generate answer -> prompt tokens, cached tokens (by tier when given), output ids."""
        if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
            raise EngineError(self.name, f"/generate answer has no meta_info object: {str(data)[:200]}")
        meta = data["meta_info"]
        try:
            prompt_tokens = _int_field(meta, "prompt_tokens", "meta_info")
            cached = _int_field(meta, "cached_tokens", "meta_info")
        except ValueError as exc:
            raise EngineError(self.name, f"/generate: {exc}") from None
        if prompt_tokens != len(tokens):
            raise EngineError(
                self.name,
                f"/generate counted {prompt_tokens} prompt tokens for {len(tokens)} input_ids: "
                "the block oracles need the ids served as given",
            )
        details = meta.get("cached_tokens_details") or {}
        source = {k: int(v) for k, v in details.items() if isinstance(v, int) and not isinstance(v, bool)}
        output = data.get("output_ids") or []
        return ServedPrompt(prompt_tokens, cached, [int(t) for t in output], source)

    def stream_and_disconnect(self, tokens: list[int], after_chunks: int) -> int:
        if not self.server_mode:
            return super().stream_and_disconnect(tokens, after_chunks)
        try:
            resp = self.http.post(
                self.url("/generate"),
                json=self.generate_body(tokens, 256, stream=True),
                stream=True,
                timeout=self.ctx.request_timeout_s,
            )
        except requests.RequestException as exc:
            raise EngineError(self.name, f"streaming /generate failed: {exc}", self.log_tail()) from None
        if resp.status_code != 200:
            raise EngineError(self.name, f"streaming /generate -> HTTP {resp.status_code}: {resp.text[:200]}")
        received = 0
        for line in resp.iter_lines():
            if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                received += 1
                if received >= after_chunks:
                    break
        resp.close()
        return received

    def metrics(self) -> MetricSnapshot:
        if self.server_mode:
            return self.scrape("/metrics")
        stats = self.call("stats")  # the radix cache's own sizes (no Prometheus in-process)
        return snapshot_from_values({f"sglang_radix_{k}": v for k, v in stats.items()})

    def reset_prefix_cache(self) -> None:
        if not self.server_mode:
            self.call("reset", mode="flush")  # the scheduler's flush_cache order
            return
        deadline = time.monotonic() + RESET_RETRY_S
        while True:
            try:
                resp = self.http.post(
                    self.url(f"/flush_cache?timeout={FLUSH_WAIT_S}"), timeout=self.ctx.request_timeout_s
                )
            except requests.RequestException as exc:
                raise EngineError(self.name, f"POST /flush_cache failed: {exc}", self.log_tail()) from None
            if resp.status_code == 200:
                return
            if resp.status_code != 400:
                what = f"POST /flush_cache -> HTTP {resp.status_code}: {resp.text[:200]}"
                raise EngineError(self.name, what, self.log_tail())
            if time.monotonic() > deadline:  # 400: not flushed (requests still running or waiting)
                said = resp.text.strip()[:200]
                what = f"/flush_cache kept answering 400 for {RESET_RETRY_S:.0f} s: {said!r}"
                raise EngineError(self.name, what, self.log_tail())
            time.sleep(0.2)

    def cache_capacity_tokens(self) -> int:
        if self.server_mode:
            try:
                return _int_field(self.server_info(), "max_total_num_tokens", "/server_info")
            except ValueError as exc:
                raise EngineError(self.name, str(exc)) from None
        return CAPACITY_TOKENS

    def kv_pool_bytes(self) -> int:
        if self.server_mode:
            raise NotImplementedError("SGLang server mode: the pool size is the server's own")
        return CAPACITY_TOKENS * self.model.kv_bytes_per_token()

    def engine_pids(self) -> list[int]:
        if self.server is not None:
            return self.server.pids()
        return self.driver.pids() if self.driver else []

    # ---- events -------------------------------------------------------------------------
    def drain_events(self) -> int:
        """In-process: take SGLang's recorded KV events (no transport, no gaps). Server: wait
        for the publisher thread, then fill gaps from its replay socket."""
        if self.server_mode:
            return super().drain_events()
        events = self.call("take_events", dynamo_format=False)
        batch = []
        for raw in events:
            kind = {"BlockStored": "stored", "BlockRemoved": "removed", "AllBlocksCleared": "cleared"}[
                raw["type"]
            ]
            parent = raw.get("parent_block_hash")
            batch.append(
                KvEvent(
                    self.seq,
                    kind,
                    tuple(hash_text(h) for h in raw.get("block_hashes", [])),
                    hash_text(parent) if parent is not None else None,
                    str(raw.get("medium") or "gpu").lower(),
                    len(raw.get("token_ids") or []),
                )
            )
            self.seq += 1
        self.ledger.extend(batch)
        return 0

    def resident_blocks_reported(self) -> int | None:
        if self.server_mode:
            return None  # no cached-block count over HTTP
        stats = self.call("stats")
        return int(stats["total_size"]) // int(stats["page_size"])

    # ---- radix cache model (RADIX_CACHE_MODEL) ------------------------------------------
    def radix_new(self, page_size: int, capacity_tokens: int) -> dict[str, Any]:
        if self.server_mode:
            raise NotImplementedError("the SGLang radix cache model is in-process only (--engine sglang)")
        if self.driver is None or not self.driver.process.alive():
            self.start(EngineConfig())
        self.config = None  # the next ensure() builds the suite's default cache again
        return self.new_cache(page_size, capacity_tokens)

    def radix(self, op: str, **args: Any) -> Any:
        return self.call(op, **args)

    # ---- transfer -------------------------------------------------------------------------
    def transfer(
        self,
        tokens: list[int],
        layout: str,
        page_size: int,
        destinations: int,
        abort_after_pages: int | None = None,
    ) -> TransferResult:
        """KV indices from a real allocation at `page_size`; bytes from SGLang's own sender
        bookkeeping and get_transfer_metric (the network hand-off is stubbed in the driver)."""
        if abort_after_pages is not None:
            raise NotImplementedError("SGLang in-process has no transfer to abort")
        if self.server_mode:
            raise NotImplementedError("SGLang transfer accounting is in-process only (--engine sglang)")
        previous = self.config or EngineConfig()
        self.new_cache(page_size)
        try:
            kv_indices = self.call("insert", token_ids=tokens)["kv_indices"]
            m = self.model
            pool = {
                "kind": "mha" if layout == "mha" else "mla",
                "page_size": page_size,
                "layer_num": m.layers,
                "head_num": m.kv_heads,
                "head_dim": m.head_dim,
                "kv_lora_rank": m.latent_dim - 64,
                "qk_rope_head_dim": 64,
                "dtype": "bfloat16",
            }
            state = layout == "mla_state"
            result = self.call(
                "transfer_bytes",
                kv_indices=kv_indices,
                page_size=page_size,
                pool=pool,
                state_indices=[[0] * STATE_COMPONENT_INDICES] if state else None,
                state_item_lens=[[m.state_item_bytes] * m.layers] if state else None,
                is_mla=layout != "mha",
                required_dst_info_num=destinations,
            )
        finally:
            self.new_cache(previous.block_size or self.default_block_size)
        return TransferResult(
            kv_indices=kv_indices,
            page_indices=result["page_indices"],
            bytes_sent=int(result["transfer_total_bytes"]),
            bytes_received=None,
            state_indices=STATE_COMPONENT_INDICES if state else 0,
            detail={
                "replica_factor": result["replica_factor"],
                "kv_item_lens_sum": result["kv_item_lens_sum"],
            },
        )

    def release_twice(self, tokens: list[int]) -> dict[str, Any]:
        result = self.call("double_release", token_ids=tokens, checkpoint=False)
        second = result["second"]
        return {
            "second_refused": bool(result["guard_fired"]),
            "free_delta_on_second": int(second["free_delta"]),
            "detail": str(second.get("message") or ""),
        }

    def log_tail(self, lines: int = 40) -> str:
        if self.server is not None:
            return self.server.log_tail(lines)
        return self.driver.log_tail(lines) if self.driver else ""

    def describe_logs(self) -> dict[str, str]:
        if self.server is not None:
            logs = {"sglang server": self.log_tail(80)}
            if self.subscriber is not None and self.subscriber.decode_errors:
                logs["kv event decode errors"] = "\n".join(self.subscriber.decode_errors[-20:])
            return logs
        return {"sglang driver": self.log_tail(80)} if self.driver else {}
