"""dynamo-vllm: the worker it launches and the answer it reads, without launching anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconform.adapters.dynamo.adapter import DynamoAdapter
from kvconform.adapters.dynamo_vllm.adapter import KV_CACHE_BYTES, DynamoVllmAdapter
from kvconform.contract import AdapterContext, EngineConfig
from kvconform.errors import EngineError
from kvconform.kit.drivers import TORCHVISION_STANDIN_DIR
from kvconform.metrics import MetricSnapshot


@pytest.fixture
def engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> DynamoVllmAdapter:
    adapter = DynamoVllmAdapter(AdapterContext(workdir=tmp_path))
    monkeypatch.setattr(adapter, "model_dir", lambda: tmp_path / "model")
    return adapter


def test_the_worker_is_vllm_at_the_requested_block_with_the_suites_pool(engine: DynamoVllmAdapter) -> None:
    args = engine.worker_args(0, None, 64, EngineConfig(block_size=64))
    assert args[:2] == ["-m", "dynamo.vllm"]
    assert args[args.index("--block-size") + 1] == "64"
    assert args[args.index("--kv-cache-memory-bytes") + 1] == str(KV_CACHE_BYTES)
    assert "--enable-prefix-caching" in args
    assert engine.worker_roles(EngineConfig()) == [None]


def test_the_worker_gets_the_standin_and_short_ipc_paths(engine: DynamoVllmAdapter) -> None:
    env = engine.worker_env()
    assert env["PYTHONPATH"] == str(TORCHVISION_STANDIN_DIR)
    assert (TORCHVISION_STANDIN_DIR / "torchvision" / "__init__.py").is_file()
    # vLLM's IPC socket paths must fit a Unix socket's 107 bytes whatever the work directory
    assert len(env["VLLM_RPC_BASE_PATH"]) + len("/00000000-0000-0000-0000-000000000000") <= 107


def test_the_model_is_the_seeded_weight_one(engine: DynamoVllmAdapter) -> None:
    assert "--weights" in engine.model_args()
    assert DynamoAdapter(AdapterContext(workdir=Path("."))).model_args() == []


def test_requests_are_greedy_and_ask_for_the_answers_ids(engine: DynamoVllmAdapter) -> None:
    body = engine.completion_body([11, 12], 8)
    assert body["temperature"] == 0
    assert "completion_token_ids" in body["nvext"]["extra_fields"]


def test_the_answer_is_read_from_nvext(engine: DynamoVllmAdapter) -> None:
    data = {
        "choices": [{"text": " w1 w2"}],
        "usage": {"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}},
        "nvext": {"completion_token_ids": [5, 6]},
    }
    served = engine.served_from_openai(data, list(range(40)))
    assert (served.prompt_tokens, served.cached_tokens, served.output) == (40, 32, [5, 6])


def cache_config(**labels: str) -> MetricSnapshot:
    snap = MetricSnapshot(taken_at=0.0)
    snap.samples["vllm:cache_config_info"] = {frozenset({*labels.items(), ("mocker", "0")}): 1.0}
    return snap


def test_block_size_and_pool_are_the_workers_own(
    engine: DynamoVllmAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine, "metrics", lambda: cache_config(block_size="128", num_gpu_blocks="64"))
    assert engine.resolved_block_size() == 128
    assert engine.worker_pool_blocks() == 64


def test_a_worker_that_does_not_say_is_an_error(
    engine: DynamoVllmAdapter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine, "metrics", lambda: cache_config(block_size="32"))
    with pytest.raises(EngineError, match="num_gpu_blocks"):
        engine.worker_pool_blocks()
