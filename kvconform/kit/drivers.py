"""Client side of the JSON-lines driver protocol (see engine_side/jsonl_loop.py).

A driver is a small program run with an engine environment's interpreter, for engines whose
APIs are in-process only. Every call has a timeout: a hung engine becomes an error naming the
engine, the op and the driver's log tail, never a hung suite.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvconform import timing
from kvconform.errors import DriverError, EngineStartError
from kvconform.processes import EngineProcess, TeardownReport

if TYPE_CHECKING:
    from kvconform.contract import ModelShape

# Modules a driver may import inside its engine's environment (jsonl_loop, make_tiny_model):
# on the driver's PYTHONPATH, beside the folder of the driver script itself.
ENGINE_SIDE_DIR = Path(__file__).resolve().parent / "engine_side"
# A `torchvision` whose imports succeed and whose calls raise (its docstring says why): on
# PYTHONPATH only where a CPU engine imports image helpers it never runs.
TORCHVISION_STANDIN_DIR = ENGINE_SIDE_DIR / "standins"


# make_tiny_model.py's --weights: the tiny model served with seeded weights under which an
# answer depends on the KV it attends to (the dummy format's answers do not).
TINY_MODEL_WEIGHTS = ("--weights", "0")


def tiny_model_args(shape: ModelShape) -> list[str]:
    """make_tiny_model.py's arguments for a model of `shape` (as many query heads as KV heads)
    with the seeded weights."""
    return [
        *("--layers", str(shape.layers), "--heads", str(shape.kv_heads)),
        *("--kv-heads", str(shape.kv_heads), "--head-dim", str(shape.head_dim)),
        *TINY_MODEL_WEIGHTS,
    ]


def engine_side_script(name: str) -> Path:
    return ENGINE_SIDE_DIR / name


def with_engine_side_path(env: dict[str, str] | None) -> dict[str, str]:
    """`env` with engine_side/ on PYTHONPATH (after what the caller put there)."""
    out = dict(env or {})
    out["PYTHONPATH"] = os.pathsep.join(filter(None, [out.get("PYTHONPATH"), str(ENGINE_SIDE_DIR)]))
    return out


def live_driver(current: DriverProcess | None, start: Callable[[], DriverProcess]) -> DriverProcess:
    """`current` while its process lives, else a new driver from `start`: a driver that died (a
    crash the last call reported) is replaced for the next call, its log kept."""
    if current is not None and current.process.alive():
        return current
    return start()


SHUTDOWN_EXIT_S = 10.0  # a driver's own exit after `shutdown`


class DriverProcess:
    def __init__(
        self,
        engine: str,
        python: Path,
        script: Path,
        log_path: Path,
        env: dict[str, str] | None = None,
        start_timeout_s: float = 180.0,
        shm_patterns: tuple[str, ...] = (),
    ) -> None:
        self.engine = engine
        self.process = EngineProcess(
            f"{engine}-driver",
            [str(python), "-u", str(script)],
            log_path,
            env=with_engine_side_path({"PYTHONUNBUFFERED": "1", **(env or {})}),
            stdin_pipe=True,
            stdout_pipe=True,
            shm_patterns=shm_patterns,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._ids = itertools.count(1)
        threading.Thread(target=self._pump, daemon=True).start()
        try:
            hello = self._next_line(start_timeout_s, "start")
            if not hello.get("ready"):
                raise EngineStartError(engine, f"driver said {hello!r} instead of ready", self.log_tail())
        except Exception:
            self.process.stop(grace_s=2)  # nobody else holds this driver to close it
            raise
        self.version: str = hello.get("version", "unknown")

    def _pump(self) -> None:
        assert self.process.popen.stdout is not None
        for raw in self.process.popen.stdout:
            self._lines.put(raw.decode("utf-8", "replace"))
        self._lines.put(None)

    def _next_line(self, timeout_s: float, op: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            tail = self.log_tail()
            self.process.stop(grace_s=2)
            raise DriverError(self.engine, f"driver op {op!r} hung for {timeout_s:.0f}s", tail) from None
        if line is None:
            code = self.process.popen.wait(timeout=10)
            raise DriverError(
                self.engine, f"driver exited with code {code} during op {op!r}", self.log_tail()
            )
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            # Its channel is out of step now (a late reply would answer the next request):
            # stop it, so the adapter sees a dead driver and relaunches it for the next check.
            tail = self.log_tail()
            self.process.stop(grace_s=2)
            raise DriverError(
                self.engine, f"driver wrote a non-protocol line during {op!r}: {line[:200]!r}", tail
            ) from None

    def call(self, op: str, timeout_s: float = 120.0, **args: Any) -> Any:
        if not self.process.alive():
            raise DriverError(self.engine, f"driver is not running (op {op!r})", self.log_tail())
        req_id = next(self._ids)
        stdin = self.process.popen.stdin
        assert stdin is not None
        try:
            stdin.write((json.dumps({"id": req_id, "op": op, "args": args}) + "\n").encode())
            stdin.flush()
        except BrokenPipeError:
            raise DriverError(self.engine, f"driver closed its input (op {op!r})", self.log_tail()) from None
        with timing.engine_call(self.engine):
            reply = self._next_line(timeout_s, op)
        if reply.get("id") != req_id:
            tail = self.log_tail()
            self.process.stop(grace_s=2)  # out of step, as above
            raise DriverError(self.engine, f"reply id {reply.get('id')} for request {req_id} ({op})", tail)
        if not reply.get("ok"):
            raise DriverError(
                self.engine, f"op {op!r} failed: {reply.get('error')}", reply.get("traceback", "")
            )
        return reply.get("result")

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines)

    def pids(self) -> list[int]:
        return self.process.pids()

    def close(self) -> TeardownReport:
        if self.process.alive():
            with contextlib.suppress(Exception):
                self.call("shutdown", timeout_s=10)
            # Its exit runs the engine's own cleanup (LMCache's finalizers unlink the client's
            # shm segments): let it finish before any signal. Signalled at once after the
            # reply, a loaded runner's LMCache client died with -15 and left 2 x 4 MiB.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.popen.wait(timeout=SHUTDOWN_EXIT_S)
        return self.process.stop(grace_s=10)
