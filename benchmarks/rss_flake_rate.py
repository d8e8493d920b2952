"""Flake rate of every RSS-based check: N clean runs of the same engine, same code.

An RSS-based check is one that records a measure on resident memory (a name with "rss"):
the churn checks of every release path the engine has, and any other memory_reclaim check
that samples RSS. Nothing is injected; every run that does not pass is a flake (a false
alarm), reported separately as VIOLATED (failed) and INCONCLUSIVE (a noisy slope whose
confidence band still straddled its bound after the churn was extended), with the cycles the
adaptive churn needed and each noisy slope's band.

This is a benchmark, not a timed test: a real engine takes minutes per run.

usage: python benchmarks/rss_flake_rate.py [--engine reference] [--runs 20]
           [--check 'memory_reclaim::*'] [--out results/bench-rss-flake]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def one_run(engine: str, checks: list[str], results: Path, extra: list[str]) -> list[dict[str, Any]]:
    args = [sys.executable, "-m", "pytest", "kvconform/suites", "--engine", engine]
    args += [a for c in checks for a in ("--check", c)]
    args += ["--results-dir", str(results), "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *extra]
    subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    path = results / "results.json"
    return json.loads(path.read_text())["records"] if path.exists() else []


def rss_measures(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in record.get("measures", []) if "rss" in str(m.get("name", "")) and m.get("op")]


def summarize(runs: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    per: dict[str, dict[str, Any]] = defaultdict(
        lambda: {
            "runs": 0,
            "passed": 0,
            "failed": 0,
            "inconclusive": 0,
            "other": 0,
            "cycles": [],
            "slopes": [],
        }
    )
    for records in runs:
        for rec in records:
            noisy = rss_measures(rec)
            if not noisy or rec["outcome"] == "skipped":
                continue
            row = per[rec["check"]]
            row["runs"] += 1
            outcome = rec["outcome"]
            row[outcome if outcome in ("passed", "failed", "inconclusive") else "other"] += 1
            cycles = next((m["value"] for m in rec["measures"] if m["name"] == "cycles"), None)
            if cycles is not None:
                row["cycles"].append(cycles)
            for m in noisy:
                if m["name"].endswith("leak_slope"):
                    row["slopes"].append(
                        {"value": m["value"], "bound": m["bound"], "note": m.get("note", "")}
                    )
    for row in per.values():
        row["flake_rate"] = round((row["runs"] - row["passed"]) / row["runs"], 3) if row["runs"] else None
    return dict(per)


def markdown(engine: str, n: int, summary: dict[str, dict[str, Any]], seconds: float) -> str:
    lines = [
        f"RSS-based checks on {engine}, {n} clean runs ({seconds:.0f} s):",
        "",
        "| check | runs | passed | VIOLATED | INCONCLUSIVE | flake rate | cycles (min-max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for check, row in sorted(summary.items()):
        cycles = row["cycles"]
        span = f"{min(cycles)}-{max(cycles)}" if cycles else "-"
        lines.append(
            f"| `{check}` | {row['runs']} | {row['passed']} | {row['failed']} | {row['inconclusive']} "
            f"| {row['flake_rate']} | {span} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="reference")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--check", action="append", default=None, help="default: memory_reclaim::*")
    parser.add_argument("--out", default="results/bench-rss-flake")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest after --")
    args = parser.parse_args()
    checks = args.check or ["memory_reclaim::*"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    runs = []
    for i in range(args.runs):
        records = one_run(args.engine, checks, out / f"run-{i:02d}", args.pytest_args)
        runs.append(records)
        done = ", ".join(f"{r['check'].split('::')[-1]}={r['outcome']}" for r in records if rss_measures(r))
        print(f"run {i + 1}/{args.runs}: {done or 'no RSS-based check ran'}", flush=True)
    summary = summarize(runs)
    seconds = time.monotonic() - t0
    (out / "rss-flake-rate.json").write_text(
        json.dumps(
            {"engine": args.engine, "runs": args.runs, "seconds": seconds, "checks": summary}, indent=1
        )
    )
    text = markdown(args.engine, args.runs, summary, seconds)
    (out / "rss-flake-rate.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
