"""Dynamo driver: in-process Dynamo APIs behind the JSON-lines loop.

Run with the Dynamo environment's interpreter (PyPI ai-dynamo-runtime + ai-dynamo, 1.6.x):

    <venv>/bin/python adapters/drivers/dynamo_driver.py

Standard library plus the venv's ``dynamo`` package only; never imports kvconform.

Ops (keyword arguments -> JSON result):

  tree_new(tree="default")                      fresh RadixTree under that name
  tree_apply(events, tree="default")            apply our plain events (see ``_to_dynamo_event``)
  tree_match(block_hashes, early_exit=False, tree="default")
  tree_dump(tree="default")                     the tree as our plain events (+ Dynamo's raw JSON)
  tree_remove_worker(worker_id, tree="default")
  tree_clear_worker(worker_id, tree="default")
  process_rss()                                 this process's resident bytes (/proc/self/statm)
  block_hashes(token_ids, block_size, lora_name=None, cache_namespace=None)
  replay(trace, engine_args=None, mode="agg", ...)   offline mocker replay

Plain event form (ours, not Dynamo's):
  {"type": "stored",  "worker": 1, "dp_rank": 0, "id": 7, "parent": null | <u64>,
   "blocks": [{"hash": <u64>, "tokens_hash": <u64>} | {"hash": <u64>, "tokens": [ids]}]}
  {"type": "removed", "worker": 1, "dp_rank": 0, "id": 8, "hashes": [<u64>, ...]}
  {"type": "cleared", "worker": 1, "dp_rank": 0, "id": 9}
``hash`` is the engine's external block hash (parent links and removals use it);
``tokens_hash`` is the content hash the tree matches on (``block_hashes`` computes it;
``tokens`` asks the driver to compute it from that block's token ids).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dynamo.llm import RadixTree, compute_block_hash_for_seq
from jsonl_loop import serve

_TREES: dict[str, Any] = {}


def _version() -> str:
    try:
        return importlib.metadata.version("ai-dynamo-runtime")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _tree(name: str) -> Any:
    if name not in _TREES:
        raise KeyError(f"no tree {name!r}; call tree_new first (known: {sorted(_TREES)})")
    return _TREES[name]


def _u64_to_i64(value: int) -> int:
    return value - (1 << 64) if value >= (1 << 63) else value


# --------------------------------------------------------------------------- RadixTree


def tree_new(tree: str = "default") -> dict[str, Any]:
    _TREES[tree] = RadixTree()
    return {"tree": tree}


def _tokens_hash(block: dict[str, Any]) -> int:
    if "tokens_hash" in block:
        return int(block["tokens_hash"])
    tokens = [int(t) for t in block["tokens"]]
    if not tokens:
        raise ValueError("a block given by tokens needs at least one token")
    return int(compute_block_hash_for_seq(tokens, len(tokens))[0])


def _to_dynamo_event(event: dict[str, Any], default_id: int) -> dict[str, Any]:
    kind = event["type"]
    if kind == "stored":
        data: Any = {
            "stored": {
                "parent_hash": None if event.get("parent") is None else int(event["parent"]),
                "blocks": [
                    {"block_hash": int(b["hash"]), "tokens_hash": _tokens_hash(b)} for b in event["blocks"]
                ],
            }
        }
    elif kind == "removed":
        data = {"removed": {"block_hashes": [int(h) for h in event["hashes"]]}}
    elif kind == "cleared":
        data = "cleared"
    else:
        raise ValueError(f"unknown event type {kind!r} (stored|removed|cleared)")
    return {
        "event_id": int(event.get("id", default_id)),
        "data": data,
        "dp_rank": int(event.get("dp_rank", 0)),
    }


def tree_apply(events: list[dict[str, Any]], tree: str = "default") -> dict[str, Any]:
    """Apply events in order. A rejected event does not stop the batch: Dynamo raises
    ValueError for an unknown parent or an unknown removed block and leaves the tree as it
    was; each event's outcome is reported."""
    radix = _tree(tree)
    results: list[dict[str, Any]] = []
    for index, event in enumerate(events):
        try:
            payload = _to_dynamo_event(event, index)
            radix.apply_event(int(event["worker"]), json.dumps(payload).encode())
            results.append({"index": index, "ok": True, "error": None})
        except Exception as exc:
            results.append({"index": index, "ok": False, "error": f"{type(exc).__name__}: {exc}"})
    return {
        "applied": sum(1 for r in results if r["ok"]),
        "rejected": sum(1 for r in results if not r["ok"]),
        "results": results,
    }


