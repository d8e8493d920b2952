"""Driver: LMCache's cache simulator (`lmcache tool cache-simulator simulate`), offline.

Run with the LMCache environment's interpreter. The simulator replays lookup-hash JSONL logs,
the records LookupHashLoggingSubscriber writes for each MP_LOOKUP: one line per request with
its full-chunk hashes, seq_len and chunk_size. The op below writes a trace in exactly that
format and makes the two calls the simulator's CLI makes (lmcache/tools/cache_simulator/
simulator.py run_simulate: load_lookup_events, then simulate), reading back the per-request
results the CLI only summarizes.

Ops: replay.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no telemetry from a test rig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jsonl_loop import serve

ENGINE = "lmcache-simulator"


def _version() -> str:
    from importlib.metadata import version

    return f"lmcache {version('lmcache')}"


def op_replay(
    requests: list[dict[str, Any]], chunk_size: int, capacity_chunks: int, kv_bytes_per_chunk: int
) -> dict[str, Any]:
    """`requests`: timestamp (s), seq_len and chunk_hashes (hex strings) per request."""
    from lmcache.tools.cache_simulator.simulator import load_lookup_events, simulate

    with tempfile.TemporaryDirectory(prefix="kvc-lookup-") as folder:
        path = Path(folder) / "lookup_hashes_kvconform_000000.jsonl"
        with path.open("w", encoding="utf-8") as out:
            for i, req in enumerate(requests):
                record = {
                    "timestamp": req["timestamp"],
                    "request_id": f"req-{i}",
                    "model_name": "kvconform",
                    "chunk_size": chunk_size,
                    "seq_len": req["seq_len"],
                    "dtypes": [],
                    "shapes": [],
                    "chunk_hashes": req["chunk_hashes"],
                }
                out.write(json.dumps(record) + "\n")
        events = load_lookup_events([Path(folder)])
    results = simulate(events, capacity_chunks * kv_bytes_per_chunk, kv_bytes_per_chunk)
    return {
        "events": len(events),
        "timestamps": [e.get("timestamp") for e in events],
        "hit_prefix_chunks": results["hit_prefix_lengths"],
        "token_hit_rates": results["per_request_token_hit_rates"],
        "input_lengths": results["input_lengths"],
        "total_hit_tokens": results["total_hit_tokens"],
        "eviction_count": results["eviction_count"],
        "cache_capacity_chunks": results["cache_capacity_chunks"],
    }


def main() -> None:
    serve(ENGINE, _version(), {"replay": op_replay})


if __name__ == "__main__":
    main()
