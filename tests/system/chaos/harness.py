"""Running one chaos row: a real suite subprocess with tests/system/chaos/inject.py loaded, then what
it left behind (orphans by an environment marker, /dev/shm files named after its processes)
and what it recorded (results.json complete, the target check's verdict and time to it)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tests.paths import REPO

ROOT = REPO
SHM = Path("/dev/shm")
MARK = "KVCONFORM_CHAOS_RUN"


@dataclass
class Run:
    proc: subprocess.CompletedProcess[str]
    records: list[dict[str, Any]]
    log: list[dict[str, Any]]
    orphans: list[str]
    shm_left: list[str]
    complete: str  # "yes" or why not
    wall_s: float

    def record(self, check: str) -> dict[str, Any]:
        found = [r for r in self.records if check in r["nodeid"]]
        assert found, f"no record for {check}; have {[r['nodeid'] for r in self.records]}\n{self.output}"
        return found[0]

    def injected_at(self) -> float | None:
        return next((e["t"] for e in self.log if e["event"] == "injected"), None)

    def time_to_verdict(self, check: str) -> float:
        start = self.injected_at() or next((e["t"] for e in self.log if e["event"] == "target"), None)
        assert start is not None, f"the fault was never injected (the target never ran)\n{self.output}"
        return round(self.record(check)["written_at"] - start, 1)

    def later(self, check: str) -> list[dict[str, Any]]:
        index = next(i for i, r in enumerate(self.records) if check in r["nodeid"])
        return self.records[index + 1 :]

    @property
    def output(self) -> str:
        return (self.proc.stdout + self.proc.stderr)[-4000:]


def run_chaos(
    tmp: Path,
    fault: dict[str, Any],
    targets: list[str],
    options: list[str],
    expected_records: int,
    env: dict[str, str] | None = None,
    timeout: float = 150,
    mounts: list[str] | None = None,
    results: Path | None = None,
) -> Run:
    results = results or tmp / "results"
    chaos_log = tmp / "chaos.jsonl"
    marker = uuid.uuid4().hex
    cfg = {"log": str(chaos_log), **fault}
    base = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    full_env = {**base, **(env or {}), "KVCONFORM_CHAOS": json.dumps(cfg), MARK: marker}
    shm_before = {p.name for p in SHM.iterdir()}
    args = [sys.executable, "-m", "pytest", *targets, *options, "--results-dir", str(results), "-q"]
    args += ["-p", "no:cacheprovider", "-p", "no:xdist", "-p", "tests.system.chaos.inject"]
    if mounts:  # a private mount namespace with tmpfs mounts of its own
        args = [
            "unshare",
            "-m",
            "--",
            sys.executable,
            str(ROOT / "tests/system/chaos/in_mounts.py"),
            *mounts,
            "--",
            *args,
        ]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        args, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err += f"\n[chaos] the suite run passed its {timeout:.0f}s bound and was killed"
    wall = time.monotonic() - t0
    completed = subprocess.CompletedProcess(args, proc.returncode, out, err)
    log = [json.loads(line) for line in chaos_log.read_text().splitlines()] if chaos_log.exists() else []
    pids = {proc.pid} | {p for e in log for p in e.get("pids", [])}
    orphans = find_orphans(marker)
    shm_left = sorted(
        name
        for name in {p.name for p in SHM.iterdir()} - shm_before
        if any(f"-{pid}-" in name for pid in pids)
    )
    for name in shm_left:
        (SHM / name).unlink(missing_ok=True)  # reported, then cleaned: never left for the next row
    records, complete = read_results(results, expected_records) if not mounts else ([], "")
    return Run(completed, records, log, orphans, shm_left, complete, round(wall, 1))


def find_orphans(marker: str, settle_s: float = 3.0) -> list[str]:
    """Processes still carrying this run's environment marker after the run ended (killed once
    listed, so one row's leftovers never hit the next)."""
    deadline = time.monotonic() + settle_s
    while True:
        found = []
        for proc in psutil.process_iter(["pid", "name"]):
            with contextlib.suppress(psutil.Error, OSError):
                if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARK) == marker:
                    found.append(proc)
        if not found or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    return [f"{p.pid}:{p.info['name']}" for p in found]


def read_results(results: Path, expected: int) -> tuple[list[dict[str, Any]], str]:
    path = results / "results.json"
    if not path.exists():
        return [], "no results.json"
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        return [], f"results.json is not JSON ({exc})"
    records = data.get("records", [])
    if "exitstatus" not in data.get("session", {}):
        return records, "session not finished"
    if len(records) != expected:
        return records, f"{len(records)} of {expected} records"
    return records, "yes"


# ---- the table ---------------------------------------------------------------------------------
@dataclass
class Row:
    fault: str
    engine: str
    verdict: str
    time_to_verdict_s: float | str
    bound_s: float | str
    later_checks: str
    orphans: list[str] = field(default_factory=list)
    shm_left: list[str] = field(default_factory=list)
    results_complete: str = "yes"
    wall_s: float = 0.0


COLUMNS = (
    "fault",
    "engine",
    "verdict (first line)",
    "time to verdict",
    "bound",
    "later checks",
    "orphans",
    "/dev/shm left",
    "results.json complete",
    "row wall",
)


def table_dir(config: Any) -> Path:
    raw = None
    with contextlib.suppress(ValueError, AttributeError):
        raw = config.getoption("--results-dir")
    base = Path(raw) if raw else ROOT / "results" / "selftest"
    return (base if base.is_absolute() else ROOT / base) / "chaos"


def add_row(directory: Path, row: Row) -> Path:
    """Append a row (one file per test run, shared by xdist workers) and rewrite the table."""
    directory.mkdir(parents=True, exist_ok=True)
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"solo-{os.getpid()}"
    rows_path = directory / "rows.jsonl"
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = []
        if rows_path.exists():
            rows = [json.loads(ln) for ln in rows_path.read_text().splitlines() if ln.strip()]
        rows = [r for r in rows if r.get("run") == run_id]  # an earlier run's rows go
        rows.append({"run": run_id, **asdict(row)})
        rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = directory / "chaos-table.md"
        out.write_text(render(rows))
    return out


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Chaos table: fault x outcome",
        "",
        "Each row: a real suite subprocess against the engine with the fault injected "
        "(tests/system/chaos). Time to verdict: from the injection to the target check's record.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    for r in sorted(rows, key=lambda r: r["fault"]):
        ttv = r["time_to_verdict_s"]
        cells = [
            r["fault"],
            r["engine"],
            r["verdict"].replace("|", "\\|").replace("\n", " ")[:220],
            f"{ttv} s" if isinstance(ttv, (int, float)) else str(ttv),
            f"{r['bound_s']} s" if isinstance(r["bound_s"], (int, float)) else str(r["bound_s"]),
            r["later_checks"],
            str(len(r["orphans"])) + (f" {r['orphans']}" if r["orphans"] else ""),
            str(len(r["shm_left"])) + (f" {r['shm_left']}" if r["shm_left"] else ""),
            r["results_complete"],
            f"{r['wall_s']} s",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def first_line(record: dict[str, Any]) -> str:
    text = record.get("message", "") or ""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    return f"{record['outcome']}: {line}"


def summarize(records: list[dict[str, Any]]) -> str:
    if not records:
        return "none"
    parts = []
    for r in records:
        relaunched = any(m.get("name") == "engine_relaunched" for m in r.get("measures", []))
        parts.append(r["outcome"] + (" (relaunched)" if relaunched else ""))
    return f"{len(records)}: " + ", ".join(parts)
