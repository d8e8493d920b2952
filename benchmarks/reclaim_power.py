"""Detector power of the memory_reclaim churn check, measured on the reference engine.

Leak sizes: the reference engine's `leak_on_unregister` fault keeps each released instance
mapped; the instance size (KVCONFORM_REF_INSTANCE_BYTES) sets the leak per cycle. For each
size we run the churn check for N cycles and record whether it failed (detected). Then we
run the clean engine R times and count failures (false alarms).

usage: python benchmarks/reclaim_power.py [--cycles 10] [--clean-runs 20] [--out results/bench]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = "memory_reclaim::test_churn_returns_to_baseline[unregister]"
BLOCK_BYTES = 16 * 1024  # reference engine: 16 tokens x 1 KiB of KV per token
LEAKS = [4096, 8192, BLOCK_BYTES, 4 * BLOCK_BYTES, 64 * BLOCK_BYTES]


def run(results: Path, cycles: int, instance_bytes: int, fault: str | None) -> dict:
    env = {**os.environ, "KVCONFORM_REF_INSTANCE_BYTES": str(instance_bytes)}
    args = [
        sys.executable,
        "-m",
        "pytest",
        "kvconform/suites/memory_reclaim",
        "--engine",
        "reference",
        "--check",
        CHECK,
        "--churn-cycles",
        str(cycles),
        "--results-dir",
        str(results),
        "-q",
        "-p",
        "no:cacheprovider",
    ]
    if fault:
        args += ["--fault", fault]
    t0 = time.monotonic()
    subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    record = json.loads((results / "results.json").read_text())["records"][0]
    slopes = {m["name"]: m["value"] for m in record["measures"] if m["name"].endswith("leak_slope")}
    return {"outcome": record["outcome"], "seconds": round(time.monotonic() - t0, 1), "slopes": slopes}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, default=10)
    parser.add_argument("--clean-runs", type=int, default=20)
    parser.add_argument("--out", default="results/bench-reclaim")
    args = parser.parse_args()
    out = ROOT / args.out
    report: dict = {"cycles": args.cycles, "block_bytes": BLOCK_BYTES, "leaks": [], "clean": []}
    for leak in LEAKS:
        row = run(out / f"leak-{leak}", args.cycles, leak, "leak_on_unregister")
        row["leak_bytes_per_cycle"] = leak
        report["leaks"].append(row)
        print(
            f"leak {leak:>8} B/cycle ({leak / BLOCK_BYTES:.2f} blocks): {row['outcome']} {row['slopes']}",
            flush=True,
        )
    for i in range(args.clean_runs):
        row = run(out / f"clean-{i}", args.cycles, BLOCK_BYTES, None)
        report["clean"].append(row)
        print(f"clean run {i + 1}: {row['outcome']} {row['slopes']}", flush=True)
    detected = [r["leak_bytes_per_cycle"] for r in report["leaks"] if r["outcome"] == "failed"]
    report["smallest_detected_leak_bytes"] = min(detected) if detected else None
    report["false_alarms"] = sum(r["outcome"] != "passed" for r in report["clean"])
    (out / "summary.json").write_text(json.dumps(report, indent=1))
    print(
        f"smallest leak detected within {args.cycles} cycles: "
        f"{report['smallest_detected_leak_bytes']} bytes; "
        f"false alarms: {report['false_alarms']} of {args.clean_runs} clean runs"
    )


if __name__ == "__main__":
    main()
