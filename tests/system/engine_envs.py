"""Self-tests that launch a real engine run only where its environments are built.

They carry the `engine_env` mark: `make test` runs the other self-tests while the engine
environments build, and these after (Makefile `selftest-harness` / `selftest-engines`)."""

from __future__ import annotations

import pytest

from kvconform import envs
from kvconform.errors import UsageError


def built(spec: str) -> bool:
    try:
        envs.find(spec)
    except UsageError:
        return False
    return True


def skip_unless_built(*specs: str) -> list[pytest.MarkDecorator]:
    missing = [s for s in specs if not built(s)]
    return [
        pytest.mark.engine_env,
        pytest.mark.skipif(
            bool(missing), reason=f"environment(s) {', '.join(missing)} not built (kvconform env build)"
        ),
    ]