def tree_match(block_hashes: list[int], early_exit: bool = False, tree: str = "default") -> dict[str, Any]:
    overlap = _tree(tree).find_matches([int(h) for h in block_hashes], early_exit)
    scores = []
    for key, blocks in overlap.scores.items():
        worker, dp_rank = key if isinstance(key, tuple) else (key, 0)
        scores.append({"worker": int(worker), "dp_rank": int(dp_rank), "blocks": int(blocks)})
    scores.sort(key=lambda s: (s["worker"], s["dp_rank"]))
    return {"scores": scores, "frequencies": list(overlap.frequencies)}


def tree_dump(tree: str = "default") -> dict[str, Any]:
    raw = _tree(tree).dump_tree_as_events()
    events = []
    for text in raw:
        record = json.loads(text)
        inner = record["event"]
        data = inner["data"]
        base = {
            "worker": record["worker_id"],
            "dp_rank": inner.get("dp_rank", 0),
            "id": inner.get("event_id"),
            "storage_tier": record.get("storage_tier"),
        }
        if isinstance(data, dict) and "stored" in data:
            stored = data["stored"]
            base.update(
                type="stored",
                parent=stored.get("parent_hash"),
                blocks=[{"hash": b["block_hash"], "tokens_hash": b["tokens_hash"]} for b in stored["blocks"]],
            )
        elif isinstance(data, dict) and "removed" in data:
            base.update(type="removed", hashes=data["removed"]["block_hashes"])
        else:
            base.update(type="cleared")
        events.append(base)
    return {"events": events, "raw": raw}


def tree_remove_worker(worker_id: int, tree: str = "default") -> dict[str, Any]:
    _tree(tree).remove_worker(int(worker_id))
    return {"worker": int(worker_id)}


def tree_clear_worker(worker_id: int, tree: str = "default") -> dict[str, Any]:
    _tree(tree).clear_all_blocks(int(worker_id))
    return {"worker": int(worker_id)}


def block_hashes(
    token_ids: list[int],
    block_size: int,
    lora_name: str | None = None,
    cache_namespace: str | None = None,
) -> dict[str, Any]:
    """Content hash of each full block (a trailing partial block is dropped). Values are
    u64; ``hashes_i64`` gives the same bits as signed ints (the slot tracker's HTTP API
    takes i64 and rejects u64 values >= 2**63)."""
    hashes = compute_block_hash_for_seq(
        [int(t) for t in token_ids],
        int(block_size),
        lora_name=lora_name,
        cache_namespace=cache_namespace,
    )
    hashes = [int(h) for h in hashes]
    return {
        "block_size": int(block_size),
        "full_blocks": len(hashes),
        "hashes": hashes,
        "hashes_i64": [_u64_to_i64(h) for h in hashes],
    }


# --------------------------------------------------------------------------- offline replay

_ENGINE_FLAGS = {
    # our key -> mocker CLI flag (the package's own parser/builder makes the config)
    "block_size": "--block-size",
    "num_gpu_blocks": "--num-gpu-blocks-override",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "speedup_ratio": "--speedup-ratio",
    "kv_bytes_per_token": "--kv-bytes-per-token",
    "kv_transfer_bandwidth_gbps": "--kv-transfer-bandwidth",
    "num_host_blocks": "--num-host-blocks",
    "engine_type": "--engine-type",
}


def _engine_config(engine_args: dict[str, Any], role: str) -> dict[str, Any]:
    from dynamo.mocker import config as mocker_config
    from dynamo.mocker.args import parse_args

    argv: list[str] = []
    for key, flag in _ENGINE_FLAGS.items():
        if engine_args.get(key) is not None:
            argv += [flag, str(engine_args[key])]
    if engine_args.get("enable_prefix_caching") is False:
        argv.append("--no-enable-prefix-caching")
    if engine_args.get("enable_chunked_prefill") is False:
        argv.append("--no-enable-chunked-prefill")
    if role != "agg":
        argv += ["--disaggregation-mode", role]
    argv += [str(a) for a in engine_args.get("extra_cli", [])]
    return mocker_config.build_mocker_engine_args(parse_args(argv))


def _route(history: list[dict[str, Any]] | None, pools: tuple[str, ...]) -> dict[str, Any] | None:
    for entry in history or []:
        if entry.get("pool") in pools:
            return entry
    return None


