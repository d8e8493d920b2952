"""A reference-engine adapter whose serving path also goes through a JSON-lines driver (one of
tests/fixtures/drivers), for the driver rows of the chaos table: the driver dies mid-request
or writes garbage on its pipe on the Nth prompt after a start (KVCONFORM_CHAOS_DRIVER=crash|
garbage, KVCONFORM_CHAOS_AT=N). Registered with
--adapter chaos-driver=tests.system.chaos.driver_adapter:ChaosDriverAdapter."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from kvconform.adapters.reference.adapter import ReferenceAdapter
from kvconform.contract import EngineConfig, ServedPrompt
from kvconform.kit.drivers import DriverProcess
from kvconform.processes import TeardownReport
from tests.paths import FIXTURES

DRIVERS = FIXTURES / "drivers"
SCRIPTS = {"crash": ("crash_driver.py", "store"), "garbage": ("garbage_driver.py", "stats")}


class ChaosDriverAdapter(ReferenceAdapter):
    name = "chaos-driver"
    driver: DriverProcess | None = None
    prompts_served = 0
    fired = False  # the fault strikes once per session: the relaunched driver behaves

    def start(self, config: EngineConfig) -> None:
        super().start(config)
        self.prompts_served = 0
        script, _ = SCRIPTS[os.environ.get("KVCONFORM_CHAOS_DRIVER", "crash")]
        self.driver = DriverProcess(
            self.name,
            Path(sys.executable),
            DRIVERS / script,
            self.ctx.workdir / "logs" / "driver.log",
            start_timeout_s=20,
        )

    def running(self) -> bool:
        return super().running() and self.driver is not None and self.driver.process.alive()

    def stop(self) -> list[TeardownReport]:
        reports = [self.driver.close()] if self.driver is not None else []
        self.driver = None
        return reports + super().stop()

    def serve_prompt(self, tokens: list[int], max_tokens: int = 1) -> ServedPrompt:
        self.prompts_served += 1
        at = int(os.environ.get("KVCONFORM_CHAOS_AT", "2"))
        if self.prompts_served == at and self.driver and not ChaosDriverAdapter.fired:
            ChaosDriverAdapter.fired = True
            _, op = SCRIPTS[os.environ.get("KVCONFORM_CHAOS_DRIVER", "crash")]
            self.driver.call(op, timeout_s=self.ctx.request_timeout_s)
        return super().serve_prompt(tokens, max_tokens)

    def engine_pids(self) -> list[int]:
        return super().engine_pids() + (self.driver.pids() if self.driver else [])
