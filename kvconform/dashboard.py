"""The conformance dashboard: engine x check, one cell per record of a run's results.json.

    kvconform dashboard RESULTS_DIR [--html PATH]

Each cell reads pass, finding (a known finding, with its class — defect, limitation,
known-upstream, unconfirmed — and the measure(s) it fails on, with their numbers),
failed (a new failure: the violated measure, or the first line of the error), skip (the
capability the engine lacks, or the reason) or "-" (the check does not apply to that engine).
The header names each engine's version and the platform; rows are grouped by the promise the
check guards. Written as RESULTS_DIR/dashboard.md (a nightly's artifacts carry it) and as a
self-contained dashboard.html (beside the HTML report, and inside it as a global attachment).

Also here: the promise each check guards (the report's epics) and the counts the report's
headline states ("N findings, M new failures").
"""

from __future__ import annotations

import functools
import html
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from kvconform import inventory
from kvconform.checkids import base_check
from kvconform.contract.capabilities import Capability
from kvconform.errors import KvconformError, UsageError
from kvconform.formatting import first_line, md_cell, value_text
from kvconform.records import CheckResult, RecordsError, Run, read
from kvconform.results import Measure

MARKDOWN_NAME = "dashboard.md"
HTML_NAME = "dashboard.html"

# the promises of the design brief, each check's epic in the report
MEMORY = "Memory returns to baseline"
GAUGES = "Offload gauges tell the truth"
PREFIX = "Prefix hits survive"
TRANSFER = "Transfer bytes reconcile"
RELEASED_ONCE = "No block released twice"
PROMISES = (MEMORY, GAUGES, PREFIX, TRANSFER, RELEASED_ONCE)
SUITE_PROMISE = {
    "memory_reclaim": MEMORY,
    "offload_metrics": GAUGES,
    "prefix_reuse": PREFIX,
    "transfer": TRANSFER,
}
# checks whose promise is not their suite's: double release, unlock underflow, release once
CHECK_PROMISE = {
    "memory_reclaim::test_second_release_is_harmless": RELEASED_ONCE,
    "transfer::test_block_tracker_ownership_and_drain": RELEASED_ONCE,
    "transfer::test_event_ledger_consistent": RELEASED_ONCE,
    "transfer::test_abort_releases_kv_once": RELEASED_ONCE,
    "transfer::test_release_guard_holds": RELEASED_ONCE,
}

PASSING = {"passed", "xpassed"}
_LACKS = re.compile(r"engine (?P<engine>\S+) lacks capability (?P<cap>.+?)(?: \((?P<why>.*)\))?$")
_LINK = re.compile(r" \[(?P<url>https?://[^\]\s]+)\]$")


def suite_of(check: str) -> str:
    return check.split("::", 1)[0] if "::" in check else "-"


def promise_of(check: str) -> str:
    return CHECK_PROMISE.get(base_check(check)) or SUITE_PROMISE.get(suite_of(check)) or suite_of(check)


def finding_link(finding: str) -> str:
    """The upstream URL a finding's reason ends with (`... [https://...]`), if any."""
    match = _LINK.search(finding or "")
    return match.group("url") if match else ""


def skip_reason(record: CheckResult) -> str:
    text = record.message.strip()
    text = text.removeprefix("Skipped: ").strip()
    return (text.splitlines() or [""])[0]


def lacked_capability(record: CheckResult) -> str:
    """The capability a skipped record's engine lacks ("" if it was skipped for another reason)."""
    match = _LACKS.match(skip_reason(record))
    return match.group("cap") if match else ""


def describe_measure(m: Measure) -> str:
    unit = f" {m.unit}" if m.unit else ""
    text = f"{m.name} = {value_text(m.value, max_len=60)}{unit}"
    if m.op is not None:
        text += f" (expected {m.op} {value_text(m.bound, max_len=60)}{unit})"
    return text


def is_finding(record: CheckResult) -> bool:
    return record.outcome == "xfailed"


def finding_class(record: CheckResult) -> str:
    """A finding's class (kvconform.findings.CLASSES); "unclassified" for records before classes."""
    return record.finding_class or "unclassified"


def is_new_failure(record: CheckResult) -> bool:
    return record.outcome in ("failed", "error")


@dataclass
class Cell:
    engine: str
    check: str
    state: str  # pass | finding | failed | lacks | gpu | elsewhere | todo | skip | absent
    text: str  # short, for the cell
    detail: str = ""  # longer, for a tooltip / the markdown's notes
    link: str = ""