def _request_row(index: int, req: dict[str, Any], mode: str) -> dict[str, Any]:
    first = _route(req.get("routing_history"), ("agg", "prefill"))
    decode = _route(req.get("routing_history"), ("decode",))
    handoff = None
    if mode == "disagg":
        reserved = req.get("destination_reserved_ms")
        activated = req.get("destination_activated_ms")
        handoff = {
            "prefill_admit_ms": req.get("prefill_admit_ms"),
            "source_held_ms": req.get("source_held_ms"),
            "destination_reserved_ms": reserved,
            "destination_activated_ms": activated,
            "source_released_ms": req.get("source_released_ms"),
            "decode_admit_ms": req.get("decode_admit_ms"),
            "transfer_ms": None if reserved is None or activated is None else activated - reserved,
        }
    return {
        "index": index,
        "session_id": req.get("session_id"),
        "arrival_time_ms": req.get("arrival_time_ms"),
        "input_length": req.get("input_length"),
        "output_length": req.get("output_length"),
        "reused_input_tokens": req.get("reused_input_tokens"),
        "decode_reused_input_tokens": req.get("decode_reused_input_tokens"),
        "router_overlap_tokens": None if first is None else first.get("reported_overlap_tokens"),
        "selected_overlap_blocks": None if first is None else first.get("selected_overlap_blocks"),
        "best_available_overlap_blocks": (
            None if first is None else first.get("best_available_overlap_blocks")
        ),
        "overlap_regret_blocks": None if first is None else first.get("overlap_regret_blocks"),
        "first_worker": None if first is None else first.get("logical_worker_id"),
        "decode_worker": None if decode is None else decode.get("logical_worker_id"),
        "prefill_worker_idx": req.get("prefill_worker_idx"),
        "decode_worker_idx": req.get("decode_worker_idx"),
        "admissions": [
            {
                "pool": a.get("pool"),
                "at_ms": a.get("at_ms"),
                "reused_input_tokens": a.get("reused_input_tokens"),
                "is_readmission": a.get("is_readmission"),
            }
            for a in req.get("admission_history") or []
        ],
        "ttft_ms": req.get("ttft_ms"),
        "e2e_latency_ms": req.get("e2e_latency_ms"),
        "terminal_status": req.get("terminal_status"),
        "handoff": handoff,
    }


