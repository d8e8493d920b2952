"""The conformance dashboard and the organising of Allure results, on records made up here
(no engine, no Node.js): each cell state, the headline counts, promises, grouped skips, findings
as failures with their link, named fixture steps, the gate as quality-gate results."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvconform import cli, dashboard, gate, report
from kvconform.errors import UsageError
from kvconform.records import Run

LINK = "https://example.org/upstream/issue/7"


def _record(engine: str, check: str, outcome: str, **kw: Any) -> dict[str, Any]:
    suite, _, name = check.partition("::")
    nodeid = f"kvconform/suites/{suite}/test_x.py::{name.split('[')[0]}[{engine}]"
    return {
        "check": check,
        "nodeid": nodeid,
        "engine": engine,
        "engine_version": {"lmcache": "0.5.6", "sglang": "0.5.23"}[engine],
        "platform": "NVIDIA H200 (driver 570.1)",
        "outcome": outcome,
        "duration_s": 1.0,
        "measures": kw.get("measures", []),
        "message": kw.get("message", ""),
        "finding": kw.get("finding", ""),
        "finding_class": kw.get("finding_class", ""),
    }


LEAK = {
    "name": "server_shm_mapped_bytes.leak_slope",
    "value": 4194304.0,
    "unit": "B/cycle",
    "op": "<=",
    "bound": 4096,
    "ok": False,
}
RECORDS = [
    _record(
        "lmcache",
        "memory_reclaim::test_churn_returns_to_baseline",
        "xfailed",
        measures=[LEAK],
        finding=f"defect on lmcache 0.5.6: shm kept mapped (measured: +4 MiB/cycle) [{LINK}]",
        finding_class="defect",
        message="AssertionError: leak",
    ),
    _record("sglang", "memory_reclaim::test_churn_returns_to_baseline", "passed"),
    _record(
        "lmcache",
        "prefix_reuse::test_events_replayed_into_router_index_match",
        "skipped",
        message="Skipped: engine lmcache lacks capability radix_cache_model",
    ),
    _record(
        "lmcache",
        "prefix_reuse::test_radix_cache_state_machine",
        "skipped",
        message="Skipped: engine lmcache lacks capability radix_cache_model",
    ),
    _record(
        "sglang",
        "transfer::test_transfer_bytes_reconcile",
        "failed",
        measures=[{"name": "bytes_delta", "value": 12, "unit": "B", "op": "==", "bound": 0, "ok": False}],
        message="AssertionError: bytes",
    ),
]
DATA = {
    "session": {"engines": {"lmcache": "0.5.6", "sglang": "0.5.23"}, "platform": "NVIDIA H200"},
    "records": RECORDS,
}


def test_cells_headline_and_versions() -> None:
    dash = dashboard.build(Run.from_data(DATA))
    assert dash.engines == ["lmcache", "sglang"]
    finding = dash.cell("lmcache", "memory_reclaim::test_churn_returns_to_baseline")
    assert finding.state == "finding" and "leak_slope = 4.1943e+06 B/cycle (expected <= 4096" in finding.text
    assert finding.link == LINK
    assert dash.cell("sglang", "memory_reclaim::test_churn_returns_to_baseline").state == "pass"
    skip = dash.cell("lmcache", "prefix_reuse::test_radix_cache_state_machine")
    # LMCache has no radix cache (its inventory says so, cited): n/a, not "not implemented"
    assert (skip.state, skip.text) == ("lacks", "n/a: engine lacks radix_cache_model") and skip.detail
    failed = dash.cell("sglang", "transfer::test_transfer_bytes_reconcile")
    assert failed.state == "failed" and "bytes_delta = 12 B (expected == 0 B)" in failed.text
    assert dash.cell("lmcache", "transfer::test_transfer_bytes_reconcile").state == "absent"
    assert dashboard.headline(dash.counts).startswith("1 finding (1 defect), 1 new failure;")
    # rows grouped by promise, in the brief's order
    assert dashboard.promise_of("transfer::test_release_guard_holds") == dashboard.RELEASED_ONCE
    assert dash.checks[0].startswith("memory_reclaim::") and dash.checks[-1].startswith("transfer::")

    md = dashboard.render_markdown(dash)
    assert "**lmcache** 0.5.6" in md and "**sglang** 0.5.23" in md and "NVIDIA H200" in md
    assert f"([upstream]({LINK}))" in md
    page = dashboard.render_html(dash)
    assert page.count('class="cell ') == 2 * len(dash.checks)
    assert 'data-state="finding"' in page and 'data-state="lacks"' in page and 'data-state="absent"' in page


def test_dashboard_command_writes_markdown_and_html(tmp_path: Path, capsys: Any) -> None:
    (tmp_path / "results.json").write_text(json.dumps(DATA))
    assert cli.main(["dashboard", str(tmp_path), "--html", str(tmp_path / "report" / "dashboard.html")]) == 0
    assert (tmp_path / "dashboard.md").read_text().startswith("# kvconform conformance dashboard")
    assert 'id="dashboard"' in (tmp_path / "report" / "dashboard.html").read_text()
    assert "1 finding (1 defect), 1 new failure" in capsys.readouterr().out


def _allure_result(record: dict[str, Any], status: str, message: str = "") -> dict[str, Any]:
    full, name = report.result_key(record["nodeid"])
    return {
        "uuid": f"u-{record['engine']}-{record['check']}",
        "name": name,
        "fullName": full,
        "status": status,
        "statusDetails": {"message": message},
        "labels": [{"name": "parentSuite", "value": "suites.x"}, {"name": "host", "value": "h"}],
        "start": 1,
        "stop": 2,
    }


def test_organised_results(tmp_path: Path) -> None:
    src, dst = tmp_path / "allure", tmp_path / "organised"
    src.mkdir()
    statuses = {"xfailed": "skipped", "passed": "passed", "skipped": "skipped", "failed": "failed"}
    for r in RECORDS:
        result = _allure_result(r, statuses[r["outcome"]], "XFAIL finding on ..." if r["finding"] else "")
        (src / f"{result['uuid']}-result.json").write_text(json.dumps(result))
    container = {
        "uuid": "c1",
        "children": [f"u-lmcache-{RECORDS[0]['check']}"],
        "befores": [{"name": "verdict", "status": "passed", "start": 1, "stop": 1}],
        "afters": [
            {"name": "verdict::1", "status": "passed", "start": 2, "stop": 2},
            {"name": "verdict::<lambda>", "start": 3},  # never ran
        ],
    }
    (src / "c1-container.json").write_text(json.dumps(container))
    (src / "environment.properties").write_text("platform=NVIDIA H200\n")
    matrix = tmp_path / "mutation-matrix.json"
    churn = "memory_reclaim::test_churn_returns_to_baseline"
    rows = [
        {"check": churn, "measure": "server_shm_mapped_bytes.leak_slope", "killed_by": ["leak_on_unregister"]}
    ]
    matrix.write_text(json.dumps({"measures": rows}))
    kills = report.load_kills(matrix)
    info = report.organise_results(
        src, dst, Run.from_data(DATA), dashboard_html="<html>dash</html>", kills=kills
    )

    results = [json.loads(p.read_text()) for p in dst.glob("*-result.json")]
    labels = {r["name"]: {(lab["name"], lab["value"]) for lab in r["labels"]} for r in results}
    finding = next(r for r in results if r["name"].startswith("known finding (defect): "))
    assert finding["status"] == "failed"
    assert "leak_slope = 4.1943e+06 B/cycle" in finding["name"]
    message = finding["statusDetails"]["message"]
    assert message.startswith("Known finding (defect) on lmcache 0.5.6: shm kept mapped")
    defects = next(c for c in report.CATEGORIES if c["name"] == report.FINDING_CATEGORIES["defect"])
    assert re.match(defects["messageRegex"], finding["statusDetails"]["message"])
    assert not any(
        re.match(c["messageRegex"], finding["statusDetails"]["message"])
        for c in report.CATEGORIES
        if c is not defects and "messageRegex" in c and c["name"].startswith("Finding")
    )
    assert finding["links"] == [{"type": "issue", "name": f"upstream: {LINK}", "url": LINK}]
    assert {
        ("epic", dashboard.MEMORY),
        ("feature", "memory_reclaim"),
        ("story", "memory_reclaim::test_churn_returns_to_baseline"),
        ("parentSuite", "lmcache"),
        ("tag", report.FINDING_TAG),
    } <= labels[finding["name"]]
    assert ("parentSuite", "suites.x") not in labels[finding["name"]]
    # each check's page: the faults its measures were seen to kill (the mutation matrix)
    assert "**Seen to fail**" in finding["description"]
    assert "- `server_shm_mapped_bytes.leak_slope`: leak_on_unregister" in finding["description"]
    assert finding["description"].startswith("**Known finding (defect)**")
    matrix.write_text("not json")
    with pytest.raises(UsageError, match="mutation matrix"):
        report.load_kills(matrix)
    # with the per-engine proof table, a real engine's page says what violated it on that engine
    proof = tmp_path / "mutants.json"
    measures = {
        f"{churn} :: server_shm_mapped_bytes.leak_slope": ["mutant shm_kept_mapped"],
        f"{churn} :: server_rss_bytes.leak_slope": [],
    }
    reasons = {f"{churn} :: server_rss_bytes.leak_slope": "RSS noise above one instance"}
    proof.write_text(json.dumps([{"engine": "lmcache", "measures": measures, "unproven_reasons": reasons}]))
    proofs = report.load_engine_proofs(proof)
    report.organise_results(src, tmp_path / "by-engine", Run.from_data(DATA), kills=kills, proofs=proofs)
    paged = [json.loads(p.read_text()) for p in (tmp_path / "by-engine").glob("*-result.json")]
    page = next(r for r in paged if r["name"].startswith("known finding (defect): "))
    assert (
        "**Seen to fail on lmcache**" in page["description"] and "**Seen to fail**" not in page["description"]
    )
    assert "- `server_shm_mapped_bytes.leak_slope`: mutant shm_kept_mapped" in page["description"]
    assert (
        "- `server_rss_bytes.leak_slope`: unproven on lmcache: RSS noise above one instance"
        in page["description"]
    )
    proof.write_text("[1]")
    with pytest.raises(UsageError, match="proof table"):
        report.load_engine_proofs(proof)
    assert ("tag", report.NEW_FAILURE_TAG) in labels["transfer::test_transfer_bytes_reconcile"]
    # two capability skips of one engine and reason: one result
    skips = [r for r in results if r["status"] == "skipped"]
    assert [s["name"] for s in skips] == ["engine lmcache lacks radix_cache_model: 2 checks"]
    assert "prefix_reuse::test_radix_cache_state_machine" in skips[0]["description"]
    assert len(results) == len(RECORDS) - 1
    steps = json.loads((dst / "c1-container.json").read_text())
    assert [f["name"] for f in steps["befores"]] == ["setup: open the check's verdict"]
    assert [f["name"] for f in steps["afters"]] == ["teardown: verify the verdict was concluded"]
    globals_ = json.loads(next(dst.glob("*-globals.json")).read_text())
    assert globals_["attachments"][0]["name"] == "Conformance dashboard"
    assert (dst / globals_["attachments"][0]["source"]).read_text() == "<html>dash</html>"
    env = (dst / "environment.properties").read_text()
    assert (
        "kvconform.findings=1" in env and "kvconform.new_failures=1" in env and "platform=NVIDIA H200" in env
    )
    assert info["headline"].startswith("1 finding (1 defect), 1 new failure")

    # the gate as quality-gate results: the verdict, then one failed rule per blocking row
    base_dir, cand_dir = tmp_path / "base", tmp_path / "cand"
    base_dir.mkdir()
    cand_dir.mkdir()
    baseline = json.loads(json.dumps(DATA))
    baseline["records"][4]["outcome"] = "passed"
    (base_dir / "results.json").write_text(json.dumps(baseline))
    (cand_dir / "results.json").write_text(json.dumps(DATA))
    verdict = gate.compare(gate.load(str(base_dir)), gate.load(str(cand_dir)))
    qg = report.quality_gate_results(verdict, info["ids"])
    assert qg[0]["rule"] == "kvconform gate" and qg[0]["success"] is False
    assert any(
        q["rule"].startswith("new failure: sglang transfer::test_transfer_bytes_reconcile") for q in qg[1:]
    )
    assert qg[0]["testResults"] == [info["ids"][("sglang", "transfer::test_transfer_bytes_reconcile")]]
