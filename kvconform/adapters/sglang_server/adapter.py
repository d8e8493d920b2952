"""SGLang's HTTP server (`sglang-server`): `python -m sglang.launch_server`, attached
(`--engine-url`) or launched (environment spec sglang-server, the CPU build, unless
`--engine-env sglang-server=<spec>` names another, e.g. sglang-server-cuda on a GPU runner).

What it reads (SGLang 0.5.23):

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
- `POST /flush_cache?timeout=S` answers 200 (text "Cache flushed...") or 400 (text: the
  scheduler's message) when requests are still running or waiting (scheduler.py flush_cache,
  scheduler_components/flush_wrapper.py): retried until RESET_RETRY_S.
- `GET /server_info` (older servers: `/get_server_info`): the resolved server args
  (`page_size`, ...), the scheduler's `max_total_num_tokens`, `version` (srt/utils/common.py
  build_server_info). Attached, the page size and capacity come from here; launched, the
  oracles use what the suite asked for, and a server that resolved another page size is an
  error, not a new oracle.
- `GET /metrics` with `--enable-metrics` (srt/observability/metrics_collector.py):
  `sglang:prompt_tokens_total{is_streaming}` and `sglang:cached_tokens_total{cache_source}`
  per finished request (TokenizerMetricsCollector.observe_one_finished_request; the cached
  series exists only after the first hit), `sglang:token_usage`, `sglang:cache_hit_rate`,
  `sglang:evicted_tokens_total{cache_type,dp_rank,pp_rank,tp_rank}` (RadixCacheMetricsCollector).
- KV events with `--kv-events-config '{"publisher":"zmq",...}'`: SGLang's ZmqEventPublisher
  (srt/disaggregation/kv_events.py) sends vLLM's wire format (topic, 8-byte big-endian seq,
  msgpack [ts, [tagged events], dp_rank]) and serves replays on a ROUTER socket, so
  kvconform/kit/zmq_events.py reads it. The suite binds its SUB on a free loopback port
  before the server starts and passes `"bind": false`, so the publisher connects to it and
  no early event is missed (with `"bind": true` SGLang would bind and the suite connect).
  Attached, the suite binds no socket: no events.

CPU (spec field `cpu_engine = true`): `SGLANG_USE_CPU_ENGINE=1`, `--device cpu
--attention-backend torch_native`, and stand-ins for `sgl_kernel` (drivers/sglang_server_stubs)
and torchvision (kit/engine_side/standins) on PYTHONPATH: SGLang imports the
CPU sgl_kernel at module level, and no CPU build is on the registries. The stand-in raises when
called; its calls are logged and shown with the server log.

Teardown: the process group is stopped and audited by the harness (processes, and /dev/shm
files the tree held: SGLang 0.5.23 never unlinks /dev/shm/sglang_loads_<id>_<digest>.shm,
srt/managers/load_snapshot.py shm_path_for, so the harness removes it and the teardown report
names it as the engine's leftover). Each launch gets its own TMPDIR (SGLang's ipc:// socket
files), removed after stop.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import requests
from packaging.version import InvalidVersion, Version

from kvconform import envs
from kvconform.adapters.sglang.common import MODEL, int_field
from kvconform.contract import (
    AdapterContext,
    CacheReset,
    Capability,
    Deployment,
    EngineAdapter,
    EngineConfig,
    EngineTraits,
    InstanceChurn,
    KvPool,
    MetricMap,
    ReclaimProbe,
    SaltedPrompts,
    SelfChecks,
    ServedPrompt,
    apply_launch_profile,
    log_tail,
    provides,
)
from kvconform.errors import EngineError, UsageError
from kvconform.kit.drivers import TORCHVISION_STANDIN_DIR, engine_side_script, tiny_model_args
from kvconform.kit.engine_env import EngineEnv
from kvconform.kit.event_feed import ZmqEventFeed
from kvconform.kit.http_api import HttpApi
from kvconform.kit.restart_churn import RestartChurn
from kvconform.kit.server import LaunchedServer
from kvconform.memory import MemoryMeasure, gpu_reclaim_measures, nvml
from kvconform.metrics import MetricSnapshot
from kvconform.processes import TeardownReport, free_port

DRIVERS = Path(__file__).resolve().parent / "drivers"
STUB_DIRS = (
    DRIVERS / "sglang_server_stubs",  # sgl_kernel
    TORCHVISION_STANDIN_DIR,
)
STANDIN_CALLS_ENV = "KVCONFORM_SGL_KERNEL_CALLS"  # read by the sgl_kernel stand-in

C = Capability
MODEL_ENV = "KVCONFORM_SGLANG_MODEL"  # launch mode: a model path/id instead of the tiny dummy one
SERVER_PAGE_SIZE = 16  # the page size launch mode starts with (attached: what /server_info says)
SERVER_CAPACITY_TOKENS = 4096  # --max-total-tokens in launch mode: eviction is reachable
MODEL_CONTEXT_TOKENS = 2048  # the tiny model's context (below the pool, as SGLang wants)
SERVER_MODEL_NAME = "tiny"
# SGLang's own server parser (ServerArgs.add_cli_args, as launch_server builds it), run in the
# environment by envs.check_argvs for launch profiles: an unknown flag fails with its name.
SERVER_PARSER_CODE = """
def check(argv):
    import argparse
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    parser.parse_args(argv[2:])  # after `-m sglang.launch_server`
"""
RESET_RETRY_S = 10.0  # /flush_cache answers 400 while requests are running or waiting
FLUSH_WAIT_S = 2.0  # ?timeout= asks the scheduler to wait this long for idle itself
# SGLang's own idle audit (scheduler.py on_idle -> SchedulerInvariantChecker, 0.5.23): available +
# evictable + protected + session-held == total for the token pool, free req slots == total, no
# duplicate or in-use page in the free lists. Strict (SGLang's default) raises in the scheduler and
# kills the server; warn logs the first alarm and every 1000th after (raise_error_or_warn), so the
# check during which it first fired carries it as a measure and the session goes on.
SELF_CHECK_ENV = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0"}
SELF_CHECK_ALARM = re.compile(r"memory leak detected|KV double free|KV page use-after-free|Mem Leak Detected")
SELF_CHECK_SETTLE_S = 0.5  # the scheduler reaches on_idle (and its audit) just after the last response

# What works over HTTP against a server the suite launched (attach mode removes the rest).
SERVER_CAPABILITIES = frozenset(
    {
        C.PREFIX_CACHE,
        C.PREFIX_HIT_COUNTERS,
        C.ANSWERS_FROM_KV,
        C.RESET_PREFIX_CACHE,
        C.BLOCK_SIZE_CONFIG,  # --page-size at launch
        C.RESTART,
        C.FORCED_EVICTION,  # --max-total-tokens at launch
        C.HOST_MEMORY,
        C.KV_EVENTS,  # launch mode binds the subscriber before the server starts
        C.ABORT_REQUESTS,
        C.INSTANCE_CHURN,  # whole-server restarts (RestartChurn)
        C.LONG_SESSION,  # judged by the tokens SGLang's pool says requests hold (/v1/loads)
        C.CACHE_SALT,  # /v1/completions cache_salt (the same field from 0.5.17 on)
    }
)

SERVER_METRICS: dict[str, str] = {
    "prefix_queries": "sglang:prompt_tokens_total",
    "prefix_hits": "sglang:cached_tokens_total",  # summed over cache_source (device/host/storage)
    "prefix_hits_host": "sglang:cached_tokens_total{cache_source=host}",
    "kv_usage": "sglang:token_usage",
    "cache_hit_rate": "sglang:cache_hit_rate",
    "evicted_tokens": "sglang:evicted_tokens_total",
    "requests": "sglang:num_requests_total",
}


class SglangServerAdapter(
    EngineEnv,
    ZmqEventFeed,
    HttpApi,
    EngineAdapter,
    KvPool,
    SaltedPrompts,
    ReclaimProbe,
    SelfChecks,
    CacheReset,
):
    name = "sglang-server"
    env_spec = "sglang-server"
    deployment = Deployment(block_size=SERVER_PAGE_SIZE, model=MODEL)
    capabilities = SERVER_CAPABILITIES
    # TokenizerManager.create_abort_task sleeps 2 s before aborting a disconnected request
    # (sglang/srt/managers/tokenizer_manager.py:2427, 0.5.23). sglang:token_usage is set per
    # batch report; idle, the scheduler republishes it only when the running-requests gauge
    # disagrees with the running batch, else every 30 s (scheduler_components/
    # metrics_reporter.py, _maybe_log_idle_metrics, 0.5.23). A request aborted before its
    # first decode report leaves its prefill-time usage up for that long (measured on a loaded
    # 2-core runner: 0.02 after 10 s idle).
    traits = EngineTraits(
        abort_delay_s=2.0,
        idle_gauge_refresh_s=30.0,
        metric_map=MetricMap(
            names=SERVER_METRICS,
            lazy=frozenset(
                {"prefix_queries", "prefix_hits", "prefix_hits_host", "evicted_tokens", "requests"}
            ),
        ),
    )

    def unsupported(self) -> dict[Capability, str]:
        gaps = super().unsupported()
        if self.ctx.attached:
            gaps[C.KV_EVENTS] = "attached: the suite binds no event socket"
            gaps[C.ABORT_REQUESTS] = "attached: its check judges the KV-event ledger"
        return gaps

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.churn = RestartChurn(self)
        self.server: LaunchedServer | None = None
        self._server_info: dict[str, Any] | None = None
        self._model_dir: Path | None = None
        self._tmpdir: Path | None = None
        self._launches = 0
        self.profile = apply_launch_profile(self)
        self._gpu_before: int | None = None  # NVML device used before the first start (GPU runners)
        self._alarm_offset = 0  # how far self_check_alarms() has read the server log (appended per launch)
        # A release whose CPU build runs at one page size only says so in its spec (`page_size`).
        page = int(self.spec_data().get("page_size", SERVER_PAGE_SIZE))
        self.deployment = replace(self.deployment, block_size=page)

    def preflight(self) -> None:
        super().preflight()
        if self.ctx.attached:
            self.server_info()  # the page size and version come from here: fail now, not per check
        elif not self.profile.is_default:
            self.check_command_line()

    # ---- the environment ------------------------------------------------------------------
    def spec_data(self) -> dict[str, Any]:
        return envs.load_spec(self.ctx.env_name or str(self.env_spec)).data

    def cpu_engine(self) -> bool:
        """The spec says SGLang runs its CPU engine (flags, env and stand-ins follow)."""
        return bool(self.spec_data().get("cpu_engine", False))

    # ---- lifecycle ----------------------------------------------------------------------
    def start(self, config: EngineConfig) -> None:
        if self.ctx.attached:
            raise EngineError(self.name, "attached: the suite does not start the server")
        if config.offload or config.persistent:
            raise NotImplementedError("SGLang server mode has no offload or persistent tier wired here")
        port = free_port()
        events, replay = self.open_event_subscriber()
        self._server_info = None
        self.base_url = f"http://127.0.0.1:{port}"
        self._launches += 1
        # Short and outside the results dir: SGLang binds ipc:// sockets here, and a socket path
        # is capped at 107 bytes (sockaddr_un), which a deep results dir overflows.
        self._tmpdir = Path(tempfile.mkdtemp(prefix=f"kvc-sgl{self._launches}-"))
        if self._gpu_before is None and nvml().available:
            self._gpu_before = nvml().sample([]).device_used  # device-wide, before any server
        try:
            self.server = LaunchedServer(
                self.name,
                "sglang-server",
                self.server_argv(config, port, events, replay),
                self.ctx.workdir,
                self.url("/health"),
                env=self.server_env(self._tmpdir),
                timeout_s=self.ctx.start_timeout_s,
                # The load snapshot SGLang never unlinks: swept even when the server dies before
                # /health, when the tree's held files were never read. Not sem.mp-* (the
                # scheduler's tqdm lock, a named semaphore under spawn): glibc links it from a temp
                # file, so no process maps it by name and a pattern cannot tell it from another
                # engine's live one (a vLLM starting in the other lane lost its worker's lock).
                shm_patterns=("sglang_loads_*",),
                session=self.http,
                # SIGTERM to the server process alone, SGLang's own shutdown: it drains and ends
                # its children itself. To the whole group, the scheduler dies at once and SGLang
                # SIGKILLs the rest, the resource tracker included: its sem.mp-* stays.
                stop_whole_group=False,
            )
            self.server.pids()  # the tree's /dev/shm files, recorded for the teardown audit
            self.server_info()  # the page size and version: fail at start, not in a check
        except Exception:
            self.stop()
            raise
        self.config = config

    def resolved_block_size(self) -> int | None:
        """The page size the launched server resolved (/server_info `page_size`: SGLang's own
        post-processing of the arguments may change the one asked for). Judged by the prefix
        checks against the request, never used as an oracle's block."""
        if self.ctx.attached:
            return None  # attached_block_size() reads the same field
        return int(self.server_info()["page_size"])

    def stop(self) -> list[TeardownReport]:
        reports = []
        if self.server is not None:
            reports.append(self.server.stop())
            self.server = None
        if self._tmpdir is not None:  # SGLang's ipc:// socket files
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None
        self.close_event_subscriber()
        self._server_info = None
        self.config = None
        return reports

    def running(self) -> bool:
        if self.ctx.attached:
            return self.config is not None
        return self.server is not None and self.server.process.alive()

    # ---- launch ---------------------------------------------------------------------------
    def model_dir(self) -> Path:
        """The tiny Llama-shaped model (config, word-level tokenizer, seeded weights)."""
        if self._model_dir is None:
            out = self.ctx.workdir / "model"
            if not (out / "config.json").exists():
                subprocess.run(
                    [
                        str(self.env().python),
                        str(engine_side_script("make_tiny_model.py")),
                        str(out),
                        *tiny_model_args(self.deployment.model),
                    ],
                    check=True,
                    capture_output=True,
                    timeout=300,
                )
                _set_json(out / "config.json", max_position_embeddings=MODEL_CONTEXT_TOKENS)
                _set_json(out / "tokenizer_config.json", model_max_length=MODEL_CONTEXT_TOKENS)
            self._model_dir = out
        return self._model_dir

    def kv_events_config(self, events: str, replay: str) -> dict[str, Any]:
        """The suite's bound SUB: SGLang's publisher connects to it (`bind` false)."""
        return {
            "publisher": "zmq",
            "endpoint": events,
            "bind": False,
            "replay_endpoint": replay,
            "topic": "kv",
        }

    def server_argv(self, config: EngineConfig, port: int, events: str, replay: str) -> list[str]:
        p = self.profile
        model = p.model or os.environ.get(MODEL_ENV)
        model_args = ["--model-path", model] if model else ["--model-path", str(self.model_dir())]
        if p.load_format:
            model_args += ["--load-format", p.load_format]
        for flag, value in (("--tokenizer-path", p.tokenizer), ("--dtype", p.dtype)):
            model_args += [flag, str(value)] if value is not None else []
        model_args += ["--context-length", str(p.max_model_len)] if p.max_model_len else []
        model_args += ["--mem-fraction-static", str(p.gpu_memory_fraction)] if p.gpu_memory_fraction else []
        cpu = ["--device", "cpu", "--attention-backend", "torch_native"] if self.cpu_engine() else []
        return [
            str(self.env().python),
            "-m",
            "sglang.launch_server",
            *model_args,
            *cpu,
            *("--served-model-name", p.served_model_name or SERVER_MODEL_NAME),
            *("--host", "127.0.0.1", "--port", str(port)),
            "--enable-metrics",
            "--enable-cache-report",  # usage.prompt_tokens_details on /v1/completions (serve_salted)
            *("--page-size", str(config.block_size or self.deployment.block_size)),
            *self.pool_args(),
            *("--kv-events-config", json.dumps(self.kv_events_config(events, replay))),
            "--skip-server-warmup",
            *("--tp", str(p.tensor_parallel_size)),
            *p.extra_args,
        ]

    def pool_args(self) -> list[str]:
        """--max-total-tokens: the default's small pool, a profile's KV bytes in tokens, or none
        (a GPU memory fraction lets SGLang size it)."""
        p = self.profile
        if p.is_default and p.gpu_memory_fraction is None:
            return ["--max-total-tokens", str(SERVER_CAPACITY_TOKENS)]
        if p.kv_cache_bytes is not None:
            return ["--max-total-tokens", str(p.kv_cache_bytes // self.deployment.model.kv_bytes_per_token())]
        return []

    def check_command_line(self) -> None:
        """A profile's command line against SGLang's own parser (launch env, else the CPU env
        of the same release); an unknown flag fails with its name."""
        try:
            env = self.env()
        except UsageError:
            env = envs.find(envs.load_spec(self.ctx.env_name or str(self.env_spec)).parser_env)
        saved, self._environment = self._environment, env  # the argv names this interpreter; restored below
        try:
            argv = self.server_argv(EngineConfig(), 30000, "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")[1:]
        finally:
            self._environment = saved
        extra = {"PYTHONPATH": os.pathsep.join(str(d) for d in STUB_DIRS)} if not env.spec.gpu else {}
        error = envs.check_argv(
            env, SERVER_PARSER_CODE, argv, {**extra, "SGLANG_USE_CPU_ENGINE": "1"} if extra else {}
        )
        if error:
            raise UsageError(
                f"launch profile {self.profile.name}: SGLang ({env.version}) rejects it: {error}"
            )

    def server_env(self, tmpdir: Path) -> dict[str, str]:
        offline = os.environ.get("HF_HUB_OFFLINE", "0" if os.environ.get(MODEL_ENV) else "1")
        env = {"HF_HUB_OFFLINE": offline, "TMPDIR": str(tmpdir), **SELF_CHECK_ENV}
        if self.cpu_engine():
            env["SGLANG_USE_CPU_ENGINE"] = "1"
            env["PYTHONPATH"] = os.pathsep.join(str(d) for d in STUB_DIRS)
            env[STANDIN_CALLS_ENV] = str(self.standin_calls_path())
        return env

    def standin_calls_path(self) -> Path:
        return self.ctx.workdir / "logs" / "sgl_kernel-standin-calls.log"

    # ---- what the server says about itself ------------------------------------------------
    def server_info(self) -> dict[str, Any]:
        """GET /server_info (older servers: /get_server_info), kept for the server's life."""
        if self._server_info is None:
            try:
                resp = self.http.get(self.url("/server_info"), timeout=self.ctx.request_timeout_s)
                if resp.status_code == 404:
                    resp = self.http.get(self.url("/get_server_info"), timeout=self.ctx.request_timeout_s)
            except requests.RequestException as exc:
                raise EngineError(self.name, f"GET /server_info failed: {exc}", log_tail(self)) from None
            if resp.status_code != 200:
                what = f"GET /server_info -> HTTP {resp.status_code}: {resp.text[:200]}"
                raise EngineError(self.name, what, log_tail(self))
            info = self._json(resp, "/server_info")
            if not isinstance(info, dict):
                raise EngineError(self.name, f"/server_info returned {type(info).__name__}, not an object")
            try:
                page = int_field(info, "page_size", "/server_info")
                if page <= 0:
                    raise ValueError(f"/server_info.page_size is {page}")
            except ValueError as exc:
                raise EngineError(self.name, str(exc)) from None
            self._server_info = info
            if self.ctx.attached:
                # the attached server runs at its own page size
                self.deployment = replace(self.deployment, block_size=page)
        return self._server_info

    def attached_version(self) -> str:
        try:
            return str(self.server_info().get("version") or "unknown (attached)")
        except EngineError:
            return "unknown (attached)"

    def attached_block_size(self) -> int:
        return int(self.server_info()["page_size"])

    def cache_capacity_tokens(self) -> int:
        if not self.ctx.attached:
            return SERVER_CAPACITY_TOKENS  # what the suite asked for (--max-total-tokens)
        try:
            return int_field(self.server_info(), "max_total_num_tokens", "/server_info")
        except ValueError as exc:
            raise EngineError(self.name, str(exc)) from None

    def kv_pool_bytes(self) -> int:
        """The pool the suite asked for (--max-total-tokens) in bytes; else the server's own."""
        asked = self.pool_args()
        tokens = int(asked[1]) if asked else self.pool_counts("max_total_num_tokens")[0]
        return tokens * self.deployment.model.kv_bytes_per_token()

    def pool_counts(self, *keys: str) -> list[int]:
        """Integers of one /v1/loads answer; a missing or non-integer field is the engine's error."""
        load = self.pool_load()
        try:
            return [int_field(load, key, "/v1/loads") for key in keys]
        except ValueError as exc:
            raise EngineError(self.name, str(exc), log_tail(self)) from None

    def pool_load(self) -> dict[str, Any]:
        """GET /v1/loads: the scheduler's pool counts, computed when asked (not the lazy gauge)."""
        loads = self.get_json("/v1/loads?include=core,memory", timeout=self.ctx.request_timeout_s).get(
            "loads"
        )
        if not loads:
            raise EngineError(self.name, f"/v1/loads has no loads: {loads!r}", log_tail(self))
        return dict(loads[0])

    def requests_in_flight(self) -> int | None:
        """Running plus waiting requests by the scheduler's live count (/v1/loads)."""
        return sum(self.pool_counts("num_running_reqs", "num_waiting_reqs"))

    def kv_tokens_held_bytes(self) -> int:
        """The tokens requests hold in SGLang's pool now, by its own count (/v1/loads
        num_used_tokens = total - available - evictable, pool_stats_observer._get_token_info),
        in bytes: 0 at idle, whatever the radix cache keeps (that is evictable)."""
        time.sleep(SELF_CHECK_SETTLE_S)  # the finishing step frees the request's KV just after the response
        return self.pool_counts("num_used_tokens")[0] * self.deployment.model.kv_bytes_per_token()

    # ---- requests -----------------------------------------------------------------------
    def generate_body(self, tokens: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
        return {
            "input_ids": list(tokens),
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True},
            "stream": stream,
        }

    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        answer = self.post_json("/generate", self.generate_body(tokens, max_tokens))
        return self.served_from_generate(answer, tokens)

    def salted_answers(self) -> bool:
        """/v1/completions returns the answer's token ids on `return_token_ids` in the pinned
        0.5.23 (protocol.py CompletionRequest; sgl-project/sglang#30917): not assumed of the
        older releases the history runs, nor of an attached server."""
        try:
            return Version(self.version) >= Version("0.5.23")
        except InvalidVersion:
            return False

    def serve_salted(self, tokens: list[int], salt: str, max_tokens: int = 1) -> ServedPrompt:
        """The OpenAI completions field `cache_salt`: the one salt field every release from
        0.5.17 has (protocol.py CompletionRequest; /generate takes `cache_salt` only from
        0.5.18, `extra_key` before). Cached tokens come from usage.prompt_tokens_details,
        which the server reports with --enable-cache-report."""
        model = self.profile.served_model_name or SERVER_MODEL_NAME
        body = {**self.completion_body(tokens, max_tokens), "model": model, "cache_salt": salt}
        if self.salted_answers():
            body["return_token_ids"] = True
        data = self.post_json("/v1/completions", body)
        usage = data.get("usage") if isinstance(data, dict) else None
        if (
            isinstance(usage, dict)
            and "prompt_tokens" in usage
            and usage.get("prompt_tokens_details") is None
        ):
            # With --enable-cache-report, releases such as 0.5.17 leave the details out when
            # nothing was cached (usage_processor.py:13-15 _details_if_cached: count > 0 only).
            usage["prompt_tokens_details"] = {"cached_tokens": 0}
        return self.served_from_openai(data, tokens)

    def served_from_generate(self, data: Any, tokens: list[int]) -> ServedPrompt:
        """One /generate answer -> prompt tokens, cached tokens (by tier when given), output ids."""
        if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
            raise EngineError(self.name, f"/generate answer has no meta_info object: {str(data)[:200]}")
        meta = data["meta_info"]
        try:
            prompt_tokens = int_field(meta, "prompt_tokens", "meta_info")
            cached = int_field(meta, "cached_tokens", "meta_info")
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

    def open_stream(self, tokens: list[int], max_tokens: int) -> requests.Response:
        try:
            resp = self.http.post(
                self.url("/generate"),
                json=self.generate_body(tokens, max_tokens, stream=True),
                stream=True,
                timeout=self.ctx.request_timeout_s,
            )
        except requests.RequestException as exc:
            raise EngineError(self.name, f"streaming /generate failed: {exc}", log_tail(self)) from None
        if resp.status_code != 200:
            said = resp.text[:200]
            resp.close()
            raise EngineError(self.name, f"streaming /generate -> HTTP {resp.status_code}: {said}")
        return resp

    def metrics(self) -> MetricSnapshot:
        return self.scrape("/metrics")

    def reset_prefix_cache(self) -> None:
        deadline = time.monotonic() + RESET_RETRY_S
        while True:
            try:
                resp = self.http.post(
                    self.url(f"/flush_cache?timeout={FLUSH_WAIT_S}"), timeout=self.ctx.request_timeout_s
                )
            except requests.RequestException as exc:
                raise EngineError(self.name, f"POST /flush_cache failed: {exc}", log_tail(self)) from None
            if resp.status_code == 200:
                return
            if resp.status_code != 400:
                what = f"POST /flush_cache -> HTTP {resp.status_code}: {resp.text[:200]}"
                raise EngineError(self.name, what, log_tail(self))
            if time.monotonic() > deadline:  # 400: not flushed (requests still running or waiting)
                said = resp.text.strip()[:200]
                what = f"/flush_cache kept answering 400 for {RESET_RETRY_S:.0f} s: {said!r}"
                raise EngineError(self.name, what, log_tail(self))
            time.sleep(0.2)

    def engine_pids(self) -> list[int]:
        return self.server.pids() if self.server is not None else []

    @provides(InstanceChurn)
    def instance_churn(self) -> InstanceChurn:
        return self.churn

    def reclaim_probe(self, path: str | None = None) -> dict[str, MemoryMeasure]:
        """What the restarted servers left (processes, /dev/shm bytes: RestartChurn); while one
        runs, the KV its requests hold by SGLang's own count (exact). On GPU runners, NVML:
        per-process GPU memory of the server's tree (exact; 0 bytes from a running CUDA build is
        an error) and device-wide used memory against the one before the first start
        (UNVERIFIED on a GPU: NVML mocked in tests/harness/test_gpu_specs.py)."""
        measures = {} if self.ctx.attached else self.churn.leftover_measures()
        if self.running():
            measures["kv_tokens_held_bytes"] = MemoryMeasure(self.kv_tokens_held_bytes(), True)
        holds_cuda = self.running() and not self.ctx.attached and self.env().spec.gpu
        measures.update(
            gpu_reclaim_measures(nvml(), self.engine_pids(), holds_cuda, self._gpu_before, self.name)
        )
        return measures

    # ---- logs -----------------------------------------------------------------------------
    def self_check_alarms(self, *, settle: bool = True) -> list[str] | None:
        """SGLang's idle audit's alarm lines in the server log since the last call ([] while no
        server runs; None attached: the suite does not read that server's log)."""
        if self.ctx.attached:
            return None
        if self.server is None:
            return []
        if settle:
            time.sleep(SELF_CHECK_SETTLE_S)
        with open(self.server.process.log_path, "rb") as log:
            log.seek(self._alarm_offset)
            text = log.read().decode("utf-8", "replace")
            self._alarm_offset = log.tell()
        return [line for line in text.splitlines() if SELF_CHECK_ALARM.search(line)]

    def logs(self, lines: int = 80) -> dict[str, str]:
        logs = {"sglang server": self.server.log_tail(lines)} if self.server is not None else {}
        if self.subscriber is not None and self.subscriber.decode_errors:
            logs["kv event decode errors"] = "\n".join(self.subscriber.decode_errors[-20:])
        with_calls = self.standin_calls_path()
        if with_calls.exists() and with_calls.stat().st_size:
            logs["sgl_kernel stand-in calls"] = with_calls.read_text()[-4000:]
        return logs


def _set_json(path: Path, **fields: Any) -> None:
    data = json.loads(path.read_text())
    data.update(fields)
    path.write_text(json.dumps(data, indent=1))
