"""The seventh engine's adapter (examples/llamacpp_adapter, llama.cpp's llama-server, out of
tree): registration accepts it and its environment spec parses, without building llama.cpp
(`make example-llamacpp` builds it and runs the suites; docs/engines.md has the numbers)."""

from __future__ import annotations

import sys
import tomllib
from collections.abc import Iterator

import pytest

from kvconform.contract.requirements import describe_missing
from tests.paths import REPO

EXAMPLE = REPO / "examples" / "llamacpp_adapter"


@pytest.fixture
def adapter_class(monkeypatch: pytest.MonkeyPatch) -> Iterator[type]:
    monkeypatch.syspath_prepend(str(EXAMPLE))
    from kvconform_llamacpp.adapter import LlamaCppAdapter

    yield LlamaCppAdapter
    for name in [m for m in sys.modules if m.startswith("kvconform_llamacpp")]:
        del sys.modules[name]


def test_registration_accepts_the_llamacpp_adapter(adapter_class: type) -> None:
    assert describe_missing("llamacpp", adapter_class) is None
    assert adapter_class.deployment.block_size == 1  # token-granular slot reuse, no blocks


def test_the_entry_point_and_env_spec_ship_with_the_package() -> None:
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["kvconform.adapters"] == {
        "llamacpp": "kvconform_llamacpp.adapter:LlamaCppAdapter"
    }
    assert "envs/*.toml" in project["tool"]["setuptools"]["package-data"]["kvconform_llamacpp"]
    spec = tomllib.loads((EXAMPLE / "kvconform_llamacpp" / "envs" / "llamacpp.toml").read_text())
    assert spec["engine"] == "llamacpp" and spec["version_probe"].strip()
    assert all("pip" in step or "run" in step for step in spec["steps"])
