"""The receiving side of an SGLang PD transfer on CPU: what lands in the decode pool.

SGLang's decode instance keeps no count of the bytes it received: Mooncake writes straight
into its registered buffers and the decode side only polls for completion. So the receiver's
count is ours. SGLang's own MooncakeKVManager.send_kvcache (disaggregation/mooncake/conn.py)
runs its data plane against a decode pool: it groups the pages into contiguous runs
(group_concurrent_contiguous), pairs each layer's K and V buffers and scales by the item
lengths. Then we count the bytes of the pages the decode side reserved for the request that
hold the prefill's KV afterwards, page by page.

What it reads of SGLang 0.5.23 (disaggregation/mooncake/conn.py): send_kvcache (line 1346)
-> _send_kvcache_generic (1019: kv_args.kv_data_ptrs / kv_item_lens / kv_layer_ids,
is_mla_backend, is_hybrid_mla_backend, state_strides_validated, pp_size, enable_custom_mem_pool,
max_transfer_batch_indices) -> _transfer_data (817) -> engine.batch_transfer_sync; the K/V
pointer split is CommonKVManager.get_mha_kv_ptrs_with_pp (common/conn.py:1718, reads
kv_args.prefill_start_layer). A field a later release renames fails the op with its
AttributeError, never a count of 0.

Stubbed here:
- the Mooncake transfer engine. batch_transfer_sync is a memmove, and only into the decode
  pool's own buffers: an address outside them is counted, never written;
- MooncakeKVManager.__init__ (bootstrap, sockets, queues, worker threads). The manager is built
  empty and given only the fields send_kvcache reads.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
from typing import Any

import numpy as np
from sglang.srt.disaggregation.base.conn import KVArgs
from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager


class MemmoveTransferEngine:
    """Mooncake's batch_transfer_sync, as a copy within this process."""

    def __init__(self, regions: list[tuple[int, int]]) -> None:
        self.regions = regions
        self.bytes_outside_receiver = 0

    def batch_transfer_sync(
        self, session_id: str, src_addrs: list[int], dst_addrs: list[int], lengths: list[int]
    ) -> int:
        for src, dst, length in zip(src_addrs, dst_addrs, lengths, strict=True):
            if any(start <= dst and dst + length <= start + size for start, size in self.regions):
                ctypes.memmove(dst, src, length)
            else:
                self.bytes_outside_receiver += length
        return 0


def _fill(pool: Any, seed: int | None) -> None:
    """Random bytes (seed given) or zeros in every buffer of the pool."""
    ptrs, lens, _ = pool.get_contiguous_buf_infos()
    rng = np.random.default_rng(seed)
    for ptr, length in zip(ptrs, lens, strict=True):
        if seed is None:
            ctypes.memset(ptr, 0, length)
        else:
            ctypes.memmove(ptr, rng.integers(0, 256, length, dtype=np.uint8).tobytes(), length)


def _sender(src_pool: Any, is_mla: bool, engine: MemmoveTransferEngine) -> MooncakeKVManager:
    ptrs, _, item_lens = src_pool.get_contiguous_buf_infos()
    args = KVArgs()
    args.kv_data_ptrs = [int(p) for p in ptrs]
    args.kv_item_lens = [int(n) for n in item_lens]
    args.prefill_start_layer = 0
    args.kv_layer_ids = None
    mgr = MooncakeKVManager.__new__(MooncakeKVManager)  # stub: no __init__, see the docstring
    mgr.kv_args = args
    mgr.is_mla_backend = is_mla
    mgr.is_hybrid_mla_backend = False
    mgr.state_strides_validated = set()
    mgr.pp_size = 1
    mgr.enable_custom_mem_pool = False
    mgr.max_transfer_batch_indices = 0  # one batch per destination, SGLang's default
    mgr.engine = engine
    return mgr


def land(src_pool: Any, dst_pool: Any, src_pages: list[int], is_mla: bool, seed: int) -> dict:
    """send_kvcache from src_pool's pages into dst_pool's pages 1..n (what a fresh decode
    allocator hands out: page 0 is SGLang's padding slot); the bytes that arrived intact."""
    _fill(src_pool, seed)
    _fill(dst_pool, None)
    src_ptrs, _, item_lens = src_pool.get_contiguous_buf_infos()
    dst_ptrs, dst_lens, _ = dst_pool.get_contiguous_buf_infos()
    dst_pages = list(range(1, len(src_pages) + 1))
    engine = MemmoveTransferEngine([(int(p), int(n)) for p, n in zip(dst_ptrs, dst_lens, strict=True)])
    with concurrent.futures.ThreadPoolExecutor(1) as executor:
        status = _sender(src_pool, is_mla, engine).send_kvcache(
            "decode-0",
            np.asarray(src_pages, dtype=np.int32),
            [int(p) for p in dst_ptrs],
            np.asarray(dst_pages, dtype=np.int32),
            executor,
        )
    intact = 0
    for src, dst, item in zip(src_ptrs, dst_ptrs, item_lens, strict=True):
        for s, d in zip(src_pages, dst_pages, strict=True):
            if ctypes.string_at(src + s * item, item) == ctypes.string_at(dst + d * item, item):
                intact += int(item)
    return {
        "bytes_received": intact,
        "bytes_outside_receiver": engine.bytes_outside_receiver,
        "send_status": int(status),
    }