def replay(
    trace: Any,
    engine_args: dict[str, Any] | None = None,
    mode: str = "agg",
    router_mode: str = "kv_router",
    num_workers: int = 1,
    num_prefill_workers: int = 1,
    num_decode_workers: int = 1,
    replay_concurrency: int | None = None,
    arrival_interval_ms: float | None = None,
    request_rate: float | None = None,
    arrival_speedup_ratio: float = 1.0,
    prefill_engine_args: dict[str, Any] | None = None,
    decode_engine_args: dict[str, Any] | None = None,
    include_raw: bool = False,
) -> dict[str, Any]:
    """Offline mocker replay (simulated time; runs in milliseconds of wall time).

    trace: a list of requests {"timestamp": ms, "input_length": n, "output_length": n,
    "hash_ids": [one id per block of block_size tokens]} (replayed as a mooncake trace with
    trace_block_size = block_size; equal hash_ids = equal block content), or
    {"synthetic": {"input_tokens", "output_tokens", "request_count", "shared_prefix_ratio",
    "num_prefix_groups", "turns_per_session", "inter_turn_delay_ms", "arrival_seed"}}.
    engine_args: our keys (see _ENGINE_FLAGS) shared by all roles; prefill_/decode_engine_args
    override per role in disagg mode.
    """
    from dynamo._core import run_mocker_synthetic_trace_replay, run_mocker_trace_replay

    engine_args = dict(engine_args or {})
    engine_args.setdefault("block_size", 16)
    if mode not in ("agg", "disagg"):
        raise ValueError("mode must be 'agg' or 'disagg'")
    kwargs: dict[str, Any] = {
        "router_mode": router_mode,
        "arrival_speedup_ratio": arrival_speedup_ratio,
        "capture_per_request": True,
    }
    if replay_concurrency is not None:
        kwargs["replay_concurrency"] = int(replay_concurrency)
    if mode == "agg":
        kwargs["extra_engine_args"] = _engine_config(engine_args, "agg")
        kwargs["num_workers"] = int(num_workers)
        configs = {"agg": kwargs["extra_engine_args"]}
    else:
        pre = {**engine_args, **(prefill_engine_args or {})}
        dec = {**engine_args, **(decode_engine_args or {})}
        kwargs["prefill_engine_args"] = _engine_config(pre, "prefill")
        kwargs["decode_engine_args"] = _engine_config(dec, "decode")
        kwargs["num_prefill_workers"] = int(num_prefill_workers)
        kwargs["num_decode_workers"] = int(num_decode_workers)
        configs = {"prefill": kwargs["prefill_engine_args"], "decode": kwargs["decode_engine_args"]}

    block_size = int(engine_args["block_size"])
    trace_path = None
    try:
        if isinstance(trace, dict) and "synthetic" in trace:
            syn = dict(trace["synthetic"])
            for key in ("turns_per_session", "arrival_seed", "num_prefix_groups"):
                if key in syn:
                    kwargs[key] = int(syn[key])
            for key in ("shared_prefix_ratio", "inter_turn_delay_ms"):
                if key in syn:
                    kwargs[key] = float(syn[key])
            if arrival_interval_ms is not None:
                kwargs["arrival_interval_ms"] = float(arrival_interval_ms)
            if request_rate is not None:
                kwargs["request_rate"] = float(request_rate)
            if not any(k in kwargs for k in ("replay_concurrency", "arrival_interval_ms", "request_rate")):
                kwargs["replay_concurrency"] = 1
            result = run_mocker_synthetic_trace_replay(
                int(syn["input_tokens"]),
                int(syn["output_tokens"]),
                int(syn["request_count"]),
                **kwargs,
            )
            source = "synthetic"
        else:
            rows = list(trace)
            fd, trace_path = tempfile.mkstemp(prefix="kvc-dynamo-trace-", suffix=".jsonl")
            with os.fdopen(fd, "w") as handle:
                for row in rows:
                    handle.write(
                        json.dumps(
                            {
                                "timestamp": row.get("timestamp", 0),
                                "input_length": int(row["input_length"]),
                                "output_length": int(row["output_length"]),
                                "hash_ids": [int(h) for h in row["hash_ids"]],
                            }
                        )
                        + "\n"
                    )
            result = run_mocker_trace_replay(
                [trace_path], trace_block_size=block_size, trace_format="mooncake", **kwargs
            )
            source = "trace"
    finally:
        if trace_path is not None:
            os.unlink(trace_path)

    per_request = sorted(result.per_request or [], key=lambda r: r.get("arrival_time_ms") or 0.0)
    first_cfg = next(iter(configs.values()))["engine"]
    bpt = first_cfg.get("kv_transfer_bytes_per_token")
    bandwidth = first_cfg.get("kv_transfer_bandwidth")
    summary_keys = (
        "num_requests",
        "completed_requests",
        "total_input_tokens",
        "total_output_tokens",
        "committed_prefill_tokens",
        "prefix_cache_reused_ratio",
        "first_admission_prefix_cache_reused_ratio",
        "duration_ms",
        "wall_time_ms",
        "kv_eviction_policy",
        "mean_ttft_ms",
    )
    out = {
        "source": source,
        "mode": mode,
        "router_mode": router_mode,
        "block_size": block_size,
        "num_gpu_blocks": first_cfg.get("num_gpu_blocks"),
        "kv_bytes_per_token": bpt,
        "kv_transfer_bandwidth_gbps": bandwidth,
        # decimal GB/s: 1 GB/s moves 1e6 bytes per millisecond
        "bandwidth_bytes_per_ms": None if not bandwidth else float(bandwidth) * 1e6,
        "transfer_timing_mode": first_cfg.get("kv_transfer_timing_mode"),
        "engine_configs": configs,
        "summary": {k: result.summary.get(k) for k in summary_keys},
        "requests": [_request_row(i, r, mode) for i, r in enumerate(per_request)],
    }
    if include_raw:
        out["raw_per_request"] = per_request
        out["raw_summary"] = dict(result.summary)
    return out


def process_rss() -> dict[str, Any]:
    """Resident bytes of this process, read by us from the kernel (the index's memory)."""
    with open("/proc/self/statm") as statm:
        resident_pages = int(statm.read().split()[1])
    return {"rss_bytes": resident_pages * os.sysconf("SC_PAGE_SIZE")}


HANDLERS = {
    "tree_new": tree_new,
    "tree_apply": tree_apply,
    "tree_match": tree_match,
    "tree_dump": tree_dump,
    "tree_remove_worker": tree_remove_worker,
    "tree_clear_worker": tree_clear_worker,
    "process_rss": process_rss,
    "block_hashes": block_hashes,
    "replay": replay,
}


if __name__ == "__main__":
    serve("dynamo", _version(), HANDLERS)