def cell_of(record: CheckResult) -> Cell:
    engine, check, outcome = record.engine, record.check, record.outcome
    measures = "; ".join(describe_measure(m) for m in record.violated_measures)
    if outcome in PASSING:
        return Cell(engine, check, "pass", "pass" if outcome == "passed" else "pass (XPASS)")
    if outcome == "xfailed":
        finding = record.finding
        return Cell(
            engine,
            check,
            "finding",
            f"{finding_class(record)}: {measures or first_line(record.message)}",
            first_line(finding, 400),
            finding_link(finding),
        )
    if outcome in ("failed", "error"):
        what = measures or first_line(record.message)
        detail = first_line(record.finding, 400) if record.finding else ""
        return Cell(engine, check, "failed", f"{outcome}: {what}", detail, finding_link(record.finding))
    if outcome == "skipped":
        return skipped_cell(engine, check, record)
    return Cell(engine, check, "failed", f"{outcome}: {first_line(record.message)}")


# the three kinds of empty cell a capability skip is (kvconform.inventory), apart from "skip"
_EMPTY_KIND = {
    inventory.LACKS: ("lacks", "n/a: engine lacks"),
    inventory.NEEDS_GPU: ("gpu", "needs a GPU:"),
    inventory.ELSEWHERE: ("elsewhere", "judged on another configuration:"),
    inventory.NOT_IMPLEMENTED: ("todo", "not implemented:"),
}


def skipped_cell(engine: str, check: str, record: CheckResult) -> Cell:
    """A capability skip as the kind of empty cell the engine's inventory says it is: the engine
    lacks the feature (cited), it needs a GPU, or the adapter does not reach it yet."""
    cap = lacked_capability(record)
    if not cap:
        return Cell(engine, check, "skip", f"skip: {skip_reason(record)}")
    missing = [c for c in Capability if re.search(rf"\b{c.value}\b", cap)]
    inv = _inventory(engine)
    kind = inventory.skip_kind(inv, missing) if inv is not None and missing else inventory.HAS
    if kind not in _EMPTY_KIND:  # no inventory, or missing in this mode only (attach)
        return Cell(engine, check, "skip", f"skip: lacks {cap}")
    state, label = _EMPTY_KIND[kind]
    assert inv is not None  # kind is HAS without one
    cells = [inv.cells[c] for c in missing if c in inv.cells and inv.cells[c].status == kind]
    named = ", ".join(c.capability.value for c in cells) or cap
    if kind == inventory.ELSEWHERE:
        named += " on " + ", ".join(sorted({c.judged_by for c in cells}))
    detail = "; ".join(f"{c.capability}: {c.note} ({c.source})" for c in cells)
    return Cell(engine, check, state, f"{label} {named}", detail)


@functools.cache
def _inventory(engine: str) -> inventory.EngineInventory | None:
    try:
        return inventory.load(engine)
    except KvconformError:
        return None


@dataclass
class Dashboard:
    engines: list[str]
    versions: dict[str, str]
    platform: str
    checks: list[str]  # rows, grouped by promise
    cells: dict[tuple[str, str], Cell] = field(default_factory=dict)  # (engine, check)
    counts: dict[str, int] = field(default_factory=dict)
    generated: float = field(default_factory=time.time)

    def cell(self, engine: str, check: str) -> Cell:
        return self.cells.get((engine, check)) or Cell(engine, check, "absent", "-")


def counts(records: Iterable[CheckResult]) -> dict[str, int]:
    out = {"checks": 0, "passed": 0, "findings": 0, "new_failures": 0, "skipped": 0}
    for r in records:
        out["checks"] += 1
        if r.outcome in PASSING:
            out["passed"] += 1
        elif is_finding(r):
            out["findings"] += 1
            key = f"findings_{finding_class(r)}"
            out[key] = out.get(key, 0) + 1
        elif r.outcome == "skipped":
            out["skipped"] += 1
        else:
            out["new_failures"] += 1
    return out


def headline(c: dict[str, int]) -> str:
    """ "N findings, M new failures" (+ passed / skipped), the report's and dashboard's first line."""
    f, n = c.get("findings", 0), c.get("new_failures", 0)
    classes = [
        f"{c[key]} {key.removeprefix('findings_')}"
        for key in sorted(c, key=_class_order)
        if key.startswith("findings_") and c[key]
    ]
    by_class = f" ({', '.join(classes)})" if classes else ""
    return (
        f"{f} finding{'s' if f != 1 else ''}{by_class}, {n} new failure{'s' if n != 1 else ''}; "
        f"{c.get('passed', 0)} passed, {c.get('skipped', 0)} skipped"
    )


