"""What one run of the corpus says of one bug: each release's side, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvconform.history.corpus import Defect


@dataclass
class Side:
    """One release of one bug: what the measure read, and whether it held."""

    version: str
    held: bool | None = None  # None: not judged
    values: list[Any] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)
    why: str = ""  # why not judged


@dataclass
class Verdict:
    defect: Defect
    bad: Side
    fixed: Side

    @property
    def status(self) -> str:
        if self.bad.held is None or self.fixed.held is None:
            return "not judged"
        if self.bad.held:
            return "missed"
        return "caught" if self.fixed.held else "fixed fails"
