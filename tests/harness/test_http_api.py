"""The HTTP helpers' errors: a transport failure or a server error leaves the engine suspect,
so the next ensure() asks its health before a check relies on it (a server that answers 500
while its engine core dies is relaunched, not handed to the next check)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from kvconform.contract import AdapterContext, EngineAdapter, EngineConfig, ensure
from kvconform.errors import EngineError
from kvconform.kit.http_api import HttpApi


class Answers(BaseHTTPRequestHandler):
    status = {"/v1/completions": 500, "/health": 200}

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def _answer(self) -> None:
        self.send_response(self.status.get(self.path, 404))
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *_args: object) -> None:
        pass


class Served(HttpApi, EngineAdapter):
    name = "served"

    def __init__(self, ctx: AdapterContext, url: str) -> None:
        super().__init__(ctx)
        self.url_root = url
        self.starts = 0

    def start(self, config: EngineConfig) -> None:
        self.base_url = self.url_root
        self.starts += 1

    def running(self) -> bool:
        return self.base_url is not None


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    Answers.status["/health"] = 200


def test_a_server_error_makes_the_next_ensure_ask_health(tmp_path: Path, server: str) -> None:
    engine = Served(AdapterContext(workdir=tmp_path), server)
    ensure(engine)
    with pytest.raises(EngineError, match="HTTP 500"):
        engine.post_json("/v1/completions", {})
    Answers.status["/health"] = 503  # the engine died behind its API server
    ensure(engine)
    assert engine.starts == 2
    assert "stopped answering (POST /v1/completions -> HTTP 500)" in engine.relaunch_notes[0]


def test_a_client_error_leaves_the_engine_trusted(tmp_path: Path, server: str) -> None:
    engine = Served(AdapterContext(workdir=tmp_path), server)
    ensure(engine)
    with pytest.raises(EngineError, match="HTTP 404"):
        engine.get_json("/no/such/path")
    Answers.status["/health"] = 503  # not asked: a 404 says nothing about the engine's health
    ensure(engine)
    assert engine.starts == 1 and not engine.relaunch_notes
