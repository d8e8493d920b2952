"""Where a real engine's verdict time goes: the whole suite run per engine, split into engine
start-ups (count, seconds), teardowns, waits on the engine (HTTP requests and driver calls
made by the checks) and the harness (everything else inside the checks: scrapes' parsing,
sampling, oracles, records), plus the session's own overhead (collection, report).

The split comes from kvconform.timing, which every run writes into results.json; nothing
here times a check itself. A benchmark, not a timed test: run it before and after a change.

usage: python benchmarks/verdict_profile.py --engine vllm [--engine lmcache ...]
           [--out results/bench-verdict-profile] [--from DIR ...] [-- extra pytest args]

--from reads existing results directories instead of running (one per engine run).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("starts", "start_s", "stops", "stop_s", "calls", "call_s")


def run_suite(engine: str, results: Path, extra: list[str]) -> float:
    args = [sys.executable, "-m", "pytest", "kvconform/suites", "--engine", engine]
    args += ["--results-dir", str(results), "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *extra]
    t0 = time.monotonic()
    subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    return time.monotonic() - t0


def profile(results: Path, wall_s: float | None = None) -> dict[str, dict[str, Any]]:
    """One row per engine of the run (a session's engines run one after another)."""
    data = json.loads((results / "results.json").read_text())
    session, records = data.get("session") or {}, data.get("records") or []
    if wall_s is None:
        wall_s = float(session.get("finished", 0)) - float(session.get("started", 0))
    rows = {}
    engines = sorted({r.get("engine", "-") for r in records} - {"-"})
    for engine in engines:
        mine = [r for r in records if r.get("engine") == engine]
        spent = {k: 0.0 for k in PHASES}
        for record in mine:
            entry = (record.get("engine_time") or {}).get(engine) or {}
            for k in PHASES:
                spent[k] += float(entry.get(k, 0))
        checks_s = sum(float(r.get("duration_s", 0)) for r in mine)
        engine_s = spent["start_s"] + spent["stop_s"] + spent["call_s"]
        harness_s = max(checks_s - engine_s, 0.0)
        rows[engine] = {
            "version": (session.get("engines") or {}).get(engine, "?"),
            "outcomes": dict(Counter(r.get("outcome", "?") for r in mine)),
            "checks_s": round(checks_s, 1),
            "starts": int(spent["starts"]),
            "start_s": round(spent["start_s"], 1),
            "stops": int(spent["stops"]),
            "stop_s": round(spent["stop_s"], 1),
            "engine_wait_s": round(spent["call_s"], 1),
            "harness_s": round(harness_s, 1),
            "harness_pct_of_engine": round(100 * harness_s / engine_s, 1) if engine_s else None,
            "slowest": sorted(
                ((r.get("nodeid", "?"), float(r.get("duration_s", 0))) for r in mine), key=lambda x: -x[1]
            )[:5],
        }
    total = sum(float(r.get("duration_s", 0)) for r in records)
    for row in rows.values():
        row["session_wall_s"] = round(wall_s, 1)
        row["session_overhead_s"] = round(wall_s - total, 1)  # collection, report, exit
    return rows


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = ["run", "outcomes", "checks s", "starts", "start s", "stops", "stop s", "wait s"]
    head += ["harness s", "harness %"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for name, p in rows.items():
        outcomes = ", ".join(f"{v} {k}" for k, v in sorted(p["outcomes"].items()))
        cells = [name, outcomes, p["checks_s"], p["starts"], p["start_s"], p["stops"], p["stop_s"]]
        cells += [p["engine_wait_s"], p["harness_s"], p["harness_pct_of_engine"]]
        lines.append(" | ".join(str(c) for c in cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="append", default=[])
    parser.add_argument("--from", dest="sources", action="append", default=[], type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench-verdict-profile")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    rows: dict[str, dict[str, Any]] = {}
    for source in args.sources:
        for engine, row in profile(source).items():
            rows[f"{source.name}/{engine}"] = row
    for engine in args.engine:
        results = args.out / engine
        wall = run_suite(engine, results, extra)
        rows.update(profile(results, wall))
        print(f"[profile] {engine}: {wall:.0f} s", file=sys.stderr)
    if not rows:
        parser.error("give --engine or --from")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    for name, p in rows.items():
        print(f"\n{name}: slowest checks")
        for nodeid, seconds in p["slowest"]:
            print(f"  {seconds:7.1f} s  {nodeid}")


if __name__ == "__main__":
    main()
