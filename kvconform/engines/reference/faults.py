"""The reference engine's faults: one (at least) per measure, each small and modelled on a real bug.

`killed_by` names the checks (glob patterns over check ids in results.json) that must fail
when the fault is injected; `violates` names the measures (as a Verdict records them) that
must be the VIOLATED ones in those checks, no more and no fewer. An entry is a measure name
for every killed check, or "CHECK_GLOB:MEASURE" for the checks matching CHECK_GLOB only.
The mutation matrix (tests/system/test_mutation_matrix.py) proves both. `needs` names where a fault
can act at all ("gpu": it skips a CUDA step that does not exist on hosts); the CPU matrix
leaves those out and says why.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    description: str
    killed_by: tuple[str, ...]
    modelled_on: str
    violates: tuple[str, ...] = ()
    needs: str = ""  # "" runs anywhere; "gpu": acts only where the engine runs on a GPU

    def expected_violations(self, check: str) -> set[str]:
        """The measures this fault must violate in `check` (a check id)."""
        from kvconform.checkids import matches

        out = set()
        for entry in self.violates:
            glob, sep, measure = entry.rpartition(":")
            if not sep or glob.endswith(":"):  # a bare measure name (check ids contain "::")
                out.add(entry)
            elif matches(check, glob):
                out.add(measure)
        return out


FAULTS: dict[str, Fault] = {
    "hit_counter_drift": Fault(
        "the prefix-hit counter counts matched tokens before the last-token rule is applied",
        (
            "prefix_reuse::test_repeated_prompt_served_from_cache",
            "prefix_reuse::test_evicted_prefix_not_reported_as_hit",
        ),
        "counters and per-request usage computed on different paths (vLLM stats vs usage)",
        (
            "prefix_reuse::test_repeated_prompt_served_from_cache:prefix_hits_counter_delta",
            "prefix_reuse::test_evicted_prefix_not_reported_as_hit:hit_tokens_counter_delta",
        ),
    ),
    "reset_keeps_prefix": Fault(
        "reset_prefix_cache answers 200 but leaves the hash index in place",
        ("prefix_reuse::test_reset_drops_cached_prefix",),
        "vLLM reset_prefix_cache returning success while blocks are still referenced",
        ("cached_tokens_after_reset", "prefix_hits_counter_delta_after_reset"),
    ),
    "granularity_loss": Fault(
        "prefix lookup is all-or-nothing over the prompt's full blocks: a prefix shared up to a "
        "partial block hits 0",
        (
            "prefix_reuse::test_partial_block_prefix_hits_match_oracle*",
            "prefix_reuse::test_block_size_sweep",
            "prefix_reuse::test_router_prediction_matches_worker",
        ),
        "vllm-ascend #12589 / oMLX #3443: 0 % hits when the shared prefix is not block-aligned",
        (
            "prefix_reuse::test_partial_block_prefix_hits_match_oracle*:cached_tokens_in_response",
            "prefix_reuse::test_partial_block_prefix_hits_match_oracle*:prefix_hits_counter_delta",
            "prefix_reuse::test_block_size_sweep:points_off_oracle",
            "prefix_reuse::test_router_prediction_matches_worker:served_cached_off_oracle",
        ),
    ),
    "disk_index_lost": Fault(
        "the disk tier's index is not rebuilt on start: entries stay on disk but never hit",
        ("prefix_reuse::test_hits_survive_restart",),
        "LMCache LocalDiskBackend keeps its index in memory only (ENGINES.md)",
        ("cached_tokens_after_restart",),
    ),
    "corrupt_hit_served": Fault(
        "disk entries are served without checking length or checksum",
        ("prefix_reuse::test_corrupt_persisted_entry_recomputed*",),
        "oMLX before 0.5.3 served a corrupt SSD entry as a hit",
        ("cached_tokens_from_damaged_entries", "output_identical_to_cold_run"),
    ),
    "hit_blocks_out_of_order": Fault(
        "a prefix hit hands the request its first two cached blocks swapped: the counts are "
        "right, the KV at those positions is not",
        (
            "prefix_reuse::test_repeated_prompt_served_from_cache",
            "prefix_reuse::test_reset_drops_cached_prefix",
            "prefix_reuse::test_partial_block_prefix_hits_match_oracle*",
            "prefix_reuse::test_block_size_sweep",
            "transfer::test_disaggregated_serving_reports_prefix_reuse",
        ),
        "vLLM #7845 and #5543 (same greedy prompt, different completions with prefix caching), "
        "tenstorrent/vllm#415 (corrupted KV on hits): a hit served with the wrong KV",
        (
            "prefix_reuse::test_repeated_prompt_served_from_cache:answer_from_cache_vs_cold",
            "prefix_reuse::test_reset_drops_cached_prefix:answer_from_cache_vs_after_reset",
            "prefix_reuse::test_partial_block_prefix_hits_match_oracle*:answer_from_cache_vs_after_reset",
            "prefix_reuse::test_block_size_sweep:answer_from_cache_vs_after_reset",
            "transfer::test_disaggregated_serving_reports_prefix_reuse:decode_answer_vs_prefill_side",
        ),
    ),
    "stale_index_after_evict": Fault(
        "eviction reuses a block but leaves its hash in the prefix index",
        ("prefix_reuse::test_evicted_prefix_not_reported_as_hit",),
        "a prefix index not cleaned when blocks are evicted",
        ("cached_tokens_after_eviction", "hit_tokens_counter_delta"),
    ),
    "eviction_unannounced": Fault(
        "a cached block evicted for capacity is freed and unindexed without a removed event",
        ("transfer::test_event_ledger_consistent", "transfer::test_abort_releases_kv_once"),
        "SGLang #29750: RadixCache.release_radix_session freed and deleted leaves without "
        "recording the remove event, so routers kept routing to evicted KV",
        (
            "resident_blocks_ledger_vs_engine_after_fill",
            "transfer::test_abort_releases_kv_once:resident_blocks_ledger_vs_engine",
        ),
    ),
    "none_hash_per_process": Fault(
        "the block-hash chain starts from a seed drawn at random in every engine process",
        ("prefix_reuse::test_block_hashes_stable_across_restart", "prefix_reuse::test_hits_survive_restart"),
        "vLLM before #51875 (0.28.0 and earlier): NONE_HASH = os.urandom(32) when PYTHONHASHSEED "
        "is unset, so no two processes announce the same hashes for the same tokens, and "
        "LMCache #1139: what one process persisted under its hashes is never found by the next",
        (
            "prefix_reuse::test_block_hashes_stable_across_restart:block_hashes_lost_across_restart",
            "prefix_reuse::test_hits_survive_restart:cached_tokens_after_restart",
        ),
    ),
    "router_index_stale": Fault(
        "the router-side prefix index ignores removed events",
        ("prefix_reuse::test_router_prediction_matches_worker",),
        "Dynamo RadixTree dropping removals it cannot place (stale router state)",
        ("predictions_off_oracle",),
    ),
    "leak_on_unregister": Fault(
        "unregister drops the instance from the registry but keeps its memory mapped",
        ("memory_reclaim::test_churn_returns_to_baseline[unregister]",),
        "LMCache #4015: imported KV stayed mapped after instances were released",
        (
            "engine_shm_mapped_bytes.final_delta",
            "engine_shm_mapped_bytes.leak_slope",
            "engine_rss_bytes.final_delta",
            "engine_rss_bytes.leak_slope",
        ),
    ),
    "reaper_never_reaps": Fault(
        "the reaper sees instances whose client stopped heartbeating and never releases them",
        ("memory_reclaim::test_churn_returns_to_baseline[reaper]",),
        "LMCache MP server: instances of dead workers left registered (and their KV mapped) by "
        "the heartbeat reaper",
        (
            "engine_shm_mapped_bytes.final_delta",
            "engine_shm_mapped_bytes.leak_slope",
            "engine_rss_bytes.final_delta",
            "engine_rss_bytes.leak_slope",
        ),
    ),
    "close_leaves_instance_shm": Fault(
        "only unregister unlinks an instance's staging segment: instances still registered "
        "when the server closes leave theirs in /dev/shm",
        ("memory_reclaim::test_churn_returns_to_baseline[close]",),
        "Python multiprocessing 'leaked shared_memory objects' at shutdown: segments unlinked "
        "on the release path but not on close (vLLM/LMCache shutdown warnings)",
        ("close_leftover_shm_bytes.final_delta", "close_leftover_shm_bytes.leak_slope"),
    ),
    "orphan_after_restart": Fault(
        "the server's side process detaches into a session of its own and the server never "
        "stops it: it survives every restart, and when teardown kills it its shm page is left",
        (
            "memory_reclaim::test_churn_returns_to_baseline[restart]",
            "memory_reclaim::test_churn_returns_to_baseline[close]",
            "prefix_reuse::test_hits_survive_restart",
        ),
        "vLLM: the API server stopped alone orphans EngineCore/worker processes (ENGINES.md)",
        (
            *(
                f"memory_reclaim::test_churn_returns_to_baseline[{path}]:{path}_leftover_{what}.{measure}"
                for path in ("restart", "close")
                for what in ("processes", "shm_bytes")
                for measure in ("final_delta", "leak_slope")
            ),
            "prefix_reuse::test_hits_survive_restart:teardown_leftovers",
        ),
    ),
    "index_rebuilt_by_file_order": Fault(
        "on restart the disk index is rebuilt by pairing the block keys with the files in "
        "directory order, not by each file's own name: hits survive, with another block's KV",
        ("prefix_reuse::test_hits_survive_restart",),
        "oMLX 0.5.3's fix: the prefix cache rebuilt on restart restores by the real payload "
        "format, not by position",
        ("output_identical_to_cold_run",),
    ),
    "tensor_retained_after_destroy": Fault(
        "destroy drops an in-process engine from the registry but keeps it (and its KV "
        "tensor) in a list of retired engines",
        ("memory_reclaim::test_churn_returns_to_baseline[destroy]",),
        "an in-process engine destroy that leaves its KV buffer referenced (the LMCache "
        "in-process destroy path this check runs there)",
        (
            "engine_live_tensor_bytes.final_delta",
            "engine_live_tensor_bytes.leak_slope",
            "engine_rss_bytes.final_delta",
            "engine_rss_bytes.leak_slope",
        ),
    ),
    "double_unregister_crashes": Fault(
        "a second unregister of a released instance brings the server down",
        ("memory_reclaim::test_second_release_is_harmless",),
        "LMCache MP server: an error in a release path leaves the server unanswering",
        ("second_release_refused_cleanly", "engine_healthy_after"),
    ),
    "unregister_key_mismatch": Fault(
        "unregister looks an instance up under another key than register stored it under, so "
        "a live instance answers 'not registered' (404) and stays registered",
        ("memory_reclaim::test_second_release_is_harmless",),
        "instance ids compared across types or spellings (an int id registered, its string "
        "unregistered): the release is refused and only a reaper, if any, frees the KV",
        ("first_release_done",),
    ),
    "session_growth": Fault(
        "each turn of a conversation keeps a snapshot of the KV pool outside the block pool",
        ("memory_reclaim::test_long_session_bounded",),
        "oMLX 0.5.3: resident KV accumulated over multi-turn sessions",
        (
            "rss_growth_after_warmup",
            "rss_slope_per_turn",
            "exact_memory_growth_after_warmup",
            "exact_memory_slope_per_turn",
        ),
    ),
    "session_turn_leak": Fault(
        "each turn keeps a copy of the KV it computed (one turn's KV per turn) outside the pool",
        ("memory_reclaim::test_long_session_bounded",),
        "oMLX 0.5.3's session growth at its smallest: below RSS noise, plain in exact bytes",
        ("exact_memory_growth_after_warmup", "exact_memory_slope_per_turn"),
    ),
    "failed_store_keeps_write_pending": Fault(
        "a failed offload store never releases its pending write",
        ("offload_metrics::test_failed_store_releases_pending_write",),
        "vLLM #47666 review: complete_store(success=False) path",
        ("write_gauge_after_failures", "usage_gauge_after_failures"),
    ),
    "read_gauge_not_derived": Fault(
        "the read gauge is computed from its own counter at schedule time, not as usage - write",
        ("offload_metrics::test_gauges_consistent_under_load",),
        "vllm-ascend #10048: a read gauge of -0.39",
        ("samples_read_not_usage_minus_write", "samples_out_of_[0,1]"),
    ),
    "gauges_never_drain": Fault(
        "completed loads never unpin their host chunks, so usage never returns to 0",
        (
            "offload_metrics::test_gauges_drain_after_load",
            "offload_metrics::test_gauges_consistent_under_load",
        ),
        "a transfer-pinning counter not decremented on completion",
        (
            "offload_metrics::test_gauges_drain_after_load:drain_time",
            "offload_metrics::test_gauges_drain_after_load:usage_at_idle",
            "offload_metrics::test_gauges_drain_after_load:read_at_idle",
            "offload_metrics::test_gauges_consistent_under_load:samples_read_without_load_in_flight",
        ),
    ),
    "write_gauge_own_counter": Fault(
        "the write gauge has a counter of its own, which a completed store does not decrement (usage's does)",
        (
            "offload_metrics::test_gauges_consistent_under_load",
            "offload_metrics::test_gauges_drain_after_load",
        ),
        "vLLM's CPU-offload write gauge vs the stores really in flight (two counters out of step)",
        (
            "offload_metrics::test_gauges_consistent_under_load:samples_write_above_usage",
            "offload_metrics::test_gauges_consistent_under_load:samples_write_without_store_in_flight",
            "offload_metrics::test_gauges_drain_after_load:drain_time",
            "offload_metrics::test_gauges_drain_after_load:write_at_idle",
        ),
    ),
    "offload_counters_drained_on_scrape": Fault(
        "the offload byte counters are per-scrape deltas: each scrape reads what moved since the last one",
        ("offload_metrics::test_offload_byte_counters_match_blocks",),
        "TensorRT-LLM's drained /metrics (per-iteration values read once), exposed as counters",
        (
            "store_bytes_delta",
            "load_bytes_delta",
            "offload_store_bytes_decreases",
            "offload_load_bytes_decreases",
        ),
    ),
    "l2_submitted_per_request": Fault(
        "L2 store submissions are counted per request, completions per block",
        ("offload_metrics::test_tiered_store_metrics_consistent",),
        "LMCache's l2_store_submitted (requests) vs l2_store_submitted_objects (objects) mixed up",
        ("scrapes_with_completed_above_submitted", "l2_submitted_minus_completed_at_idle"),
    ),
    "queries_counted_on_miss_only": Fault(
        "the prefix-query counter counts only the tokens that missed the device cache",
        (
            "prefix_reuse::test_repeated_prompt_served_from_cache",
            "prefix_reuse::test_partial_block_prefix_hits_match_oracle*",
        ),
        "a lookup counter incremented on the miss path only (hit rate computed from it inflates)",
        ("prefix_queries_counter_delta",),
    ),
    "offload_bytes_miscounted": Fault(
        "store/load byte counters count 2-byte elements as 4-byte ones",
        ("offload_metrics::test_offload_byte_counters_match_blocks",),
        "byte counters derived from the wrong dtype size",
        ("store_bytes_delta", "load_bytes_delta"),
    ),
    "host_hits_unreported": Fault(
        "blocks loaded back from the host tier are counted as computed, not as host hits",
        ("offload_metrics::test_offloaded_prefix_returns_as_host_hit",),
        "prompt_tokens_cached_by_source missing the host source",
        ("host_source_counter_delta", "cached_tokens_after_device_reset"),
    ),
    "host_load_from_neighbour": Fault(
        "a chunk loaded back from the host tier is its neighbour's in the tier: "
        "the hit counts are right, the restored KV is not the prompt's",
        ("offload_metrics::test_offloaded_prefix_returns_as_host_hit",),
        "vLLM #45704 (a CPU offload connector corrupts restored KV: garbled output) and #52617 "
        "(a connector reports a full hit, decoding diverges at token 0)",
        ("answer_from_host_vs_cold",),
    ),
    "tiered_usage_stale": Fault(
        "the L2 (disk) usage gauge is not updated when entries are written",
        ("offload_metrics::test_tiered_store_metrics_consistent",),
        "LMCache l2_usage_bytes counting only part of what is on disk",
        ("l2_usage_bytes_delta",),
    ),
    "pool_stats_inconsistent": Fault(
        "the free-block stat omits cached-but-free blocks, so used + free != max",
        ("offload_metrics::test_block_pool_stats_consistent",),
        "TensorRT-LLM kvCacheStats free vs reusable blocks",
        ("iterations_used_plus_free_not_max",),
    ),
    "transfer_bytes_ignore_fanout": Fault(
        "the sender counts transferred bytes once, whatever the number of destination replicas",
        (
            "transfer::test_transfer_bytes_reconcile[mla-4-*]",
            "transfer::test_transfer_bytes_reconcile[mla_state-4-*]",
        ),
        "SGLang get_transfer_metric before the fan-out fix (MLA replication)",
        ("bytes_sent",),
    ),
    "transfer_bytes_include_headers": Fault(
        "the sender counts wire bytes (payload + a 64-byte message header), not KV bytes",
        ("transfer::test_transfer_bytes_reconcile[*]",),
        "byte counters fed from the transport layer instead of the KV layout",
        ("bytes_sent",),
    ),
    "decode_usage_reports_own_cache": Fault(
        "the answer's usage is the decode side's: it counts the tokens the decode instance found "
        "in its own cache (none: it was handed the prefill's KV), not what the prefill reused",
        ("transfer::test_disaggregated_serving_reports_prefix_reuse",),
        "Dynamo 1.6.1 with its mocker backend: disaggregated responses carry the decode worker's "
        "own cached tokens (0), not the prefill's reuse (our limitation finding on dynamo, "
        "repeated_request_cached_tokens)",
        ("repeated_request_cached_tokens",),
    ),
    "page_indices_truncated": Fault(
        "the page-index conversion sizes its loop in tokens as if every page held 16 tokens, "
        "so with smaller pages the tail of the page list is never written",
        ("transfer::test_page_indices_match_oracle[1]", "transfer::test_page_indices_match_oracle[4]"),
        "SGLang #11985: create_flashmla_kv_indices_triton looped over tokens / 4096 with a fixed "
        "64 pages per iteration, so page_size 32 lost half the indices",
        ("page_count",),
    ),
    "virtual_page_indices": Fault(
        "the page list numbers the request's own pages (0, 1, 2 ...) instead of the pool pages "
        "its KV slots are in",
        ("transfer::test_page_indices_match_oracle*",),
        "SGLang #31471: virtual KV indices sent as physical ones, so the receiver reads other "
        "pages than the sender wrote",
        ("pages_differing_from_oracle",),
    ),
    "double_release_on_abort": Fault(
        "an aborted request's KV is released by the error path and again by the normal path, "
        "with no guard: the second release runs the pool's own release again (blocks freed "
        "twice, shared blocks unreferenced twice)",
        ("transfer::test_release_guard_holds", "transfer::test_abort_releases_kv_once"),
        "SGLang disaggregated prefill: double release_kv_cache on a grammar error",
        (
            "transfer::test_release_guard_holds:blocks_freed_by_second_release",
            "transfer::test_abort_releases_kv_once:resident_blocks_ledger_vs_engine",
            "transfer::test_abort_releases_kv_once:resident_blocks_ledger_vs_engine_after_fill",
        ),
    ),
    "release_guard_asserts": Fault(
        "the release guard is an assertion: a second release of an aborted request raises "
        "AssertionError out of the release path",
        ("transfer::test_release_guard_holds",),
        "SGLang 0.5.23 mem_cache/common.py release_kv_cache: `assert tree_cache.supports_mamba()` "
        "on a request that no longer holds KV (in the scheduler's loop, the process ends)",
        ("second_release_crashed",),
    ),
    "abort_keeps_tail_block": Fault(
        "the abort path returns every block of the request but its last one, which stays referenced (leaked)",
        ("transfer::test_release_guard_holds",),
        "KV of aborted requests not fully returned: SGLang's over-allocated tail "
        "(_release_overallocated_kv_indices) and vLLM/SGLang abort leaks",
        ("first_release_freed_tokens",),
    ),
    "abort_leaks_blocks": Fault(
        "a request whose client disconnects mid-stream is never released: its blocks stay "
        "referenced and KV usage never returns to 0",
        ("transfer::test_abort_releases_kv_once",),
        "vLLM/SGLang: KV blocks of requests aborted on client disconnect not freed (usage stuck "
        "above 0 at idle)",
        (
            "kv_usage_after_aborts",
            "resident_blocks_ledger_vs_engine",
            "resident_blocks_ledger_vs_engine_after_fill",
        ),
    ),
    "block_hash_ignores_tokens": Fault(
        "a block's cache key covers its position, not its tokens: a fresh prompt of the same "
        "length as a cached one is served that one's KV",
        (
            "prefix_reuse::test_repeated_prompt_served_from_cache",
            "transfer::test_disaggregated_serving_reports_prefix_reuse",
        ),
        "GHSA-rm76-4mrf-v9r8 / vllm-project/vllm#12621: predictable block-hash collisions serve "
        "one prompt another's KV (our vllm mutant block_hash_ignores_tokens)",
        ("first_request_cached_tokens",),
    ),
    "full_prompt_matched": Fault(
        "a block-aligned repeat is matched in full: the last-token rule is not applied, so no "
        "prompt token is left to compute",
        ("prefix_reuse::test_repeated_prompt_served_from_cache",),
        "SGLang Req._compute_max_prefix_len (at most input length - 1) and ml-explore/mlx-lm#1596: "
        "the cap a full hit needs (our sglang mutant full_prompt_matched)",
        ("cached_tokens_in_response", "prefix_hits_counter_delta"),
    ),
    "queries_counted_on_hit_only": Fault(
        "a lookup that finds nothing in the device cache is not counted as a query",
        ("prefix_reuse::test_evicted_prefix_not_reported_as_hit",),
        "hit-rate counters updated in the hit branch only (the twin of queries_counted_on_miss_only): "
        "the hit rate over-reads after evictions",
        ("queried_tokens_counter_delta",),
    ),
    "block_size_forced": Fault(
        "the engine runs at a block size of its own choosing (32 when less was asked for), said "
        "only in its log",
        ("offload_metrics::test_block_pool_stats_consistent",),
        "vLLM's platform hooks overriding cache_config.block_size for a backend that needs "
        "another one (FlashMLA: 64), announced in a log line only",
        ("pool_tokens_per_block_vs_requested", "reused_blocks_during_run", "missed_blocks_during_run"),
    ),
    "pool_counters_per_iteration": Fault(
        "the reused/missed block counters are published per iteration while the stats say they "
        "are running totals",
        ("offload_metrics::test_block_pool_stats_consistent",),
        "TensorRT-LLM's /metrics is drained on read: per-window values taken for running totals",
        (
            "iterations_cumulative_counter_decreased",
            "reused_blocks_during_run",
            "missed_blocks_during_run",
        ),
    ),
    "hit_rate_over_iteration": Fault(
        "the published hit rate covers this iteration's lookups while the reuse counters are cumulative",
        ("offload_metrics::test_block_pool_stats_consistent",),
        "a hit rate computed over another window than its own counters (kvCacheStats "
        "cacheHitRate beside cumulative reusedBlocks/missedBlocks)",
        ("iterations_hit_rate_not_reused_over_lookups",),
    ),
    "trailing_block_not_persisted": Fault(
        "a request's last full block is never written to the persistent tier",
        ("offload_metrics::test_tiered_store_metrics_consistent",),
        "vllm-project/vllm#52735: the trailing chunk kept out of offload stores for good, a "
        "permanent hole in the stored prefix",
        ("disk_bytes_delta", "l2_stores_completed"),
    ),
    "copy_stored_once_removed_each": Fault(
        "a hash cached in two physical blocks (the last block of a repeated block-aligned prompt, "
        "recomputed) is announced stored once (stores de-duplicated) but removed once per copy, "
        "so its removals outnumber its stores",
        ("transfer::test_event_ledger_consistent",),
        "a half-done de-duplication of vLLM's per-copy events (vLLM #48933 / #55092 propose "
        "de-duplicating them; vLLM 0.32.0 announces every copy both ways, which balances): a "
        "consumer that refcounts (Dynamo #8012, llm-d #680) drops a hash still cached",
        ("double_remove",),
    ),
    "event_batch_resent": Fault(
        "every fifth event batch is sent twice with its sequence number (a retry of a send that "
        "had gone out)",
        ("transfer::test_event_ledger_consistent", "transfer::test_abort_releases_kv_once"),
        "publisher retry loops that resend a batch after an error raised past the send "
        "(the consumer sees a repeated sequence number)",
        ("seq_regress",),
    ),
    "abort_kills_engine_loop": Fault(
        "after a client disconnects mid-stream the engine answers every request with HTTP 500",
        ("transfer::test_abort_releases_kv_once",),
        "vLLM's AsyncEngineDeadError ('Background loop has errored already') after request aborts",
        ("engine_serves_after_aborts",),
    ),
    "abort_drop_announced_then_evicted": Fault(
        "an aborted request's fresh blocks are announced removed and dropped from the index, but "
        "go back to the evictable list with their hash, so their eviction announces it again",
        ("transfer::test_abort_releases_kv_once",),
        "removal events emitted on a drop path and again on physical eviction (the vLLM #55092 "
        "family, on the abort path)",
        ("double_remove",),
    ),
    "abort_announces_uncached_blocks": Fault(
        "the abort path announces a removal for every block the request held, including its "
        "partial tail block that was never stored",
        ("transfer::test_abort_releases_kv_once",),
        "removal events per allocated block instead of per cached block",
        ("remove_unknown",),
    ),
    "disagg_prompt_tokens_from_pages": Fault(
        "the decode side reports prompt tokens as KV pages received x page size (the tail page "
        "counted whole)",
        ("transfer::test_disaggregated_serving_reports_prefix_reuse",),
        "usage accounted from the received KV layout rather than the request",
        ("prompt_tokens_served",),
    ),
    "state_bytes_cross_terms": Fault(
        "the sender counts state bytes as (sum of the components' index counts) x (sum of the "
        "components' slot sizes)",
        ("transfer::test_transfer_bytes_reconcile[mla_state-*]",),
        "SGLang #40164 (open; in 0.5.23): CommonKVSender.get_transfer_metric multiplies "
        "_transfer_num_state_indices by state_item_lens_sum, cross terms for heterogeneous states",
        ("bytes_sent",),
    ),
    "receiver_drops_state_bytes": Fault(
        "the decode side counts KV page bytes and not the per-request state it also received",
        ("transfer::test_transfer_bytes_reconcile[mla_state-*]",),
        "state components accounted apart from KV pages (SGLang #40164 reworks the sender's "
        "state accounting); here the receiver forgets them",
        ("bytes_received",),
    ),
    "event_seq_gap": Fault(
        "the event publisher consumes a sequence number for a batch it then drops",
        ("transfer::test_event_ledger_consistent", "transfer::test_abort_releases_kv_once"),
        "vLLM ZmqEventPublisher: seq taken before a send that fails",
        (
            "seq_gap",
            "remove_unknown",
            "resident_blocks_ledger_vs_engine",
            "resident_blocks_ledger_vs_engine_after_fill",
        ),
    ),
}


def main() -> None:
    """`python -m kvconform.engines.reference.faults`: each fault and the checks that kill it."""
    for name, fault in FAULTS.items():
        print(f"{name:28s} killed by {', '.join(fault.killed_by)}\n{'':28s} {fault.description}")


if __name__ == "__main__":
    main()
