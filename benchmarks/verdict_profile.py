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


def profile(results: Path, wall_s: float | None = None) -> dict[str, Any]:
    data = json.loads((results / "results.json").read_text())
    session, records = data.get("session") or {}, data.get("records") or []
    if wall_s is None:
        wall_s = float(session.get("finished", 0)) - float(session.get("started", 0))
    wall = wall_s
    in_checks = {k: 0.0 for k in PHASES}
    for record in records:
        for entry in (record.get("engine_time") or {}).values():
            for k in PHASES:
                in_checks[k] += float(entry.get(k, 0))
    whole = {k: 0.0 for k in PHASES}
    for entry in (session.get("engine_time") or {}).values():
        for k in PHASES:
            whole[k] += float(entry.get(k, 0))
    checks_s = sum(float(r.get("duration_s", 0)) for r in records)
    engine_s = in_checks["start_s"] + in_checks["stop_s"] + in_checks["call_s"]
    harness_s = max(checks_s - engine_s, 0.0)
    return {
        "engines": session.get("engines", {}),
        "outcomes": dict(Counter(r.get("outcome", "?") for r in records)),
        "wall_s": round(wall, 1),
        "checks_s": round(checks_s, 1),
        "starts": int(whole["starts"]),
        "start_s": round(whole["start_s"], 1),
        "stops": int(whole["stops"]),
        "stop_s": round(whole["stop_s"], 1),
        "engine_wait_s": round(in_checks["call_s"], 1),
        "harness_s": round(harness_s, 1),
        "harness_pct_of_engine": round(100 * harness_s / engine_s, 1) if engine_s else None,
        "session_overhead_s": round(wall - checks_s, 1),
        "slowest": sorted(
            ((r.get("nodeid", "?"), float(r.get("duration_s", 0))) for r in records), key=lambda x: -x[1]
        )[:5],
    }


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = ["run", "outcomes", "wall s", "starts", "start s", "stops", "stop s", "wait s"]
    head += ["harness s", "harness %"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for name, p in rows.items():
        outcomes = ", ".join(f"{v} {k}" for k, v in sorted(p["outcomes"].items()))
        cells = [name, outcomes, p["wall_s"], p["starts"], p["start_s"], p["stops"], p["stop_s"]]
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
        rows[source.name] = profile(source)
    for engine in args.engine:
        results = args.out / engine
        wall = run_suite(engine, results, extra)
        rows[engine] = profile(results, wall)
        print(f"[profile] {engine}: {rows[engine]['wall_s']} s", file=sys.stderr)
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