def _class_order(key: str) -> int:
    order = ("defect", "known-upstream", "unconfirmed", "limitation", "unclassified")
    name = key.removeprefix("findings_")
    return order.index(name) if name in order else len(order)


def build(run: Run) -> Dashboard:
    session, records = run.session, run.records
    versions = {str(k): str(v) for k, v in (session.get("engines") or {}).items()}
    for r in records:
        versions.setdefault(r.engine, r.engine_version)
    engines = [e for e in versions if e != "-" and any(r.engine == e for r in records)]
    engines += sorted({r.engine for r in records} - set(engines))
    platform = str(session.get("platform") or next((r.platform for r in records if r.platform), "?"))
    order = {p: i for i, p in enumerate(PROMISES)}
    checks = sorted(
        {r.check for r in records},
        key=lambda c: (order.get(promise_of(c), len(order)), promise_of(c), c),
    )
    dash = Dashboard(engines, versions, platform, checks, counts=counts(records))
    for r in records:
        dash.cells[r.key] = cell_of(r)
    return dash


def load(results_dir: str | Path) -> Run:
    path = Path(results_dir)
    path = path / "results.json" if path.is_dir() else path
    if not path.is_file():
        raise UsageError(f"no results.json at {path} (a `kvconform run` or pytest --results-dir writes it)")
    try:
        return read(path)
    except RecordsError as exc:
        raise UsageError(str(exc)) from None


_MARK = {
    "pass": "✅",
    "finding": "🟧",
    "failed": "❌",
    "lacks": "—",
    "gpu": "🖥",
    "elsewhere": "↪",
    "todo": "❗",
    "skip": "⏭",
    "absent": "",
}


def empty_cells(dash: Dashboard) -> dict[str, dict[str, int]]:
    """Per engine, how many cells are empty of each kind (lacks, gpu, elsewhere, todo, skip)."""
    out: dict[str, dict[str, int]] = {
        e: dict.fromkeys(("lacks", "gpu", "elsewhere", "todo", "skip"), 0) for e in dash.engines
    }
    for (engine, _), cell in dash.cells.items():
        if cell.state in out.get(engine, {}):
            out[engine][cell.state] += 1
    return out


def empty_line(dash: Dashboard, engine: str) -> str:
    n = empty_cells(dash)[engine]
    return (
        f"{n['lacks']} engine lacks (cited), {n['gpu']} need a GPU, "
        f"{n['elsewhere']} judged on another configuration, "
        f"{n['todo']} not implemented, {n['skip']} other skips"
    )


