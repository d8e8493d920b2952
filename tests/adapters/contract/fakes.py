"""The common part of the local HTTP servers shaped after TensorRT-LLM's and oMLX's (fake_*.py).

They are the suite's own code (stdlib http.server on 127.0.0.1, a free port), shaped after
the engines' sources: payload keys, drained-on-read endpoints, session vs all-time scopes.
They model a block-granular prefix cache just far enough for the adapters' numbers to mean
something; faults make them lie in one specific way each.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

Reply = tuple[int, Any, dict[str, str]]


def f32(value: float) -> float:
    """A value as a C++ float survives its JSON trip."""
    return struct.unpack("f", struct.pack("f", value))[0]


def block_hash(parent: int | None, tokens: list[int]) -> int:
    digest = hashlib.sha256(repr((parent, tokens)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # a size_t, JSON-safe


class FakeServer:
    """Routes (method, path) -> handler(query, body, headers) -> (status, payload, headers)."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, str], Callable[[dict, Any, dict], Reply]] = {}
        self.faults: dict[str, str] = {}  # path -> "garbage" | "500"
        self.log: list[tuple[str, str]] = []
        self.lock = threading.RLock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                return

            def _serve(self, method: str) -> None:
                parts = urlsplit(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                server.log.append((method, self.path))
                fault = server.faults.get(parts.path)
                if fault == "500":
                    self._send(500, b"Internal Server Error", "text/plain")
                    return
                if fault == "garbage":
                    self._send(200, b"{not json", "application/json")
                    return
                handler = server.routes.get((method, parts.path))
                if handler is None:
                    self._send(404, json.dumps({"detail": "Not Found"}).encode(), "application/json")
                    return
                body = json.loads(raw) if raw else None
                with server.lock:
                    status, payload, headers = handler(parse_qs(parts.query), body, dict(self.headers))
                if isinstance(payload, str):
                    data, ctype = payload.encode(), headers.pop("Content-Type", "text/plain; version=0.0.4")
                elif payload is None:
                    data, ctype = b"", "text/plain"
                else:
                    data, ctype = json.dumps(payload).encode(), "application/json"
                self._send(status, data, ctype, headers)

            def _send(
                self, status: int, data: bytes, ctype: str, headers: dict[str, str] | None = None
            ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def route(self, method: str, path: str, fn: Callable[[dict, Any, dict], Reply]) -> None:
        self.routes[(method, path)] = fn

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
