"""pytest plugin that registers the test doubles as extra engines, for this pytest run only.

    python -m pytest kvconform/suites/... --engine testdouble_radix_cache -p tests.doubles.plugin

Without `-p tests.doubles.plugin` the doubles do not exist: a normal run can never select one,
and no result of a double can pass for a run of an engine. KVCONFORM_DOUBLE_FAULT names the one
fault to inject (see each double's FAULTS); an unknown name stops the session.
"""

from __future__ import annotations

import os

import pytest

from kvconform import registry
from tests.doubles import DOUBLES, FAULT_ENV, faults_by_double


@pytest.hookimpl(tryfirst=True)  # before kvconform's pytest_configure validates --engine
def pytest_configure(config: pytest.Config) -> None:
    fault = os.environ.get(FAULT_ENV, "")
    known = {f for faults in faults_by_double().values() for f in faults}
    if fault and fault not in known:
        raise pytest.UsageError(f"{FAULT_ENV}={fault!r} is no test-double fault (known: {sorted(known)})")
    known_engines = registry.adapters()
    clash = {n for n in set(DOUBLES) & set(known_engines) if known_engines[n] != DOUBLES[n]}
    if clash:
        raise pytest.UsageError(f"test doubles would shadow real engines: {sorted(clash)}")
    for name, target in DOUBLES.items():
        registry.register(name, target)


def pytest_unconfigure(config: pytest.Config) -> None:
    for name in DOUBLES:
        registry.unregister(name)
