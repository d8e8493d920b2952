"""The corpus table: docs/history.md (+ .json beside it), dated, with the commit."""

from __future__ import annotations

import datetime
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvconform.formatting import md_cell
from kvconform.history.corpus import Defect
from kvconform.history.verdict import Side, Verdict
from kvconform.results import source_commit

Row = dict[str, Any]


def _side(side: Side) -> dict[str, Any]:
    return {
        "version": side.version,
        "held": side.held,
        "values": side.values,
        "outcomes": side.outcomes,
        "why": side.why,
    }


def rows(verdicts: Sequence[Verdict], defects: Sequence[Defect], previous: dict[str, Row]) -> list[Row]:
    """One row per bug of the corpus, in corpus order: run now, kept from `previous`, or
    unreachable (with its reason)."""
    now = {v.defect.id: v for v in verdicts}
    out: list[Row] = []
    for d in defects:
        row: Row = {
            k: getattr(d, k)
            for k in ("id", "engine", "upstream", "title", "bad", "fixed", "check", "measure")
        }
        if d.unreachable:
            row.update(status="unreachable", why=d.unreachable)
        elif d.id in now:
            v = now[d.id]
            row.update(status=v.status, bad_side=_side(v.bad), fixed_side=_side(v.fixed))
            row["run"] = datetime.date.today().isoformat()
        elif d.id in previous:
            row = {**previous[d.id], **row}
        else:
            row.update(status="not run")
        out.append(row)
    return out


def read(out: Path) -> dict[str, Row]:
    path = out.with_suffix(".json")
    if not path.exists():
        return {}
    return {r["id"]: r for r in json.loads(path.read_text()).get("rows", [])}


def recall_line(table: Sequence[Row]) -> str:
    tried = [r for r in table if r["status"] not in ("unreachable", "not run")]
    caught = [r for r in tried if r["status"] == "caught"]
    engines = sorted({r["engine"] for r in caught})
    return (
        f"caught {len(caught)} of {len(tried)} shipped bugs tried ({len(engines)} engines: "
        f"{', '.join(engines) or 'none'}); "
        f"{sum(r['status'] == 'unreachable' for r in table)} more not reachable here"
    )


def _fmt_side(side: dict[str, Any] | None) -> str:
    if not side:
        return "—"
    if side.get("held") is None:
        return f"{side['version']}: not judged ({side.get('why', '')})"
    values = ", ".join(str(v) for v in side.get("values", []))
    return f"{side['version']}: {values} ({'held' if side['held'] else 'VIOLATED'})"


def _releases(row: Row) -> str:
    return f", {row['bad']} → {row['fixed']}" if row["bad"] else ""


def render(table: Sequence[Row], commit: str) -> str:
    lines = [
        "# Shipped bugs: the release-history corpus",
        "",
        f"Written by `make history` (`kvconform history`) on {datetime.date.today().isoformat()} at commit "
        f"{commit}. The corpus is kvconform/history/defects.toml: each bug's last bad and first fixed "
        "release, run through the check and measure named there, each release in its own environment.",
        "",
        f"**{recall_line(table)}.**",
        "",
        "| bug | engine | bad → fixed | check :: measure | verdict | bad release | fixed release |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in table:
        if r["status"] == "unreachable":
            continue
        bad = md_cell(_fmt_side(r.get("bad_side")))
        fixed = md_cell(_fmt_side(r.get("fixed_side")))
        lines.append(
            f"| [{r['id']}]({r['upstream']}) {md_cell(r['title'])} "
            f"| {r['engine']} | {r['bad']} → {r['fixed']} | `{r['check']}` :: `{r['measure']}` "
            f"| **{r['status']}** | {bad} | {fixed} |"
        )
    unreachable = [r for r in table if r["status"] == "unreachable"]
    if unreachable:
        lines += ["", "## Tried and not reachable here", ""]
        lines += [
            f"- [{r['id']}]({r['upstream']}) ({r['engine']}{_releases(r)}) "
            f"{md_cell(r['title'])}: {md_cell(r['why'])}"
            for r in unreachable
        ]
    return "\n".join(lines) + "\n"


def write(table: Sequence[Row], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(table, source_commit()))
    out.with_suffix(".json").write_text(
        json.dumps({"commit": source_commit(), "rows": list(table)}, indent=1) + "\n"
    )