def render_markdown(dash: Dashboard) -> str:
    lines = ["# kvconform conformance dashboard", ""]
    lines.append(f"**{headline(dash.counts)}** — {dash.counts.get('checks', 0)} checks")
    lines.append("")
    for engine in dash.engines:
        lines.append(
            f"- **{md_cell(engine)}** {md_cell(dash.versions.get(engine, '-'))}: {empty_line(dash, engine)}"
        )
    lines.append(f"- platform: {md_cell(dash.platform)}")
    lines.append(f"- generated: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(dash.generated))}")
    lines.append("")
    lines.append("| Promise | Check | " + " | ".join(md_cell(e) for e in dash.engines) + " |")
    lines.append("|---|---|" + "---|" * len(dash.engines))
    notes: list[str] = []
    empties: list[str] = []
    for check in dash.checks:
        row = [md_cell(promise_of(check)), f"`{md_cell(check)}`"]
        for engine in dash.engines:
            cell = dash.cell(engine, check)
            text = f"{_MARK[cell.state]} {md_cell(cell.text)}".strip()
            if cell.link:
                text += f" ([upstream]({cell.link}))"
            row.append(text)
            if cell.state == "finding" and cell.detail:
                notes.append(f"- {md_cell(engine)} `{md_cell(check)}`: {md_cell(cell.detail)}")
            elif cell.state in ("lacks", "gpu", "elsewhere", "todo") and cell.detail:
                empties.append(f"- {md_cell(engine)} `{md_cell(check)}`: {md_cell(cell.detail)}")
        lines.append("| " + " | ".join(row) + " |")
    if notes:
        lines += ["", "Findings:", "", *notes]
    if empties:
        lines += ["", "Empty cells, from each engine's inventory (docs/inventory.md):", "", *empties]
    return "\n".join(lines) + "\n"


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#1b1f24}
h1{font-size:20px;margin:0 0 6px} .headline{font-size:16px;font-weight:600;margin:6px 0 10px}
.meta{color:#555;font-size:13px;margin-bottom:14px} .meta b{color:#1b1f24}
table{border-collapse:collapse;font-size:12.5px}
th,td{border:1px solid #d0d7de;padding:4px 8px;vertical-align:top}
th{background:#f6f8fa;position:sticky;top:0} td.check{font-family:ui-monospace,monospace;white-space:nowrap}
td.promise{color:#555;white-space:nowrap} td.cell{max-width:340px}
td.pass{background:#dafbe1} td.finding{background:#fff1cc} td.failed{background:#ffd7d5}
td.skip{background:#f3f4f6;color:#57606a} td.absent{color:#bbb;text-align:center}
td.lacks{background:#fafafa;color:#8c959f} td.gpu{background:#eef4ff;color:#57606a}
td.todo{background:#fde2ff;color:#6e2c73} td.elsewhere{background:#f0f7f4;color:#3d6b57}
.legend span{display:inline-block;padding:1px 8px;margin-right:6px;border:1px solid #d0d7de;font-size:12px}
.legend .pass{background:#dafbe1} .legend .finding{background:#fff1cc} .legend .failed{background:#ffd7d5}
.legend .skip{background:#f3f4f6} .legend .lacks{background:#fafafa} .legend .gpu{background:#eef4ff}
.legend .todo{background:#fde2ff} .legend .elsewhere{background:#f0f7f4}
"""


def render_html(dash: Dashboard) -> str:
    e = html.escape
    head = [
        f"<b>{e(engine)}</b> {e(dash.versions.get(engine, '-'))} ({e(empty_line(dash, engine))})"
        for engine in dash.engines
    ]
    rows = []
    for check in dash.checks:
        cells = []
        for engine in dash.engines:
            cell = dash.cell(engine, check)
            link = (
                f' <a href="{e(cell.link)}" target="_blank" rel="noopener">upstream</a>' if cell.link else ""
            )
            title = f' title="{e(cell.detail)}"' if cell.detail else ""
            cells.append(
                f'<td class="cell {cell.state}" data-engine="{e(engine)}" data-check="{e(check)}" '
                f'data-state="{cell.state}"{title}>{e(cell.text)}{link}</td>'
            )
        rows.append(
            f'<tr><td class="promise">{e(promise_of(check))}</td><td class="check">{e(check)}</td>'
            + "".join(cells)
            + "</tr>"
        )
    generated = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(dash.generated))
    total = dash.counts.get("checks", 0)
    meta = " &middot; ".join(head) + f" &middot; platform <b>{e(dash.platform)}</b> &middot; {e(generated)}"
    columns = "".join(
        f'<th data-engine="{e(en)}">{e(en)}<br><small>{e(dash.versions.get(en, "-"))}</small></th>'
        for en in dash.engines
    )
    legend = "".join(
        f'<span class="{state}">{e(text)}</span>'
        for state, text in (
            ("pass", "pass"),
            ("finding", "finding (known, with its measure)"),
            ("failed", "failed (new)"),
            ("lacks", "n/a: the engine lacks the feature (cited)"),
            ("gpu", "needs a GPU (cannot run on this machine)"),
            ("elsewhere", "judged on another configuration of the same release"),
            ("todo", "not implemented yet (the engine has it)"),
            ("skip", "skip (other reason)"),
            ("absent", "- not applicable"),
        )
    )
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        "<title>kvconform conformance dashboard</title>"
        f"<style>{_CSS}</style></head><body>"
        "<h1>kvconform conformance dashboard</h1>"
        f'<div class="headline" id="headline">{e(headline(dash.counts))} — {total} checks</div>'
        f'<div class="meta" id="versions">{meta}</div>'
        f'<table id="dashboard"><thead><tr><th>Promise</th><th>Check</th>{columns}</tr></thead><tbody>'
        + "".join(rows)
        + f'</tbody></table><br><div class="legend">{legend}</div></body></html>\n'
    )


def write(results_dir: str | Path, html_path: str | Path | None = None) -> tuple[Path, Path]:
    """dashboard.md into the results dir, dashboard.html at `html_path` (default: beside it)."""
    results = Path(results_dir)
    dash = build(load(results))
    md = results / MARKDOWN_NAME
    md.write_text(render_markdown(dash))
    out = Path(html_path) if html_path else results / HTML_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(dash), encoding="utf-8")
    return md, out
