"""An engine server process the suite owns, and its health wait."""

from __future__ import annotations

import contextlib
from pathlib import Path

import requests

from kvconform import timing
from kvconform.processes import TeardownReport


def wait_http_ok(session: requests.Session, url: str, timeout: float = 2.0) -> bool:
    with contextlib.suppress(requests.RequestException):
        return session.get(url, timeout=timeout).status_code == 200
    return False


class LaunchedServer:
    """One engine server process the suite owns: launch, health wait, teardown report."""

    def __init__(
        self,
        engine: str,
        name: str,
        argv: list[str],
        workdir: Path,
        health_url: str,
        env: dict[str, str] | None = None,
        timeout_s: float = 300.0,
        shm_patterns: tuple[str, ...] = (),
        session: requests.Session | None = None,
        stop_whole_group: bool = True,
    ) -> None:
        from kvconform.processes import EngineProcess, wait_until_ready

        self.engine = engine
        # timed here too: a churn cycle restarts servers inside the adapter, past ensure()
        with timing.starting(engine):
            self.process = EngineProcess(
                name,
                argv,
                workdir / "logs" / f"{name}.log",
                env=env,
                shm_patterns=shm_patterns,
                stop_whole_group=stop_whole_group,
            )
            http = session or requests.Session()
            self.ready_after_s = wait_until_ready(
                self.process, engine, lambda: wait_http_ok(http, health_url), timeout_s, what=health_url
            )

    def stop(self) -> TeardownReport:
        with timing.stopping(self.engine):
            return self.process.stop()

    def pids(self) -> list[int]:
        return self.process.pids()

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines)
