"""Self-tests that launch a real engine run only where its environments are built."""

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


def skip_unless_built(*specs: str) -> pytest.MarkDecorator:
    missing = [s for s in specs if not built(s)]
    return pytest.mark.skipif(
        bool(missing), reason=f"environment(s) {', '.join(missing)} not built (kvconform env build)"
    )
