"""An engine's HTTP API, for an adapter to compose before EngineAdapter in its bases: one
session per thread, JSON and Prometheus requests whose failures are EngineErrors naming the
engine (with its log tail), OpenAI-style completions and the streams the abort checks cut (the
StreamAborts facet; an adapter adds its engine's live request count, requests_in_flight)."""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar

import requests

from kvconform import timing
from kvconform.contract.adapter import log_tail
from kvconform.contract.facets import AttachedServer, StreamAborts
from kvconform.contract.types import ServedPrompt
from kvconform.errors import EngineError, UsageError
from kvconform.kit.server import wait_http_ok
from kvconform.metrics import MetricSnapshot, parse_prometheus

if TYPE_CHECKING:
    from kvconform.contract import EngineAdapter

    class _Base(EngineAdapter, StreamAborts, AttachedServer):  # the adapter this is composed into
        pass
else:

    class _Base(StreamAborts, AttachedServer):
        pass


class HttpApi(_Base):
    """`base` in the request helpers: another server of the same engine (a decode instance, a
    worker's system port) instead of base_url, with the same timeouts and errors."""

    health_path: ClassVar[str] = "/health"

    @property
    def http(self) -> requests.Session:
        """An HTTP session per thread: samplers scrape while checks send requests."""
        sessions = self.__dict__.setdefault("_http_sessions", threading.local())
        session = getattr(sessions, "session", None)
        if session is None:
            session = sessions.session = requests.Session()
            name = self.name
            session.hooks["response"].append(
                lambda resp, *_a, **_k: timing.add_call(name, resp.elapsed.total_seconds())
            )
        return session

    def url(self, path: str, base: str | None = None) -> str:
        root = base or self.base_url
        if root is None:
            raise EngineError(self.name, "not started")
        return root.rstrip("/") + path

    def get_json(self, path: str, timeout: float | None = None) -> Any:
        resp = self._request("GET", path, timeout=timeout)
        return self._json(resp, path)

    def post_json(
        self, path: str, body: Any = None, timeout: float | None = None, base: str | None = None
    ) -> Any:
        resp = self._request("POST", path, json=body, timeout=timeout, base=base)
        return self._json(resp, path)

    def scrape(self, path: str = "/metrics", base: str | None = None) -> MetricSnapshot:
        resp = self._request("GET", path, base=base)
        return parse_prometheus(resp.text, self.name, f"{base or ''}{path}")

    def _request(
        self, method: str, path: str, timeout: float | None = None, base: str | None = None, **kw: Any
    ) -> requests.Response:
        what = f"{method} {base or ''}{path}"
        try:
            resp = self.http.request(
                method, self.url(path, base), timeout=timeout or self.ctx.request_timeout_s, **kw
            )
        except requests.RequestException as exc:
            self._suspect = f"{what} failed: {type(exc).__name__}"
            raise EngineError(self.name, f"{what} failed: {exc}", log_tail(self)) from None
        if resp.status_code >= 500:
            # a server error may be the engine dying (vLLM answers 500 while its EngineCore shuts
            # down, its API server still up): the next ensure() asks its health first
            self._suspect = f"{what} -> HTTP {resp.status_code}"
        if resp.status_code >= 400:
            raise EngineError(
                self.name, f"{what} -> HTTP {resp.status_code}: {resp.text[:300]}", log_tail(self)
            )
        return resp

    def _json(self, resp: requests.Response, path: str) -> Any:
        try:
            return resp.json()
        except ValueError:
            raise EngineError(self.name, f"{path} returned non-JSON: {resp.text[:200]!r}") from None

    # ---- health and attach mode -----------------------------------------------------------
    def healthy(self) -> bool:
        return wait_http_ok(self.http, self.url(self.health_path), timeout=5.0)

    def check_reachable(self) -> None:
        """Attach mode: one quick request; a UsageError names the engine and the URL."""
        url = self.url(self.health_path)
        try:
            resp = self.http.get(url, timeout=5)
        except requests.RequestException as exc:
            reason = type(exc).__name__
            if isinstance(exc, requests.ConnectionError):
                reason = "connection refused or host unreachable"
            raise UsageError(f"engine {self.name} at {self.ctx.url} is unreachable ({reason})") from None
        if resp.status_code != 200:
            raise UsageError(
                f"engine {self.name} at {self.ctx.url}: {self.health_path} answered HTTP {resp.status_code}"
            )

    # ---- OpenAI-style completions ---------------------------------------------------------
    def completion_body(self, tokens: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
        return {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}

    def openai_completion(self, tokens: list[int], max_tokens: int, **extra: Any) -> ServedPrompt:
        """POST /v1/completions (OpenAI-compatible) and read the cached tokens it reports."""
        data = self.post_json("/v1/completions", {**self.completion_body(tokens, max_tokens), **extra})
        return self.served_from_openai(data, tokens)

    def served_from_openai(self, data: Any, tokens: list[int]) -> ServedPrompt:
        if not isinstance(data, dict):
            raise EngineError(self.name, f"/v1/completions returned {type(data).__name__}, not an object")
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

    # ---- streams (ABORT_REQUESTS) ---------------------------------------------------------
    def open_stream(self, tokens: list[int], max_tokens: int) -> requests.Response:
        """Start a streaming completion (`max_tokens` asked for); the response streams its
        server-sent events. The one part of a streaming request an engine's API changes."""
        resp = self._request(  # the adapter's own request path: its headers, its errors
            "POST", "/v1/completions", json=self.completion_body(tokens, max_tokens, stream=True), stream=True
        )
        if resp.status_code != 200:
            said = resp.text[:200]
            resp.close()
            raise EngineError(self.name, f"streaming completion -> HTTP {resp.status_code}: {said}")
        return resp

    def stream_and_disconnect(self, tokens: list[int], after_chunks: int, max_tokens: int = 256) -> int:
        resp = self.open_stream(tokens, max_tokens)
        try:
            return token_chunks_before_drop(resp.iter_lines(), after_chunks)
        finally:
            resp.close()

    def stream_outlives(self, tokens: list[int], max_tokens: int, seconds: float) -> bool:
        resp = self.open_stream(tokens, max_tokens)
        try:
            return stream_runs_past(resp.iter_lines(), seconds)
        finally:
            resp.close()


def _sse_chunk(line: bytes) -> bool | None:
    """A server-sent event line: True for a chunk that ends the stream (`[DONE]`, or a finish
    reason: OpenAI's choices[].finish_reason, SGLang's meta_info.finish_reason), False for
    another chunk, None for what is not a data chunk."""
    if not line.startswith(b"data:"):
        return None
    body = line[5:].strip()
    if body == b"[DONE]":
        return True
    try:
        chunk = json.loads(body)
    except ValueError:
        return None
    choices = chunk.get("choices") or [{}]
    return bool(choices[0].get("finish_reason") or (chunk.get("meta_info") or {}).get("finish_reason"))


def token_chunks_before_drop(lines: Any, after_chunks: int) -> int:
    """Read server-sent events until `after_chunks` token chunks came: their count, or 0 if the
    stream ended first."""
    received = 0
    for line in lines:
        ended = _sse_chunk(line)
        if ended is None:
            continue
        if ended:
            return 0
        received += 1
        if received >= after_chunks:
            return received
    return 0


def stream_runs_past(lines: Any, seconds: float) -> bool:
    """Read server-sent events until `seconds` have passed (True) or the stream ended (False)."""
    start = time.monotonic()
    for line in lines:
        if _sse_chunk(line):
            return False
        if time.monotonic() - start >= seconds:
            return True
    return False
