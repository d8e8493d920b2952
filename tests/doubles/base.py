"""The common base of the test doubles: an EngineAdapter that launches nothing."""

from __future__ import annotations

import os
from typing import ClassVar

from kvconform.contract import AdapterContext, EngineAdapter, EngineConfig
from kvconform.engines.reference.faults import Fault
from tests.doubles import FAULT_ENV


class DoubleAdapter(EngineAdapter):
    """A test double, not an engine: in-process, nothing to start, one optional fault.

    Subclasses declare only the capabilities they implement and their `faults`; the fault named
    by KVCONFORM_DOUBLE_FAULT is active when it is one of this double's faults.
    """

    faults: ClassVar[dict[str, Fault]] = {}

    def __init__(self, ctx: AdapterContext) -> None:
        super().__init__(ctx)
        wanted = os.environ.get(FAULT_ENV, "")
        self.fault: str | None = wanted if wanted in self.faults else None

    @property
    def version(self) -> str:
        return f"test double ({self.fault or 'no fault'})"

    def start(self, config: EngineConfig) -> None:
        self.config = config  # nothing to launch

    def engine_pids(self) -> list[int]:
        return []
