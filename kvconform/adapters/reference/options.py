"""The reference engine's own pytest options (pytest11 entry point `kvconform-reference`):
`--fault NAME` injects one of its faults. Validated only when kvconform is active."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.getgroup("kvconform").addoption(
        "--fault",
        action="append",
        default=[],
        metavar="NAME",
        help="inject a reference-engine fault, repeatable (python -m kvconform.engines.reference.faults)",
    )


@pytest.hookimpl(tryfirst=True)  # before kvconform's configure probes the engines
def pytest_configure(config: pytest.Config) -> None:
    faults = config.getoption("--fault")
    if not faults:
        return
    if config.getoption("--engine") not in ([], ["reference"]) or config.getoption("--adapter"):
        raise pytest.UsageError("kvconform: --fault applies to the reference engine only")
    from kvconform.engines.reference.faults import FAULTS

    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise pytest.UsageError(f"kvconform: unknown fault(s) {unknown} (known: {', '.join(FAULTS)})")
