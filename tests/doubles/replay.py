"""Test double for TRACE_REPLAY: an offline replay of a trace through an LRU block cache.

Not an engine. The contract is the TraceReplay facet (kvconform.contract.facets), which
Dynamo's adapter maps onto its offline mocker replay: one worker per role ("agg": one worker;
disaggregated: one prefill and one decode worker), a trace of requests named block by block.

Requests run one at a time in arrival order, in simulated time. A request's cached prefix is
the longest run of its full blocks (a chain of hash ids from the first) present in the
worker's cache; a serving engine computes at least the last prompt token, so it reuses
min(cached, floor((n - 1) / block)) blocks. Its full blocks are then cached (LRU, capacity
cache_blocks). In disagg mode the prefill worker hands the whole prompt's KV to the decode
worker: transfer_ms = n * kv_bytes_per_token / bandwidth; the destination is reserved when
prefill ends, activated when the transfer ends, and decode admits the request after that.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import ClassVar

from kvconform.contract import (
    Capability,
    Handoff,
    ReplayedRequest,
    ReplaySetup,
    TracedRequest,
    TraceReplay,
    provides,
)
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

    @provides(TraceReplay)
    def trace_replay(self) -> TraceReplay:
        return LruReplay(self.fault)


class LruReplay(TraceReplay):
    simulates_handoff = True

    def __init__(self, fault: str | None) -> None:
        self.fault = fault

    def replay(self, trace: list[TracedRequest], setup: ReplaySetup) -> list[ReplayedRequest]:
        block = setup.block_size
        cache = LruBlockCache(setup.cache_blocks)
        bytes_per_token = setup.kv_bytes_per_token
        if setup.disaggregated and (not bytes_per_token or not setup.link_gbps):
            raise ValueError("a disaggregated replay needs kv_bytes_per_token and link_gbps")
        if self.fault == "handoff_default_bytes_per_token":
            bytes_per_token = DEFAULT_BYTES_PER_TOKEN
        bytes_per_ms = setup.link_gbps * 1e6
        if self.fault == "handoff_bandwidth_in_bits":
            bytes_per_ms /= 8
        now, rows = 0.0, []
        for req in sorted(trace, key=lambda r: r.arrival_ms):
            n, block_ids = req.input_length, list(req.block_ids)
            reused = self._reused_tokens(cache, block_ids, n, block)
            cache.store(block_ids, len(block_ids) if self.fault == "partial_block_counted" else n // block)
            start = max(now, req.arrival_ms)
            prefill_end = start + PREFILL_OVERHEAD_MS + (n - reused) * PREFILL_MS_PER_TOKEN
            handoff = None
            decode_start = prefill_end
            if setup.disaggregated:
                reserved = prefill_end
                activated = reserved + n * bytes_per_token / bytes_per_ms
                admit = reserved if self.fault == "decode_before_transfer" else activated
                handoff = Handoff(activated - reserved, reserved, activated, admit)
                decode_start = max(admit, activated)
            now = decode_start + req.output_length * DECODE_MS_PER_TOKEN
            rows.append(ReplayedRequest(req.arrival_ms, n, reused, True, handoff))
        return rows

    def _reused_tokens(self, cache: LruBlockCache, block_ids: list[int], n: int, block: int) -> int:
        if self.fault == "partial_block_counted":
            matched = cache.cached_blocks(block_ids, len(block_ids))
            tokens = sum(min(block, n - k * block) for k in range(matched))
            return min(tokens, n - 1)
        matched = cache.cached_blocks(block_ids, n // block)
        if self.fault == "no_last_token_rule":
            return matched * block
        return min(matched, (n - 1) // block) * block
