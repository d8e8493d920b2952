"""Driver: vLLM's v1 Scheduler and KV cache manager, in-process, without a model.

Run with the vLLM environment's interpreter. The scheduler is built as EngineCore builds it
(vllm/v1/engine/core.py: the engine config from EngineArgs, num_gpu_blocks set on the cache
config, the request block hasher over init_none_hash), with a KV cache of `num_blocks` blocks
of one full-attention group: no tensors, since no model step runs. A request is scheduled
(its blocks allocated) and released through Scheduler.finish_requests(FINISHED_ABORTED), the
call EngineCore.abort_requests makes when the API server aborts a request (a client that
disconnects), then released again the same way: the abort that arrives after the request is
gone (vllm-project/vllm#25067).

Ops: info, release_twice.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jsonl_loop import serve

ENGINE = "vllm-scheduler"
_schedulers: dict[tuple[str, int, int], Any] = {}


def _version() -> str:
    from importlib.metadata import version

    return f"vllm {version('vllm')}"


def _scheduler(model: str, block_size: int, num_blocks: int, dtype: str, kv_heads: int, head_dim: int) -> Any:
    key = (model, block_size, num_blocks)
    if key not in _schedulers:
        import torch
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        config = EngineArgs(
            model=model, block_size=block_size, enable_prefix_caching=True, dtype=dtype, max_model_len=2048
        ).create_engine_config()
        config.cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=kv_heads, head_size=head_dim, dtype=getattr(torch, dtype)
        )
        kv_cache = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
        )
        _schedulers[key] = Scheduler(config, kv_cache, StructuredOutputManager(config), block_size=block_size)
    return _schedulers[key]


def op_info() -> dict[str, Any]:
    return {"version": _version()}


def op_release_twice(
    model: str,
    block_size: int,
    num_blocks: int,
    dtype: str,
    kv_heads: int,
    head_dim: int,
    request_id: str,
    token_ids: list[int],
) -> dict[str, Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request, RequestStatus

    scheduler = _scheduler(model, block_size, num_blocks, dtype, kv_heads, head_dim)
    pool = scheduler.kv_cache_manager.block_pool
    hash_fn = get_hash_fn_by_name(scheduler.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    request = Request(
        request_id,
        list(token_ids),
        SamplingParams(max_tokens=4),
        None,
        block_hasher=get_request_block_hasher(block_size, hash_fn),
    )
    scheduler.add_request(request)
    scheduler.schedule()  # allocates the request's blocks, as the engine's next step does
    held = pool.get_num_free_blocks()
    first = scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
    after_first = pool.get_num_free_blocks()
    try:
        second = scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
    except Exception as exc:  # an assertion here ends EngineCore's busy loop
        return {
            "first_freed_tokens": (after_first - held) * block_size,
            "second_outcome": "crashed",
            "free_delta_on_second": pool.get_num_free_blocks() - after_first,
            "detail": f"{type(exc).__name__}: {exc}; {traceback.format_exc(limit=3)[-600:]}",
        }
    after_second = pool.get_num_free_blocks()
    return {
        "first_freed_tokens": (after_first - held) * block_size,
        "second_outcome": "ignored" if not second else "ran_again",
        "free_delta_on_second": after_second - after_first,
        "detail": f"first abort returned {len(first)} request(s), the second {len(second)}",
    }


def main() -> None:
    serve(ENGINE, _version(), {"info": op_info, "release_twice": op_release_twice})


if __name__ == "__main__":
    main()
