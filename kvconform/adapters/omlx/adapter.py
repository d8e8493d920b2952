"""oMLX: a real `omlx serve`, launched here on Linux CPU (MLX's CPU backend) from the `omlx`
environment, or attached to (`--engine-url`) on a Mac.

Launch mode runs oMLX code as distributed by flyto-mlx 0.7.0 (a fork of jundot/omlx; see
envs/omlx.toml): the adapter's version reads "flyto-mlx 0.7.0", so findings name the
distribution measured. Attached, the version is the server's own ("omlx 0.7.1").

Endpoints and fields as in the oMLX source (omlx/server.py, omlx/admin/routes.py):

- `GET /health`; `GET /api/status` (Bearer API key) -> total_prompt_tokens,
  total_cached_tokens, model_memory_used, version... from the *session* metrics.
- Admin router under /admin, session cookie `omlx_admin_session` from
  `POST /admin/api/login {"api_key": ...}`. Without an API key on the server, login answers
  400 and the admin routes 401 (unless its settings skip verification), so launch mode
  always starts the server with a freshly generated key and logs in. The key is never
  logged or recorded; oMLX itself writes it into <base>/settings.json, which this adapter
  redacts once the server has read it and again after it stopped.
  `GET /admin/api/stats?scope=session` (snapshot + runtime_cache), `POST
  /admin/api/ssd-cache/clear`, `POST /admin/api/hot-cache/clear` (newer builds only; older
  ones answer 404), `POST /admin/api/cache/probe`.
- omlx/server_metrics.py: session counters restart with each server life; all-time ones
  persist across restarts. Only scope=session is read.
- `/v1/completions` takes a string prompt and reports
  usage.prompt_tokens_details.cached_tokens (builds before oMLX #922: usage.cached_tokens).
- The paged SSD tier keeps `<ssd dir>/<0-f>/<hash>.safetensors`, one file per 256-token
  block (SchedulerConfig.paged_cache_block_size, fixed: the server has no option for it), and
  survives restarts (SIGTERM flushes pending writes). The in-memory paged cache holds block
  metadata only; KV of finished requests lives on SSD (plus the hot cache, off here).

Token ids travel as words "w<id>": exact block accounting needs a word-level tokenizer (the
tiny model written by drivers/make_tiny_mlx_model.py); the adapter refuses to report numbers
when the engine counts another number of prompt tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import requests

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
    ModelShape,
    PersistentTier,
    ReclaimProbe,
    ReleaseGuard,
    ReleaseTwice,
    SecondRelease,
    ServedPrompt,
    ensure,
    log_tail,
    provides,
)
from kvconform.envs import BuiltEnv
from kvconform.errors import EngineError, UsageError
from kvconform.kit.drivers import DriverProcess
from kvconform.kit.engine_env import EngineEnv
from kvconform.kit.http_api import HttpApi
from kvconform.kit.persistent_tiers import FileTier
from kvconform.kit.server import LaunchedServer
from kvconform.memory import MemoryMeasure, sample_processes, threads_measure
from kvconform.metrics import MetricSnapshot, snapshot_from_values
from kvconform.oracles import LastToken
from kvconform.processes import TeardownReport, free_port

DRIVERS = Path(__file__).resolve().parent / "drivers"  # run inside the engine's environment

C = Capability
WORD = re.compile(r"w(\d+)")
ADMIN = "/admin/api"
SESSION_COOKIE = "omlx_admin_session"
STATS_SCOPE = "session"  # never "alltime": all-time counters persist across restarts
MODEL_NAME = "tiny"  # the model folder's name is oMLX's model id
BLOCK_SIZE = 256  # omlx SchedulerConfig.paged_cache_block_size; no server option sets it
# The SSD tier's size, as launched: 64 blocks of the tiny model (128 KiB each), so a few dozen
# prompts fill it and LRU eviction is driven (FORCED_EVICTION).
SSD_CACHE_BYTES = 8 * 2**20
HOT_CACHE_BYTES = 0  # the in-memory copy of SSD blocks: off, so blocks reach disk at once
SNAPSHOT_KEYS = (
    "total_prompt_tokens",
    "total_cached_tokens",
    "total_completion_tokens",
    "total_requests",
    "cache_efficiency",
    "total_tokens_served",
)
RUNTIME_CACHE_KEYS = (
    "total_num_files",
    "total_size_bytes",
    "disk_max_bytes",
    "hot_cache_size_bytes",
    "hot_cache_max_bytes",
    "hot_cache_entries",
)
UNLOAD = "unload"  # POST /admin/api/models/{id}/unload (omlx/admin/routes.py:1918)
SECRET_SETTINGS = ("api_key", "secret_key")  # in settings.json "auth"; redacted on disk


def words(tokens: list[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


def token_ids(text: str) -> list[int]:
    return [int(m.group(1)) for m in WORD.finditer(text or "")]


class OmlxAdapter(EngineEnv, HttpApi, EngineAdapter, KvPool, ReclaimProbe, CacheReset, ReleaseGuard):
    name = "omlx"
    env_spec = "omlx"  # flyto-mlx 0.7.0 on Linux CPU; on a Mac, `omlx` on PATH does too
    deployment = Deployment(
        block_size=BLOCK_SIZE, model=ModelShape(layers=2, kv_heads=2, head_dim=32, dtype_bytes=2)
    )
    # An exact block-aligned hit is served from N-1 tokens: oMLX trims the reconstructed cache
    # by one token to compute the last (omlx/scheduler.py, _trim_prompt_cache_for_generation),
    # where a block-granular cache drops the whole last block.
    traits = EngineTraits(
        recomputes_last_token=LastToken.TOKEN,
        metric_map=MetricMap(
            names={
                "prefix_queries": "omlx_total_prompt_tokens",
                "prefix_hits": "omlx_total_cached_tokens",
                "disk_usage_bytes": "omlx_runtime_cache_total_size_bytes",
            },
        ),
    )
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.PREFIX_HIT_COUNTERS,
            C.ANSWERS_FROM_KV,
            C.RESET_PREFIX_CACHE,
            C.RESTART,
            C.PERSISTENT_PREFIX,
            C.CORRUPT_PERSISTED,
            C.FORCED_EVICTION,
            C.HOST_MEMORY,
            C.LONG_SESSION,
            C.INSTANCE_CHURN,
            C.INSTANCE_REGISTRY,
            C.ABORT_REQUESTS,  # judged by its live request count; oMLX has no KV events or usage gauge
            C.RELEASE_GUARD,
        }
    )
    releases_cached_prefix = True  # a running request's own KV lives in the batch generator

    # oMLX's instance is a model its engine pool loads and unloads (admin API): the suite's
    # "unregister" path, an instance released from an engine that keeps running.
    def unsupported(self) -> dict[Capability, str]:
        gaps = super().unsupported()
        if self.ctx.attached:
            ssd = "attached: the SSD tier's size is not the suite's to know"
            models = "attached: the models are a team's own; the suite never unloads them"
            gaps |= {C.FORCED_EVICTION: ssd, C.INSTANCE_CHURN: models, C.INSTANCE_REGISTRY: models}
            gaps[C.RELEASE_GUARD] = "attached: the release is driven in an engine the suite builds"
        return gaps

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.server: LaunchedServer | None = None
        key = os.environ.get("KVCONFORM_OMLX_API_KEY", "")
        # Launched, the server gets a key of its own (its admin API needs one).
        self.api_key = key if key or self.ctx.attached else "kvc-" + secrets.token_urlsafe(24)
        self._model: str | None = os.environ.get("KVCONFORM_OMLX_MODEL") or None
        self._attached_block: int | None = None
        self._admin_cookie: str | None = None
        self._model_dir: Path | None = None
        self._served_version: str | None = None
        self._stored_prefixes: set[int] = set()  # hashes of full-block prefixes served

    def __repr__(self) -> str:  # never show the key
        return f"<OmlxAdapter {'attached ' + str(self.ctx.url) if self.ctx.attached else 'launched'}>"

    def _headers(self) -> dict[str, str]:
        """Sent on every request (HTTP sessions may be per thread, so nothing lives in one)."""
        headers = {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if self._admin_cookie:
            headers["Cookie"] = f"{SESSION_COOKIE}={self._admin_cookie}"
        return headers

    def _request(
        self, method: str, path: str, timeout: float | None = None, base: str | None = None, **kw: Any
    ) -> requests.Response:
        kw["headers"] = {**self._headers(), **(kw.get("headers") or {})}
        return super()._request(method, path, timeout=timeout, base=base, **kw)

    # ---- identity -----------------------------------------------------------------------
    def _built_env(self) -> BuiltEnv | None:
        try:
            return self.env()
        except UsageError:
            return None

    @property
    def version(self) -> str:
        if self.ctx.attached:
            return self.attached_version()
        env = self._built_env()
        if env is not None:
            return env.version  # "flyto-mlx 0.7.0": the distribution of the oMLX code
        return self._served_version or "not started"

    def attached_version(self) -> str:
        try:
            return f"omlx {self.get_json('/api/status', timeout=5).get('version', 'unknown')}"
        except (EngineError, AttributeError):
            return "unknown (attached)"

    def preflight(self) -> None:
        if self.ctx.attached:
            self.check_reachable()
        elif self._built_env() is None and shutil.which("omlx") is None:
            raise UsageError(
                "engine omlx: the omlx environment is not built (kvconform env build omlx) and "
                "`omlx` is not on PATH; or start `omlx serve` on a Mac and attach with --engine-url"
            )

    def model_name(self) -> str:
        if self._model is None:
            data = self.get_json("/v1/models")
            try:
                self._model = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise EngineError(self.name, f"/v1/models lists no model: {str(data)[:200]}") from None
        return self._model

    # ---- lifecycle (launch mode) --------------------------------------------------------
    def base_dir(self) -> Path:
        """oMLX's --base-path (settings, logs, caches): always in the work dir, never ~/.omlx."""
        return self.ctx.workdir / "base"

    def ssd_dir(self) -> Path:
        # oMLX's own default place for the SSD tier under the base path: the admin clear's
        # fallback (files of models not loaded) and the runtime_cache report point there too.
        return self.base_dir() / "cache"

    def omlx_program(self) -> str:
        env = self._built_env()
        if env is not None:
            return str(env.bin("omlx"))
        found = shutil.which("omlx")
        if found is None:
            raise UsageError("engine omlx: build the omlx environment (kvconform env build omlx)")
        return found

    def model_dir(self) -> Path:
        """A folder of model folders (--model-dir): $KVCONFORM_OMLX_MODEL_DIR, else the tiny
        random-weight MLX model, written once per work dir with the environment's python."""
        if self._model_dir is None:
            given = os.environ.get("KVCONFORM_OMLX_MODEL_DIR")
            if given:
                self._model_dir = Path(given)
                return self._model_dir
            env = self._built_env()
            if env is None:
                raise UsageError(
                    "engine omlx: `omlx` on PATH needs KVCONFORM_OMLX_MODEL_DIR (a folder of model "
                    "folders with a word-level tokenizer), or build the env: kvconform env build omlx"
                )
            root = self.ctx.workdir / "models"
            out = root / MODEL_NAME
            if not (out / "model.safetensors").exists():
                argv = [
                    str(env.python),
                    str(DRIVERS / "make_tiny_mlx_model.py"),
                    str(out),
                    *("--layers", str(self.deployment.model.layers)),
                    *("--heads", str(self.deployment.model.kv_heads)),
                    *("--kv-heads", str(self.deployment.model.kv_heads)),
                    *("--head-dim", str(self.deployment.model.head_dim)),
                ]
                done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
                if done.returncode != 0:
                    raise EngineError(self.name, "writing the tiny MLX model failed", done.stderr[-2000:])
            self._model = MODEL_NAME
            self._model_dir = root
        return self._model_dir

    def server_argv(self, port: int) -> list[str]:
        return [
            self.omlx_program(),
            "serve",
            *("--model-dir", str(self.model_dir())),
            *("--host", "127.0.0.1"),
            *("--port", str(port)),
            *("--base-path", str(self.base_dir())),
            *("--paged-ssd-cache-dir", str(self.ssd_dir())),
            *("--paged-ssd-cache-max-size", str(SSD_CACHE_BYTES)),
            *("--hot-cache-max-size", str(HOT_CACHE_BYTES)),
            *("--api-key", self.api_key),
        ]

    def start(self, config: EngineConfig) -> None:
        if config.offload or config.disaggregated:
            raise NotImplementedError("oMLX has no host offload tier or disaggregated serving")
        if config.block_size not in (None, BLOCK_SIZE):
            raise NotImplementedError(f"oMLX runs at its fixed block size {BLOCK_SIZE}")
        if not config.persistent and self.ssd_dir().exists():
            shutil.rmtree(self.ssd_dir())  # a fresh server life starts with an empty tier
        if not config.persistent:
            self._stored_prefixes.clear()
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self._admin_cookie = None
        argv = self.server_argv(port)
        try:
            self.server = LaunchedServer(
                self.name,
                "omlx-serve",
                argv,
                self.ctx.workdir,
                self.url("/health"),
                env={"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"},
                timeout_s=self.ctx.start_timeout_s,
                session=self.http,
            )
        finally:
            self.redact_settings()
        self.config = config
        self.login()
        with contextlib.suppress(EngineError):
            self._served_version = f"omlx {self.get_json('/api/status', timeout=5).get('version')}"

    def stop(self) -> list[TeardownReport]:
        reports = []
        if self.server is not None:
            reports.append(self.server.stop())
            self.server = None
            self.redact_settings()
        self._admin_cookie = None
        self.config = None
        return reports

    def running(self) -> bool:
        return self.server is not None and self.server.process.alive()

    def redact_settings(self) -> None:
        """oMLX writes its API key (and cookie secret) into <base>/settings.json; the work dir
        is kept with the results, so the secrets are blanked once the server has read them."""
        path = self.base_dir() / "settings.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        auth = data.get("auth") if isinstance(data, dict) else None
        if isinstance(auth, dict) and any(auth.get(k) for k in SECRET_SETTINGS):
            for key in SECRET_SETTINGS:
                auth.pop(key, None)
            path.write_text(json.dumps(data, indent=2))

    # ---- admin API ----------------------------------------------------------------------
    def _admin(self, method: str, path: str, body: Any = None) -> Any:
        """An admin call; logs in with the API key on the first 401."""
        for attempt in range(2):
            resp = self._admin_request(method, path, body)
            if resp.status_code == 401 and attempt == 0 and self.api_key:
                self.login()
                continue
            if resp.status_code == 401:
                raise EngineError(
                    self.name,
                    f"{method} {ADMIN}{path} -> HTTP 401: the admin API needs a session; "
                    "set KVCONFORM_OMLX_API_KEY to the server's API key",
                )
            if resp.status_code >= 400:
                what = f"{method} {ADMIN}{path} -> HTTP {resp.status_code}: {resp.text[:300]}"
                raise EngineError(self.name, what)
            return self._json(resp, ADMIN + path)
        raise AssertionError("unreachable")

    def _admin_request(self, method: str, path: str, body: Any = None) -> requests.Response:
        try:
            return self.http.request(
                method,
                self.url(ADMIN + path),
                json=body,
                headers=self._headers(),
                timeout=self.ctx.request_timeout_s,
            )
        except requests.RequestException as exc:
            raise EngineError(self.name, f"{method} {ADMIN}{path} failed: {exc}", log_tail(self)) from None

    def login(self) -> None:
        try:
            resp = self.http.post(
                self.url(ADMIN + "/login"),
                json={"api_key": self.api_key, "remember": False},
                timeout=self.ctx.request_timeout_s,
            )
        except requests.RequestException as exc:
            raise EngineError(self.name, f"POST {ADMIN}/login failed: {exc}", log_tail(self)) from None
        if resp.status_code == 400:
            raise EngineError(
                self.name,
                f"POST {ADMIN}/login -> HTTP 400: the server has no API key, so its admin API "
                "(stats, cache clear, probe) is closed; start it with --api-key",
            )
        if resp.status_code >= 400:
            # never echo the request: it carries the key
            raise EngineError(self.name, f"POST {ADMIN}/login -> HTTP {resp.status_code}")
        cookie = resp.cookies.get(SESSION_COOKIE)
        if not cookie:
            raise EngineError(self.name, f"{ADMIN}/login set no {SESSION_COOKIE} cookie")
        self._admin_cookie = cookie

    def session_stats(self) -> dict[str, Any]:
        data = self._admin("GET", f"/stats?scope={STATS_SCOPE}")
        if not isinstance(data, dict):
            raise EngineError(self.name, f"{ADMIN}/stats returned {type(data).__name__}, not an object")
        data.pop("api_key", None)  # the stats answer carries the server's key: never keep it
        return data

    def clear_ssd_cache(self) -> int:
        data = self._admin("POST", "/ssd-cache/clear")
        deleted = data.get("total_deleted") if isinstance(data, dict) else None
        if not isinstance(data, dict) or data.get("status") != "ok" or not isinstance(deleted, int):
            raise EngineError(self.name, f"{ADMIN}/ssd-cache/clear answered {str(data)[:200]}")
        return deleted

    def clear_hot_cache(self) -> int | None:
        """Entries dropped from the in-memory hot cache; None where the build has no such
        route (older oMLX answers 404: it has no hot cache to clear separately)."""
        resp = self._admin_request("POST", "/hot-cache/clear")
        if resp.status_code == 404:
            return None
        if resp.status_code == 401:
            return int(self._admin("POST", "/hot-cache/clear").get("total_cleared", 0))
        if resp.status_code >= 400:
            raise EngineError(self.name, f"POST {ADMIN}/hot-cache/clear -> HTTP {resp.status_code}")
        data = self._json(resp, ADMIN + "/hot-cache/clear")
        return int(data.get("total_cleared", 0)) if isinstance(data, dict) else 0

    def reset_prefix_cache(self) -> None:
        """Drop every cached block: the SSD tier (files and index) and the hot cache.

        SSD writes are asynchronous: launched, wait for the writer to settle first, so that
        no block lands on disk after the clear, and check that the tier's folder is empty.
        """
        launched = not self.ctx.attached
        if launched:
            self._wait_files_still(timeout_s=10.0, quiet_s=0.5)
        self._stored_prefixes.clear()
        for _attempt in range(3):
            self.clear_ssd_cache()
            self.clear_hot_cache()
            if not launched or not self.ssd_files():
                return
            self._wait_files_still(timeout_s=5.0, quiet_s=0.5)
        left = len(self.ssd_files())
        raise EngineError(self.name, f"{left} SSD block files left after {ADMIN}/ssd-cache/clear")

    def probe(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        """Where each block of a chat prompt lives (hot SSD copy, SSD only, cold)."""
        data = self._admin("POST", "/cache/probe", {"model_id": self.model_name(), "messages": messages})
        if not isinstance(data, dict) or "model_loaded" not in data:
            raise EngineError(self.name, f"{ADMIN}/cache/probe answered {str(data)[:200]}")
        return data

    # ---- requests -----------------------------------------------------------------------
    def completion_body(self, tokens: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
        return {
            "model": self.model_name(),
            "prompt": words(tokens),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": stream,
        }

    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        fresh = [] if self.ctx.attached else self._unstored_prefixes(tokens)
        files_before = self._file_names() if fresh else set()
        data = self.post_json("/v1/completions", self.completion_body(tokens, max_tokens))
        if fresh:
            self._wait_blocks_stored(fresh, files_before)
        if not isinstance(data, dict):
            raise EngineError(self.name, f"/v1/completions returned {type(data).__name__}, not an object")
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None:
            cached = usage.get("cached_tokens")  # builds before oMLX #922
        if cached is None:
            raise EngineError(self.name, f"response usage carries no cached_tokens: {usage}")
        prompt_tokens = int(usage.get("prompt_tokens", -1))
        if prompt_tokens != len(tokens):
            raise EngineError(
                self.name,
                f"engine counted {prompt_tokens} prompt tokens for {len(tokens)} words: the served model's "
                "tokenizer is not word-level, so block-granular oracles cannot be applied",
            )
        choice = (data.get("choices") or [{}])[0]
        return ServedPrompt(prompt_tokens, int(cached), token_ids(str(choice.get("text") or "")))

    def metrics(self) -> MetricSnapshot:
        """Session-scope counters only (admin stats, else /api/status, which is session too)."""
        status = self.get_json("/api/status")
        if not isinstance(status, dict):
            raise EngineError(self.name, f"/api/status returned {type(status).__name__}, not an object")
        values: dict[str, float] = {f"omlx_{k}": status[k] for k in SNAPSHOT_KEYS if k in status}
        if "model_memory_used" in status:
            values["omlx_model_memory_used_bytes"] = status["model_memory_used"]
        try:
            stats = self.session_stats()
        except EngineError:
            if not self.api_key:
                stats = {}  # no admin session to be had: /api/status numbers stand alone
            else:
                raise
        values.update({f"omlx_{k}": stats[k] for k in SNAPSHOT_KEYS if k in stats})
        runtime = stats.get("runtime_cache") or {}
        values.update({f"omlx_runtime_cache_{k}": runtime[k] for k in RUNTIME_CACHE_KEYS if k in runtime})
        snap = snapshot_from_values(values)
        if not snap.has("omlx_total_prompt_tokens"):
            raise EngineError(self.name, f"/api/status lacks total_prompt_tokens: {sorted(status)[:20]}")
        return snap

    def requests_in_flight(self) -> int | None:
        """Requests the engine runs or queues, by its own live count: /api/status active_requests
        (the engines' output collectors, one per request until its consumer cleans it up:
        omlx/engine_core.py _cleanup_request) plus waiting_requests (the schedulers' queues),
        summed over loaded models (omlx/server.py api_status)."""
        status = self.get_json("/api/status")
        missing = [k for k in ("active_requests", "waiting_requests") if k not in status]
        if missing:
            raise EngineError(self.name, f"/api/status lacks {', '.join(missing)}", log_tail(self))
        return int(status["active_requests"]) + int(status["waiting_requests"])

    def resolved_block_size(self) -> int | None:
        """The block size the server says its model runs at (runtime_cache.effective_block_sizes),
        for the suite to judge against the one it requested. oMLX reports sizes only for the
        models its pool has loaded (admin/routes.py _build_runtime_cache_observability) and
        loads one at its first request, so the model is loaded first (the admin load answers
        "Already loaded" where it is): whether the size is judged must not depend on whether a
        request came before. A loaded model without a size is an error, never "not reported"
        (until 2026-12-06 it read None: a mutant that moved the block size went unjudged on a
        fresh server). Attached: None (attached_block_size reads the stats, loading nothing on
        a team's server)."""
        if self.ctx.attached:
            return None
        self._load_model()
        sizes = (self.session_stats().get("runtime_cache") or {}).get("effective_block_sizes") or []
        if not sizes:
            raise EngineError(self.name, f"{ADMIN}/stats reports no block size for the loaded model")
        return int(sizes[0])

    def attached_block_size(self) -> int:
        if self._attached_block is None:
            with contextlib.suppress(EngineError):
                sizes = (self.session_stats().get("runtime_cache") or {}).get("effective_block_sizes") or []
                if sizes:
                    self._attached_block = int(sizes[0])
        return self._attached_block or BLOCK_SIZE

    # ---- capacity (FORCED_EVICTION, LONG_SESSION) ---------------------------------------
    def cache_capacity_tokens(self) -> int:
        """The SSD tier as configured: SSD_CACHE_BYTES of 256-token block files, each the
        block's K and V (computed from the model shape, not read from the engine)."""
        return SSD_CACHE_BYTES // self.deployment.model.block_bytes(BLOCK_SIZE) * BLOCK_SIZE

    def kv_pool_bytes(self) -> int:
        """Resident KV the configuration allows beyond the running request: the hot cache
        (0 as launched). Finished requests' KV lives in SSD files; the running request's (a
        few thousand tokens x 512 B in the checks) is within the checks' RSS noise allowance."""
        return HOT_CACHE_BYTES

    # ---- persistence --------------------------------------------------------------------
    @provides(PersistentTier)
    def persistent_tier(self) -> PersistentTier:
        """The paged SSD cache's block files (one safetensors file per block, under a
        directory per first hex digit of its hash)."""
        return FileTier(
            self.ssd_dir(),
            "[0-9a-f]/*.safetensors",
            self.deployment.model.block_bytes(BLOCK_SIZE),
            self.flush_ssd,
        )

    def ssd_files(self) -> list[Path]:
        return self.persistent_tier().files()

    def _file_state(self) -> list[tuple[str, int]]:
        state = []
        for path in self.ssd_files():
            with contextlib.suppress(OSError):
                state.append((path.name, path.stat().st_size))
        return state

    def _wait_files_still(self, timeout_s: float, quiet_s: float, nonempty: bool = False) -> None:
        deadline = time.monotonic() + timeout_s
        last, still_since = None, time.monotonic()
        while time.monotonic() < deadline:
            current = self._file_state()
            if current != last:
                last, still_since = current, time.monotonic()
            elif (current or not nonempty) and time.monotonic() - still_since >= quiet_s:
                return
            time.sleep(0.1)

    def _unstored_prefixes(self, tokens: list[int]) -> list[int]:
        """Hashes of the prompt's full-block prefixes this server life has not stored yet
        (our own ledger, not the engine's word)."""
        prefixes = (hash(tuple(tokens[:end])) for end in range(BLOCK_SIZE, len(tokens) + 1, BLOCK_SIZE))
        return [key for key in prefixes if key not in self._stored_prefixes]

    def _file_names(self) -> set[str]:
        return {path.name for path in self.ssd_files()}

    def _wait_blocks_stored(self, fresh: list[int], files_before: set[str], timeout_s: float = 5.0) -> None:
        """oMLX stores a finished request's blocks after it answered (scheduler.py,
        _cleanup_finished -> _store_cache_executor, "G2-async"), so a repeat sent at once can
        find part of them: measured on a loaded 2-core runner, 256 of 1536 tokens. A serving
        client sees that too, but the checks ask about the cache's accounting, not its write
        latency: wait (bounded) until the prompt's blocks this server life has not stored yet
        are on disk, each a new file. A store oMLX drops (queue full) only costs the wait."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self._file_names() - files_before) >= len(fresh):
                break
            time.sleep(0.05)
        self._stored_prefixes.update(fresh)

    def flush_ssd(self, timeout_s: float = 20.0, quiet_s: float = 1.5) -> None:
        """SSD writes are asynchronous: wait until the tier's file set stops changing."""
        self._wait_files_still(timeout_s, quiet_s, nonempty=True)

    # ---- instance churn: load, serve, unload a model of the engine pool ------------------
    def _model_action(self, action: str) -> requests.Response:
        """POST /admin/api/models/{id}/load|unload (omlx/admin/routes.py:1918, :1970)."""
        return self._admin_request("POST", f"/models/{self.model_name()}/{action}")

    def _load_model(self) -> None:
        """Load the model (oMLX answers "Already loaded" where it is); an error names the answer."""
        loaded = self._model_action("load")
        if loaded.status_code != 200:
            raise EngineError(
                self.name, f"load {self.model_name()} -> HTTP {loaded.status_code}: {loaded.text[:200]}"
            )

    def _load_serve_unload(self, tokens: list[int]) -> requests.Response:
        self._load_model()
        for shift in range(3):
            self.serve_prompt(tokens[: len(tokens) - shift])
        return self._model_action(UNLOAD)

    @provides(InstanceChurn)
    def instance_churn(self) -> InstanceChurn:
        return OmlxChurn(self)

    def unload_cycle(self, tokens: list[int]) -> None:
        ensure(self, self.config or EngineConfig())
        unloaded = self._load_serve_unload(tokens)
        if unloaded.status_code != 200:
            raise EngineError(self.name, f"unload -> HTTP {unloaded.status_code}: {unloaded.text[:200]}")

    def reclaim_probe(self, path: str | None = None) -> dict[str, MemoryMeasure]:
        """The pool's own count of loaded model bytes (exact: 0 with no model loaded, whatever
        the allocator does; omlx/engine_pool.py _current_model_memory, /api/status), the
        server's threads (exact: a model's scheduler, writer and executor threads end with its
        unload, engine_core.py close) and its RSS (MLX arrays freed on unload, engine_pool.py
        _unload_engine)."""
        status = self.get_json("/api/status")
        if not isinstance(status, dict) or "model_memory_used" not in status:
            raise EngineError(self.name, f"/api/status lacks model_memory_used: {str(status)[:200]}")
        server = sample_processes(self.engine_pids())
        return {
            "pool_model_memory_bytes": MemoryMeasure(
                float(status["model_memory_used"]), exact=True, holds_kv=False
            ),
            "server_threads": threads_measure(server),
            "server_rss_bytes": MemoryMeasure(server.rss, exact=False),
        }

    def unload_twice(self, tokens: list[int]) -> SecondRelease:
        """Unload twice: oMLX answers the second with 400 "Model not loaded" (routes.py:1931)."""
        first = self._load_serve_unload(tokens)
        second = self._model_action(UNLOAD)
        return SecondRelease(
            first.status_code == 200,
            second.status_code == 400 and "not loaded" in second.text.lower(),
            f"first: HTTP {first.status_code}; second: HTTP {second.status_code} {second.text[:200]}",
        )

    # ---- release guard: one request aborted twice, in an engine built as `omlx serve` does --
    def release_twice(self, tokens: list[int]) -> ReleaseTwice:
        """EngineCore.abort_request twice for a request holding a cached prefix, with a witness
        request on the same prefix (drivers/omlx_release_driver.py), in a driver process of its
        own: the engine it builds is dropped with it."""
        work = self.ctx.workdir / "release-guard"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        driver = DriverProcess(
            self.name,
            self.env().python,
            DRIVERS / "omlx_release_driver.py",
            self.ctx.workdir / "logs" / "omlx-release-driver.log",
            env={"HF_HUB_OFFLINE": "1", "DO_NOT_TRACK": "1"},
            start_timeout_s=self.ctx.start_timeout_s,
        )
        try:
            answer = driver.call(
                "release_twice",
                timeout_s=300,
                model=str(self.model_dir() / MODEL_NAME),
                work=str(work),
                token_ids=tokens,
                ssd_bytes=SSD_CACHE_BYTES,
            )
        finally:
            driver.close()
        return ReleaseTwice.from_json(answer)

    # ---- memory -------------------------------------------------------------------------
    def engine_pids(self) -> list[int]:
        return self.server.pids() if self.server else []

    def logs(self, lines: int = 80) -> dict[str, str]:
        return {"omlx serve": self.server.log_tail(lines)} if self.server else {}


class OmlxChurn(InstanceChurn):
    """A model of oMLX's engine pool loaded, served and unloaded through the admin API."""

    paths = ("unregister",)

    def __init__(self, engine: OmlxAdapter) -> None:
        self.engine = engine

    def cycle(self, path: str, index: int, tokens: list[int]) -> None:
        if path not in self.paths:
            raise NotImplementedError(f"engine {self.engine.name} has no release path {path!r}")
        self.engine.unload_cycle(tokens)

    def second_release(self, path: str, tokens: list[int]) -> SecondRelease:
        return self.engine.unload_twice(tokens)
