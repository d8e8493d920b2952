"""The reference engine's faults: one (at least) per check, each small and modelled on a real bug.

`killed_by` names the checks (glob patterns over check ids in results.json) that must fail
when the fault is injected; the mutation matrix (tests/test_mutation_matrix.py) proves it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    description: str
    killed_by: tuple[str, ...]
    modelled_on: str


FAULTS: dict[str, Fault] = {
    "hit_counter_drift": Fault(
        "the prefix-hit counter counts matched tokens before the last-token rule is applied",
        ("prefix_reuse::test_repeated_prompt_served_from_cache",),
        "counters and per-request usage computed on different paths (vLLM stats vs usage)",
    ),
    "reset_keeps_prefix": Fault(
        "reset_prefix_cache answers 200 but leaves the hash index in place",
        ("prefix_reuse::test_reset_drops_cached_prefix",),
        "vLLM reset_prefix_cache returning success while blocks are still referenced",
    ),
    "granularity_loss": Fault(
        "prefix lookup is all-or-nothing over the prompt's full blocks: a prefix shared up to a "
        "partial block hits 0",
        ("prefix_reuse::test_partial_block_prefix_hits_match_oracle*", "prefix_reuse::test_block_size_sweep"),
        "vllm-ascend #12589 / oMLX #3443: 0 % hits when the shared prefix is not block-aligned",
    ),
    "disk_index_lost": Fault(
        "the disk tier's index is not rebuilt on start: entries stay on disk but never hit",
        ("prefix_reuse::test_hits_survive_restart",),
        "LMCache LocalDiskBackend keeps its index in memory only (ENGINES.md)",
    ),
    "corrupt_hit_served": Fault(
        "disk entries are served without checking length or checksum",
        ("prefix_reuse::test_corrupt_persisted_entry_recomputed*",),
        "oMLX before 0.5.3 served a corrupt SSD entry as a hit",
    ),
    "stale_index_after_evict": Fault(
        "eviction reuses a block but leaves its hash in the prefix index",
        ("prefix_reuse::test_evicted_prefix_not_reported_as_hit",),
        "a prefix index not cleaned when blocks are evicted",
    ),
    "router_index_stale": Fault(
        "the router-side prefix index ignores removed events",
        ("prefix_reuse::test_router_prediction_matches_worker",),
        "Dynamo RadixTree dropping removals it cannot place (stale router state)",
    ),
    "leak_on_unregister": Fault(
        "unregister drops the instance from the registry but keeps its memory mapped",
        ("memory_reclaim::test_churn_returns_to_baseline[unregister]",),
        "LMCache #4015: imported KV stayed mapped after instances were released",
    ),
    "no_ipc_collect": Fault(
        "released imports wait for a collect step (torch.cuda.ipc_collect) that never runs",
        ("memory_reclaim::test_churn_returns_to_baseline[unregister]",),
        "LMCache #4015: _release_entries without empty_cache()/ipc_collect()",
    ),
    "double_unregister_crashes": Fault(
        "a second unregister of a released instance brings the server down",
        ("memory_reclaim::test_second_release_is_harmless",),
        "LMCache MP server: an error in a release path leaves the server unanswering",
    ),
    "session_growth": Fault(
        "each turn of a conversation keeps a private copy of its KV outside the block pool",
        ("memory_reclaim::test_long_session_bounded",),
        "oMLX 0.5.3: resident KV accumulated over multi-turn sessions",
    ),
    "failed_store_keeps_write_pending": Fault(
        "a failed offload store never releases its pending write",
        ("offload_metrics::test_failed_store_releases_pending_write",),
        "vLLM #47666 review: complete_store(success=False) path",
    ),
    "read_gauge_not_derived": Fault(
        "the read gauge is computed from its own counter at schedule time, not as usage - write",
        ("offload_metrics::test_gauges_consistent_under_load",),
        "vllm-ascend #10048: a read gauge of -0.39",
    ),
    "gauges_never_drain": Fault(
        "completed loads never unpin their host chunks, so usage never returns to 0",
        ("offload_metrics::test_gauges_drain_after_load",),
        "a transfer-pinning counter not decremented on completion",
    ),
    "offload_bytes_miscounted": Fault(
        "store/load byte counters count 2-byte elements as 4-byte ones",
        ("offload_metrics::test_offload_byte_counters_match_blocks",),
        "byte counters derived from the wrong dtype size",
    ),
    "host_hits_unreported": Fault(
        "blocks loaded back from the host tier are counted as computed, not as host hits",
        ("offload_metrics::test_offloaded_prefix_returns_as_host_hit",),
        "prompt_tokens_cached_by_source missing the host source",
    ),
    "tiered_usage_stale": Fault(
        "the L2 (disk) usage gauge is not updated when entries are written",
        ("offload_metrics::test_tiered_store_metrics_consistent",),
        "LMCache l2_usage_bytes counting only part of what is on disk",
    ),
    "pool_stats_inconsistent": Fault(
        "the free-block stat omits cached-but-free blocks, so used + free != max",
        ("offload_metrics::test_block_pool_stats_consistent",),
        "TensorRT-LLM kvCacheStats free vs reusable blocks",
    ),
    "transfer_bytes_ignore_fanout": Fault(
        "the sender counts transferred bytes once, whatever the number of destination replicas",
        (
            "transfer::test_transfer_bytes_reconcile[mla-4-*]",
            "transfer::test_transfer_bytes_reconcile[mla_state-4-*]",
        ),
        "SGLang get_transfer_metric before the fan-out fix (MLA replication)",
    ),
    "transfer_bytes_include_headers": Fault(
        "the sender counts wire bytes (payload + a 64-byte message header), not KV bytes",
        ("transfer::test_transfer_bytes_reconcile[*]",),
        "byte counters fed from the transport layer instead of the KV layout",
    ),
    "disagg_cached_tokens_lost": Fault(
        "requests served through prefill -> decode report 0 cached tokens, whatever the prefill reused",
        ("transfer::test_disaggregated_serving_reports_prefix_reuse",),
        "Dynamo 1.6.1 disaggregated mode: usage.cached_tokens always 0",
    ),
    "page_index_off_by_one": Fault(
        "page indices are computed as kv_index // page_size + 1",
        ("transfer::test_page_indices_match_oracle*",),
        "SGLang #31173: page indices computed on the host",
    ),
    "double_release_on_abort": Fault(
        "an aborted transfer's KV is released by the error path and again by the normal path",
        ("transfer::test_abort_releases_kv_once", "transfer::test_release_guard_holds"),
        "SGLang disaggregated prefill: double release_kv_cache on a grammar error",
    ),
    "event_seq_gap": Fault(
        "the event publisher consumes a sequence number for a batch it then drops",
        ("transfer::test_event_ledger_consistent",),
        "vLLM ZmqEventPublisher: seq taken before a send that fails",
    ),
}


def main() -> None:
    """`python -m kvconform.engines.reference.faults`: each fault and the checks that kill it."""
    for name, fault in FAULTS.items():
        print(f"{name:28s} killed by {', '.join(fault.killed_by)}\n{'':28s} {fault.description}")


if __name__ == "__main__":
    main()
