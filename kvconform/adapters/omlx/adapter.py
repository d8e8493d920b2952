"""oMLX (Apple Silicon only): attach to `omlx serve` on a Mac, or launch it where `omlx` is on
PATH. Endpoints and fields as in the oMLX source (jundot/omlx):

- omlx/server.py: `GET /health` -> {"status": "healthy", ...}; `GET /api/status` (Bearer API key
  when one is configured) -> total_prompt_tokens, total_cached_tokens, cache_efficiency (percent),
  model_memory_used, version... from the *session* metrics snapshot.
- omlx/admin/routes.py (router mounted under /admin, session cookie `omlx_admin_session` from
  `POST /admin/api/login {"api_key": ...}` unless skip_api_key_verification):
  `GET /admin/api/stats?scope=session|alltime` (snapshot + runtime_cache),
  `POST /admin/api/ssd-cache/clear` -> {"status": "ok", "total_deleted": n, ...},
  `POST /admin/api/hot-cache/clear`, `POST /admin/api/cache/probe {"model_id", "messages"}`.
- omlx/server_metrics.py: session counters reset at server start; all-time counters persist
  across restarts in a JSON file. This adapter only ever reads scope=session: all-time numbers
  would mix earlier server lives into a check's deltas.
- omlx/api/openai_models.py: `/v1/completions` takes `prompt: str | list[str]` (no token ids)
  and answers `usage.cached_tokens` (an oMLX extension; newer builds may also send
  usage.prompt_tokens_details.cached_tokens).
- omlx/cli.py: `omlx serve --model-dir --host --port --base-path --paged-ssd-cache-dir
  --paged-ssd-cache-max-size --hot-cache-max-size --api-key`. The SSD tier keeps
  `<ssd dir>/<0-f>/*.safetensors` and is meant to survive restarts.

Token ids travel as words "w<id>": exact block accounting needs a word-level tokenizer model
(one word = one token, as kvconform's tiny models have); the adapter refuses to report numbers
when the engine counts another number of prompt tokens.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, ClassVar

import requests

from kvconform.contract import AdapterContext, Capability, EngineAdapter, EngineConfig, ServedPrompt
from kvconform.errors import EngineError, UsageError
from kvconform.kit.server import LaunchedServer
from kvconform.metrics import MetricSnapshot, snapshot_from_values
from kvconform.processes import TeardownReport, free_port

C = Capability
WORD = re.compile(r"w(\d+)")
ADMIN = "/admin/api"
SESSION_COOKIE = "omlx_admin_session"
STATS_SCOPE = "session"  # never "alltime": all-time counters persist across restarts
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


def words(tokens: list[int]) -> str:
    return " ".join(f"w{t}" for t in tokens)


def token_ids(text: str) -> list[int]:
    return [int(m.group(1)) for m in WORD.finditer(text or "")]


class OmlxAdapter(EngineAdapter):
    name = "omlx"
    env_spec = None  # a Mac install (`omlx` on PATH or the app), not a kvconform-built env
    default_block_size = 256  # omlx SchedulerConfig.paged_cache_block_size; read back when served
    recomputes_last_token = True
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.PREFIX_HIT_COUNTERS,
            C.RESTART,
            C.PERSISTENT_PREFIX,
            C.CORRUPT_PERSISTED,
            C.HOST_MEMORY,
        }
    )
    metric_names: ClassVar[dict[str, str]] = {
        "prefix_queries": "omlx_total_prompt_tokens",
        "prefix_hits": "omlx_total_cached_tokens",
        "disk_usage_bytes": "omlx_runtime_cache_total_size_bytes",
    }

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        self.server: LaunchedServer | None = None
        self.api_key = os.environ.get("KVCONFORM_OMLX_API_KEY", "")
        self._model: str | None = os.environ.get("KVCONFORM_OMLX_MODEL") or None
        self._block_size: int | None = None
        self._admin_cookie: str | None = None

    def _headers(self) -> dict[str, str]:
        """Sent on every request (HTTP sessions may be per thread, so nothing lives in one)."""
        headers = {}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if self._admin_cookie:
            headers["Cookie"] = f"{SESSION_COOKIE}={self._admin_cookie}"
        return headers

    def _request(self, method: str, path: str, timeout: float | None = None, **kw: Any) -> requests.Response:
        kw["headers"] = {**self._headers(), **(kw.get("headers") or {})}
        return super()._request(method, path, timeout=timeout, **kw)

    # ---- identity -----------------------------------------------------------------------
    @property
    def version(self) -> str:
        if self.attached or self.server is not None:
            return self.attached_version()
        return "not started"

    def attached_version(self) -> str:
        try:
            return str(self.get_json("/api/status", timeout=5).get("version", "unknown"))
        except (EngineError, AttributeError):
            return "unknown (attached)"

    def preflight(self) -> None:
        if self.attached:
            self.check_reachable()
        elif shutil.which("omlx") is None:
            raise UsageError(
                "engine omlx: `omlx` is not on PATH (oMLX runs on Apple Silicon only); "
                "start `omlx serve` on a Mac and attach with --engine-url"
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
    def ssd_dir(self) -> Path:
        return self.ctx.workdir / "ssd-cache"

    def server_argv(self, port: int) -> list[str]:
        model_dir = os.environ.get("KVCONFORM_OMLX_MODEL_DIR")
        if not model_dir:
            raise UsageError("engine omlx: set KVCONFORM_OMLX_MODEL_DIR (a folder of model folders)")
        argv = [
            shutil.which("omlx") or "omlx",
            "serve",
            "--model-dir",
            model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--base-path",
            str(self.ctx.workdir / "base"),
            "--paged-ssd-cache-dir",
            str(self.ssd_dir()),
            "--paged-ssd-cache-max-size",
            "4GB",
        ]
        if self.api_key:
            argv += ["--api-key", self.api_key]
        return argv

    def start(self, config: EngineConfig) -> None:
        if config.offload or config.block_size not in (None, self.default_block_size):
            raise NotImplementedError("oMLX runs at its own block size, without a host offload tier")
        if not config.persistent and self.ssd_dir().exists():
            shutil.rmtree(self.ssd_dir())
        port = free_port()
        self.base_url = f"http://127.0.0.1:{port}"
        self._admin_cookie = None
        self.server = LaunchedServer(
            self.name,
            "omlx-serve",
            self.server_argv(port),
            self.ctx.workdir,
            self.url("/health"),
            timeout_s=self.ctx.start_timeout_s,
            session=self.http,
        )
        self.config = config

    def stop(self) -> list[TeardownReport]:
        reports = []
        if self.server is not None:
            reports.append(self.server.stop())
            self.server = None
        self.config = None
        return reports

    def running(self) -> bool:
        return self.server is not None and self.server.process.alive()

    # ---- admin API ----------------------------------------------------------------------
    def _admin(self, method: str, path: str, body: Any = None) -> Any:
        """An admin call; logs in with the API key on the first 401."""
        for attempt in range(2):
            try:
                resp = self.http.request(
                    method,
                    self.url(ADMIN + path),
                    json=body,
                    headers=self._headers(),
                    timeout=self.ctx.request_timeout_s,
                )
            except requests.RequestException as exc:
                what = f"{method} {ADMIN}{path} failed: {exc}"
                raise EngineError(self.name, what, self.log_tail()) from None
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

    def login(self) -> None:
        resp = self._request("POST", ADMIN + "/login", json={"api_key": self.api_key, "remember": False})
        cookie = resp.cookies.get(SESSION_COOKIE)
        if not cookie:
            raise EngineError(self.name, f"{ADMIN}/login set no {SESSION_COOKIE} cookie")
        self._admin_cookie = cookie

    def session_stats(self) -> dict[str, Any]:
        data = self._admin("GET", f"/stats?scope={STATS_SCOPE}")
        if not isinstance(data, dict):
            raise EngineError(self.name, f"{ADMIN}/stats returned {type(data).__name__}, not an object")
        return data

    def clear_ssd_cache(self) -> int:
        data = self._admin("POST", "/ssd-cache/clear")
        deleted = data.get("total_deleted") if isinstance(data, dict) else None
        if not isinstance(data, dict) or data.get("status") != "ok" or not isinstance(deleted, int):
            raise EngineError(self.name, f"{ADMIN}/ssd-cache/clear answered {str(data)[:200]}")
        return deleted

    def clear_hot_cache(self) -> int:
        data = self._admin("POST", "/hot-cache/clear")
        return int(data.get("total_cleared", 0)) if isinstance(data, dict) else 0

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
        data = self.post_json("/v1/completions", self.completion_body(tokens, max_tokens))
        if not isinstance(data, dict):
            raise EngineError(self.name, f"/v1/completions returned {type(data).__name__}, not an object")
        usage = data.get("usage") or {}
        cached = usage.get("cached_tokens")
        if cached is None:
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
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
        sizes = runtime.get("effective_block_sizes") or []
        if sizes:
            self._block_size = int(sizes[0])
        snap = snapshot_from_values(values)
        if not snap.has("omlx_total_prompt_tokens"):
            raise EngineError(self.name, f"/api/status lacks total_prompt_tokens: {sorted(status)[:20]}")
        return snap

    def block_size(self) -> int:
        if self._block_size is None and (self.attached or self.server is not None):
            try:
                sizes = (self.session_stats().get("runtime_cache") or {}).get("effective_block_sizes") or []
                if sizes:
                    self._block_size = int(sizes[0])
            except EngineError:
                pass
        return self._block_size or self.default_block_size

    # ---- persistence --------------------------------------------------------------------
    def persisted_entries(self) -> list[Path]:
        return sorted(p for p in self.ssd_dir().glob("[0-9a-f]/*.safetensors") if p.is_file())

    def flush_persistent(self, timeout_s: float = 20.0, quiet_s: float = 1.5) -> None:
        """SSD writes are asynchronous: wait until the tier's file set stops changing."""
        deadline = time.monotonic() + timeout_s
        last, still_since = None, time.monotonic()
        while time.monotonic() < deadline:
            current = [(p.name, p.stat().st_size) for p in self.persisted_entries()]
            if current != last:
                last, still_since = current, time.monotonic()
            elif current and time.monotonic() - still_since >= quiet_s:
                return
            time.sleep(0.2)

    # ---- memory -------------------------------------------------------------------------
    def engine_pids(self) -> list[int]:
        return self.server.pids() if self.server else []

    def log_tail(self, lines: int = 40) -> str:
        return self.server.log_tail(lines) if self.server else ""

    def describe_logs(self) -> dict[str, str]:
        return {"omlx serve": self.log_tail(80)} if self.server else {}
