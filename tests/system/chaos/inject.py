"""Fault injector, loaded into a real suite subprocess with `-p tests.system.chaos.inject`.

Configured by KVCONFORM_CHAOS (JSON): {"fault": NAME, "check": SUBSTRING of the target
check's node id, "at": N (the Nth call that triggers), "timeout_s": request timeout the
adapter is given, "log": PATH, "pid": PID (attach mode: the server the test started)}.
Every injection and, at the start of each check, the listening sockets of the engine tree and
of this process are appended to the log as JSON lines, for the chaos test to read.

The faults act from outside the engine, as the world would: signals to the engine's
processes, a port squatter, a wrapped launcher, a fake /metrics endpoint in front of the real
one, and frames mangled on their way into the KV-event subscriber.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psutil
import pytest
import requests

CFG: dict[str, Any] = json.loads(os.environ.get("KVCONFORM_CHAOS", "{}"))
FAULT: str = CFG.get("fault", "")
_state: dict[str, Any] = {"calls": 0, "in_target": False, "squatter": None}
CRASH_AT_START = (
    "import sys, time; time.sleep(0.3); "
    "print('RuntimeError: CUDA error: out of memory while allocating the KV cache', file=sys.stderr); "
    "sys.exit(3)"
)


def log(event: str, **fields: Any) -> None:
    path = CFG.get("log")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps({"t": time.time(), "event": event, **fields}) + "\n")


def listening(pids: list[int]) -> list[list[Any]]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            for conn in proc.net_connections(kind="inet"):
                if conn.status == psutil.CONN_LISTEN or (conn.type == socket.SOCK_DGRAM and conn.laddr):
                    out.append([pid, proc.name(), conn.laddr.ip, conn.laddr.port])
    return out


def _adapter(item: pytest.Item) -> Any:
    from kvconform.plugin.collection import engine_of
    from kvconform.plugin.session import kv_session

    name = engine_of(item)
    return kv_session(item.config).adapters.get(name) if name else None


def _engine_pids(adapter: Any) -> list[int]:
    with contextlib.suppress(Exception):
        return list(adapter.engine_pids())
    return []


# ---- faults on the engine's processes -------------------------------------------------------
def _kill(adapter: Any, how: str) -> None:
    if how == "sigterm_suite":  # the suite itself, as a CI job's timeout or a cancel would
        log("injected", fault=FAULT, pids=[os.getpid()])
        os.kill(os.getpid(), signal.SIGTERM)
        return
    pids = _engine_pids(adapter) if FAULT != "kill_attached" else [int(CFG["pid"])]
    if how == "stop":
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGSTOP)
    else:
        with contextlib.suppress(OSError):
            os.kill(pids[0], signal.SIGKILL)  # the top process, as an OOM killer would
        # SIGKILL lands asynchronously: on a loaded machine the dying server could still answer
        # the request that follows. Wait until it is gone, so the fault is the same every run.
        deadline = time.monotonic() + 5
        while pids and time.monotonic() < deadline and _alive(pids[0]):
            time.sleep(0.02)
    log("injected", fault=FAULT, pids=pids)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][:1] not in ("Z", "X")
    except OSError:
        return False


def _wrap_trigger(adapter: Any, method: str, how: str) -> None:
    original = getattr(adapter, method)
    if getattr(original, "_chaos", False):
        return

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if _state["in_target"]:
            _state["calls"] += 1
            if _state["calls"] == int(CFG.get("at", 2)):
                _kill(adapter, how)
        return original(*args, **kwargs)

    wrapped._chaos = True  # type: ignore[attr-defined]
    setattr(adapter, method, wrapped)


# ---- a fake /metrics in front of the real one ----------------------------------------------
class _FakeMetrics(BaseHTTPRequestHandler):
    upstream = ""
    mode = ""

    def log_message(self, *args: Any) -> None:
        return

    def do_GET(self) -> None:
        real = requests.get(self.upstream, timeout=10).text
        mode = self.mode
        body = real
        if mode == "garbage":
            body = "<html><body><h1>502 Bad Gateway</h1></body></html>\n"
        elif mode == "truncated":
            cut = real.index("\nkvref_prefix_hits_total ") + len("\nkvref_prefix_hits_total ") + 1
            body = real[:cut]  # mid-line: `kvref_prefix_hits_total 1` of a larger number
        elif mode == "empty":
            body = ""
        elif mode == "slow":
            time.sleep(float(CFG.get("timeout_s", 3)) + 4)
        elif mode in ("nan", "negative"):
            value = "NaN" if mode == "nan" else "-0.5"
            lines = []
            for line in real.splitlines():
                if line.startswith("kvref_offload_usage_perc"):
                    line = line.rsplit(" ", 1)[0] + " " + value
                lines.append(line)
            body = "\n".join(lines) + "\n"
        data = body.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Connection", "close")  # close-delimited: a cut body is not detectable by length
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(data)
        self.close_connection = True


def _patch_metrics() -> None:
    """Every adapter's /metrics goes to the fake while the target check runs (its fixtures
    included: a sampler may scrape during set-up)."""
    from kvconform.kit.http_api import HttpApi

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeMetrics)
    _FakeMetrics.mode = FAULT.split(":", 1)[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    fake = f"http://127.0.0.1:{server.server_address[1]}"
    original = HttpApi.url

    def url(self: HttpApi, path: str, base: str | None = None) -> str:
        real = original(self, path, base)
        if path == "/metrics" and _state["in_target"]:
            _FakeMetrics.upstream = real
            if not _state.get("logged"):
                _state["logged"] = True
                log("injected", fault=FAULT)
            return fake + "/metrics"
        return real

    HttpApi.url = url  # type: ignore[method-assign]


# ---- KV-event frames mangled on their way in ------------------------------------------------
def _patch_events() -> None:
    from kvconform.kit.zmq_events import ZmqEventSubscriber

    original = ZmqEventSubscriber._accept
    held: dict[int, tuple[bytes, bytes]] = {}

    def accept(self: ZmqEventSubscriber, seq_bytes: bytes, payload: bytes) -> None:
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if not _state["in_target"] or seq < 1:
            return original(self, seq_bytes, payload)
        target = int(CFG.get("at", 3))
        if FAULT == "events:malformed" and seq in (target, target + 2):
            if not _state.get("logged"):
                _state["logged"] = True
                log("injected", fault=FAULT, seqs=[target, target + 2])
            return original(self, seq_bytes, b"\xc1\xc1 not msgpack")  # also what replay sends
        live = threading.current_thread() is self._thread
        if FAULT == "events:disorder" and live:
            if seq == target:
                held[seq] = (seq_bytes, payload)
                return None
            original(self, seq_bytes, payload)
            if seq == target + 1 and target in held:
                log("injected", fault=FAULT, seqs=[target + 1, target])
                original(self, *held.pop(target))
            return None
        return original(self, seq_bytes, payload)

    ZmqEventSubscriber._accept = accept  # type: ignore[method-assign]


# ---- launch-time faults -----------------------------------------------------------------------
def _patch_launch() -> None:
    import kvconform.adapters.reference.adapter as ref

    if FAULT == "startup_exit":
        real_server = ref.LaunchedServer

        def launched(engine: str, name: str, argv: list[str], *args: Any, **kwargs: Any) -> Any:
            log("injected", fault=FAULT)
            return real_server(engine, name, [sys.executable, "-c", CRASH_AT_START], *args, **kwargs)

        ref.LaunchedServer = launched  # type: ignore[assignment,misc]
    elif FAULT == "port_taken":
        real_free_port = ref.free_port

        def free_port() -> int:
            port = real_free_port()
            if _state["squatter"] is None:
                squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                squatter.bind(("127.0.0.1", port))
                squatter.listen(1)
                _state["squatter"] = squatter
                log("injected", fault=FAULT, port=port)
            return port

        ref.free_port = free_port


# ---- the machine: NVML, the results disk ---------------------------------------------------------
class _FakeNvml(types.ModuleType):
    """pynvml that fails at init ("nvml:init") or works, then fails on the Nth memory sample
    ("nvml:midsample", as when a GPU falls off the bus)."""

    class NVMLError(Exception):
        pass

    def __init__(self, mode: str) -> None:
        super().__init__("pynvml")
        self.mode = mode
        self.samples = 0

    def nvmlInit(self) -> None:
        if self.mode == "init":
            log("injected", fault=FAULT)
            raise self.NVMLError("Driver Not Loaded")

    def nvmlDeviceGetCount(self) -> int:
        return 1

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"gpu{i}"

    def nvmlDeviceGetName(self, handle: str) -> str:
        return "Fake H100"

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.0"

    def nvmlDeviceGetMemoryInfo(self, handle: str) -> Any:
        self.samples += 1
        if self.samples >= int(CFG.get("at", 3)):
            if self.samples == int(CFG.get("at", 3)):
                log("injected", fault=FAULT)
            raise self.NVMLError("GPU is lost")
        return types.SimpleNamespace(used=1 << 30, total=80 << 30)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: str) -> list[Any]:
        return []


if FAULT == "nvml:absent":
    sys.modules["pynvml"] = None  # type: ignore[assignment]  # import pynvml -> ImportError
elif FAULT.startswith("nvml:"):
    sys.modules["pynvml"] = _FakeNvml(FAULT.split(":", 1)[1])


@pytest.hookimpl(tryfirst=True)  # before kvconform writes results.json
def pytest_sessionfinish(session: pytest.Session) -> None:
    if FAULT != "disk_full":
        return
    from kvconform.plugin.session import results_dir

    log("injected", fault=FAULT)
    with contextlib.suppress(OSError), open(results_dir(session.config) / "filler", "wb") as fh:
        while True:
            fh.write(b"\0" * 65536)
            fh.flush()


def pytest_configure(config: pytest.Config) -> None:
    if FAULT in ("startup_exit", "port_taken"):
        _patch_launch()
    elif FAULT.startswith("events:"):
        _patch_events()
    elif FAULT.startswith("metrics:"):
        _patch_metrics()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _state["in_target"] = FAULT.startswith("metrics:") and CFG.get("check", "\0") in item.nodeid
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    adapter = _adapter(item)
    target = CFG.get("check", "\0") in item.nodeid
    _state["in_target"] = target
    if adapter is not None:
        if "timeout_s" in CFG:
            adapter.ctx.request_timeout_s = float(CFG["timeout_s"])
        pids = _engine_pids(adapter)
        log("sockets", check=item.nodeid, pids=pids, engine=listening(pids), suite=listening([os.getpid()]))
        if target:
            log("target", check=item.nodeid)
            if FAULT in ("kill", "stop", "kill_attached", "sigterm_suite"):
                _wrap_trigger(adapter, "serve_prompt", FAULT)
            elif FAULT == "kill_churn":
                _wrap_trigger(adapter, "churn_cycle", "kill")
    yield
    _state["in_target"] = False
