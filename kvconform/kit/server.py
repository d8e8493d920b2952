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
        wait: bool = True,
        death_lines: tuple[str, ...] = (),
    ) -> None:
        """`wait=False`: launched, not waited for; `wait_ready()` waits (servers that must
        start side by side, e.g. a pair whose first busy-polls once up)."""
        from kvconform.processes import EngineProcess

        self.engine = engine
        self._health_url = health_url
        self._timeout_s = timeout_s
        self._http = session or requests.Session()
        self.ready_after_s: float | None = None
        # timed here too: a churn cycle restarts servers inside the adapter, past ensure()
        with timing.starting(engine):
            self.process = EngineProcess(
                name,
                argv,
                workdir / "logs" / f"{name}.log",
                env=env,
                shm_patterns=shm_patterns,
                stop_whole_group=stop_whole_group,
                death_lines=death_lines,
            )
            if wait:
                self.wait_ready()

    def wait_ready(self) -> None:
        from kvconform.processes import wait_until_ready

        with timing.starting(self.engine):
            self.ready_after_s = wait_until_ready(
                self.process,
                self.engine,
                lambda: wait_http_ok(self._http, self._health_url),
                self._timeout_s,
                what=self._health_url,
            )

    def stop(self) -> TeardownReport:
        with timing.stopping(self.engine):
            return self.process.stop()

    def pids(self) -> list[int]:
        return self.process.pids()

    def log_tail(self, lines: int = 40) -> str:
        return self.process.log_tail(lines)
