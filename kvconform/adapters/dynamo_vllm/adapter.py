"""Dynamo with a real model behind it: the frontend's KV router and one `python -m dynamo.vllm`
worker (vLLM 0.31.0 on CPU, ai-dynamo 1.6.1's vLLM pin) serving the tiny model with seeded
weights, so an answer depends on the KV it attends to.

The `dynamo` configuration runs mockers: vLLM's scheduler and KV manager simulated, no model,
synthetic tokens. What only a real worker can show is judged here: the answer served from
Dynamo's cache against the answer computed without it, whether a cache salt keeps two tenants
apart on a backend that hashes it (the mocker keys blocks by tokens alone, docs/findings.md),
eviction, and a long session on the worker's own block count. Everything else of Dynamo 1.6.1
is judged on `dynamo` (inventory.toml says where; aborts say why not here).

One worker: on a 2-core machine a second vLLM worker would only halve each one's CPU, and with
one worker a repeated prompt meets its own cache whatever the router decides.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from typing import ClassVar

from kvconform.adapters.dynamo.adapter import MODEL_NAME, DynamoAdapter
from kvconform.contract import (
    Capability,
    Deployment,
    EngineConfig,
    ModelShape,
    deployed_block_size,
)
from kvconform.errors import EngineError
from kvconform.kit.drivers import TORCHVISION_STANDIN_DIR, tiny_model_args

C = Capability
KV_CACHE_BYTES = 8 * 2**20  # 256 blocks of 32 tokens, as on `vllm`


class DynamoVllmAdapter(DynamoAdapter):
    name = "dynamo-vllm"
    env_spec = "dynamo-vllm"
    worker_label = "vllm"
    # vLLM 0.31.0 on CPU refuses block 16 at start (select_common_block_size, measured); 32 as on `vllm`
    deployment = Deployment(block_size=32, model=ModelShape(layers=2, kv_heads=2, head_dim=64, dtype_bytes=2))
    traits = replace(DynamoAdapter.traits, workers=1)  # its metric names are the frontend's
    capabilities = frozenset(
        {
            C.PREFIX_CACHE,
            C.PREFIX_HIT_COUNTERS,
            C.ANSWERS_FROM_KV,  # nvext.completion_token_ids, greedy; the tiny model's seeded weights
            C.CACHE_SALT,  # nvext.cache_salt -> the prompt's cache_salt (handlers.py _apply_nvext_cache_salt)
            C.FORCED_EVICTION,  # the worker's 256-block pool, filled through the frontend
            # the KV blocks requests hold in the worker, by vLLM's usage gauge x its pool blocks
            C.HOST_MEMORY,
            C.LONG_SESSION,
        }
    )

    # vllm:cache_config_info: the block size and pool the worker's vLLM resolved
    worker_metric_families: ClassVar[tuple[str, ...]] = (
        *DynamoAdapter.worker_metric_families,
        "vllm:cache_config_info",
    )

    @staticmethod
    def worker_roles(config: EngineConfig) -> list[str | None]:
        return [None]

    def worker_cache_config(self) -> dict[str, str]:
        """The worker's vllm:cache_config_info labels (vllm/v1/metrics/loggers.py), on its
        system port from its start."""
        labels = self.metrics().labels_of("vllm:cache_config_info")
        if not labels or not {"block_size", "num_gpu_blocks"} <= set(labels[0]):
            raise EngineError(
                self.name,
                f"the worker's vllm:cache_config_info lacks block_size/num_gpu_blocks: {labels[:1]}",
            )
        return labels[0]

    def resolved_block_size(self) -> int | None:
        """The block size the worker's vLLM resolved (its platform hooks may override the one
        asked for); judged against the request, never used as an oracle's block."""
        return None if self.ctx.attached else int(self.worker_cache_config()["block_size"])

    def worker_pool_blocks(self) -> int:
        return int(self.worker_cache_config()["num_gpu_blocks"])

    def model_args(self) -> list[str]:
        return tiny_model_args(self.deployment.model)

    def worker_args(self, index: int, role: str | None, block: int, config: EngineConfig) -> list[str]:
        """`python -m dynamo.vllm` with vLLM's own engine arguments, as `vllm serve` takes them
        on the `vllm` engine (prefix caching, an 8 MiB KV pool, eager mode)."""
        return [
            "-m",
            "dynamo.vllm",
            "--model",
            str(self.model_dir()),
            "--served-model-name",
            MODEL_NAME,
            "--dtype",
            "bfloat16",
            "--enable-prefix-caching",
            "--block-size",
            str(block),
            "--max-model-len",
            "2048",
            "--kv-cache-memory-bytes",
            str(KV_CACHE_BYTES),
            "--enforce-eager",
        ]

    def worker_env(self) -> dict[str, str]:
        """The torchvision stand-in; vLLM's IPC sockets in the system's temp directory, as
        `vllm serve` has them on `vllm`: the stack's own TMPDIR under a deep work directory
        makes their paths longer than a Unix socket allows (107 bytes; vLLM then fails to start)."""
        return {"PYTHONPATH": str(TORCHVISION_STANDIN_DIR), "VLLM_RPC_BASE_PATH": tempfile.gettempdir()}

    def kv_pool_bytes(self) -> int:
        return KV_CACHE_BYTES

    def cache_capacity_tokens(self) -> int:
        block = deployed_block_size(self)
        return self.kv_pool_bytes() // self.deployment.model.block_bytes(block) * block
