"""Contract tests: the TensorRT-LLM and oMLX adapters against local fakes shaped like the real
servers. They run on any CPU machine and never count as a run of an engine (their records
carry engine "-").

    .venv/bin/pytest tests/adapters/contract -q
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvconform.adapters.omlx.adapter import OmlxAdapter
from kvconform.adapters.trtllm.adapter import TrtllmAdapter
from kvconform.contract import AdapterContext
from tests.adapters.contract.fake_omlx import FakeOmlx
from tests.adapters.contract.fake_trtllm import FakeTrtllm
from tests.paths import REPO

REPO_ROOT = REPO


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "contract: adapter contract test against a local fake server")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.contract)


@pytest.fixture
def fake_trtllm() -> Iterator[FakeTrtllm]:
    server = FakeTrtllm()
    yield server
    server.close()


@pytest.fixture
def fake_omlx() -> Iterator[FakeOmlx]:
    server = FakeOmlx()
    yield server
    server.close()


@pytest.fixture
def trtllm(fake_trtllm: FakeTrtllm, tmp_path: Path) -> Iterator[TrtllmAdapter]:
    adapter = TrtllmAdapter(AdapterContext(workdir=tmp_path, url=fake_trtllm.url, request_timeout_s=5))
    yield adapter
    adapter.close()


@pytest.fixture
def omlx(fake_omlx: FakeOmlx, tmp_path: Path) -> Iterator[OmlxAdapter]:
    adapter = OmlxAdapter(AdapterContext(workdir=tmp_path, url=fake_omlx.url, request_timeout_s=5))
    yield adapter
    adapter.close()
