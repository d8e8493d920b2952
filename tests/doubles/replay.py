"""Test double for TRACE_REPLAY: an offline replay of a trace through an LRU block cache.

Not an engine. The contract is the one adapters/dynamo.py drives through Dynamo's offline
mocker replay (replay(trace, engine_args, mode, ...)):

  trace        [{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}],
               one hash id per block of block_size tokens, the partial last block included.
  engine_args  block_size, num_gpu_blocks, and in disagg mode kv_bytes_per_token and
               kv_transfer_bandwidth_gbps (decimal GB/s: 1 GB/s moves 1e6 bytes per ms).
  mode         "agg": one worker; "disagg": one prefill and one decode worker.

Requests run one at a time in arrival order, in simulated time. A request's cached prefix is
the longest run of its full blocks (a chain of hash ids from the first) present in the
worker's cache; a serving engine computes at least the last prompt token, so it reuses
min(cached, floor((n - 1) / block)) blocks. Its full blocks are then cached (LRU, capacity
num_gpu_blocks). In disagg mode the prefill worker hands the whole prompt's KV to the decode
worker: transfer_ms = n * kv_bytes_per_token / bandwidth; the destination is reserved when
prefill ends, activated when the transfer ends, and decode admits the request after that.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, ClassVar

from kvconform.contract import Capability
from kvconform.engines.reference.faults import Fault
from tests.doubles.base import DoubleAdapter

_REPLAY = ("prefix_reuse::test_trace_replay_reuse_matches_oracle",)
_HANDOFF = ("transfer::test_handoff_time_matches_bytes_over_bandwidth",)
DEFAULT_BYTES_PER_TOKEN = 131072  # a Llama-3-8B-like shape: 32 layers x 8 KV heads x 128 x bf16 x K,V
PREFILL_MS_PER_TOKEN = 0.01
PREFILL_OVERHEAD_MS = 1.0
DECODE_MS_PER_TOKEN = 1.0

FAULTS: dict[str, Fault] = {
    "partial_block_counted": Fault(
        "the partial last block is cached and matched like a full one, and reuse is counted in "
        "its tokens (capped at n - 1)",
        _REPLAY,
        "vllm-ascend #12589 / oMLX #3443 family: reuse accounted past block granularity",
        ("requests_off_oracle",),
    ),
    "no_last_token_rule": Fault(
        "a fully cached prompt reports every block reused, although its last token is computed",
        _REPLAY,
        "hit counters taken before the last-token rule (vLLM stats vs per-request usage)",
        ("requests_off_oracle",),
    ),
    "handoff_default_bytes_per_token": Fault(
        "the hand-off ignores the configured kv_bytes_per_token and uses a default model shape",
        _HANDOFF,
        "a mocker flag not forwarded to the disaggregated roles (defaults used instead)",
        ("handoffs_off_bytes_over_bandwidth",),
    ),
    "handoff_bandwidth_in_bits": Fault(
        "the link bandwidth is read as Gbit/s where GB/s was configured (transfers 8x slower)",
        _HANDOFF,
        "bits/bytes confusion in a link-bandwidth setting",
        ("handoffs_off_bytes_over_bandwidth",),
    ),
    "decode_before_transfer": Fault(
        "decode admits the request when the destination is reserved, before its KV has arrived",
        _HANDOFF,
        "decode scheduled on a reservation instead of the transfer's completion",
        ("handoffs_with_ordered_timestamps",),
    ),
}


class LruBlockCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.blocks: OrderedDict[tuple[int, ...], None] = OrderedDict()

    def cached_blocks(self, hash_ids: list[int], limit: int) -> int:
        n = 0
        while n < limit and tuple(hash_ids[: n + 1]) in self.blocks:
            self.blocks.move_to_end(tuple(hash_ids[: n + 1]))
            n += 1
        return n

    def store(self, hash_ids: list[int], count: int) -> None:
        for k in range(1, count + 1):
            self.blocks[tuple(hash_ids[:k])] = None
            self.blocks.move_to_end(tuple(hash_ids[:k]))
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class ReplayDouble(DoubleAdapter):
    """Test double (not an engine) for TRACE_REPLAY."""

    name = "testdouble_replay"
    capabilities = frozenset({Capability.TRACE_REPLAY})
    faults: ClassVar[dict[str, Fault]] = FAULTS

    def replay(
        self, trace: list[dict[str, Any]], engine_args: dict[str, Any], mode: str = "agg", **options: Any
    ) -> dict[str, Any]:
        if mode not in ("agg", "disagg"):
            raise ValueError("mode must be 'agg' or 'disagg'")
        workers = [options.get(k, 1) for k in ("num_workers", "num_prefill_workers", "num_decode_workers")]
        if any(int(w) != 1 for w in workers) or options.get("replay_concurrency", 1) not in (1, None):
            raise NotImplementedError("the replay double runs one worker per role, one request at a time")
        block = int(engine_args.get("block_size", 16))
        cache = LruBlockCache(int(engine_args.get("num_gpu_blocks", 4096)))
        bytes_per_token = engine_args.get("kv_bytes_per_token")
        bandwidth = engine_args.get("kv_transfer_bandwidth_gbps")
        if mode == "disagg" and (not bytes_per_token or not bandwidth):
            raise ValueError("disagg replay needs kv_bytes_per_token and kv_transfer_bandwidth_gbps")
        if self.fault == "handoff_default_bytes_per_token":
            bytes_per_token = DEFAULT_BYTES_PER_TOKEN
        bytes_per_ms = None if not bandwidth else float(bandwidth) * 1e6
        if bytes_per_ms and self.fault == "handoff_bandwidth_in_bits":
            bytes_per_ms /= 8
        now, rows = 0.0, []
        for index, req in sorted(enumerate(trace), key=lambda p: (p[1].get("timestamp", 0), p[0])):
            n, hash_ids = int(req["input_length"]), [int(h) for h in req["hash_ids"]]
            reused = self._reused_tokens(cache, hash_ids, n, block)
            cache.store(hash_ids, len(hash_ids) if self.fault == "partial_block_counted" else n // block)
            arrival = float(req.get("timestamp", 0))
            start = max(now, arrival)
            prefill_end = start + PREFILL_OVERHEAD_MS + (n - reused) * PREFILL_MS_PER_TOKEN
            handoff = None
            decode_start = prefill_end
            if mode == "disagg":
                assert bytes_per_ms is not None
                reserved = prefill_end
                activated = reserved + n * float(bytes_per_token) / bytes_per_ms
                admit = reserved if self.fault == "decode_before_transfer" else activated
                handoff = {
                    "prefill_admit_ms": start,
                    "source_held_ms": prefill_end,
                    "destination_reserved_ms": reserved,
                    "destination_activated_ms": activated,
                    "source_released_ms": activated,
                    "decode_admit_ms": admit,
                    "transfer_ms": activated - reserved,
                }
                decode_start = max(admit, activated)
            end = decode_start + int(req["output_length"]) * DECODE_MS_PER_TOKEN
            now = end
            rows.append(
                {
                    "index": index,
                    "arrival_time_ms": arrival,
                    "input_length": n,
                    "output_length": int(req["output_length"]),
                    "reused_input_tokens": reused,
                    "ttft_ms": prefill_end - arrival,
                    "e2e_latency_ms": end - arrival,
                    "terminal_status": "completed",
                    "handoff": handoff,
                }
            )
        total_in = sum(r["input_length"] for r in rows)
        return {
            "source": "trace",
            "mode": mode,
            "block_size": block,
            "kv_bytes_per_token": bytes_per_token,
            "kv_transfer_bandwidth_gbps": bandwidth,
            "bandwidth_bytes_per_ms": bytes_per_ms,
            "summary": {
                "num_requests": len(rows),
                "completed_requests": len(rows),
                "total_input_tokens": total_in,
                "prefix_cache_reused_ratio": sum(r["reused_input_tokens"] for r in rows) / max(total_in, 1),
                "duration_ms": now,
            },
            "requests": rows,
        }

    def _reused_tokens(self, cache: LruBlockCache, hash_ids: list[int], n: int, block: int) -> int:
        if self.fault == "partial_block_counted":
            matched = cache.cached_blocks(hash_ids, len(hash_ids))
            tokens = sum(min(block, n - k * block) for k in range(matched))
            return min(tokens, n - 1)
        matched = cache.cached_blocks(hash_ids, n // block)
        if self.fault == "no_last_token_rule":
            return matched * block
        return min(matched, (n - 1) // block) * block
