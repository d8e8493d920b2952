"""The main job: the suites against engines in a pytest subprocess, then the HTML report.

    kvconform run [--engine NAME]... [--results-dir DIR] [--report-dir DIR]
                  [--baseline RESULTS] [--history FILE] [-- PYTEST ARGS...]

Results land in DIR/results.json, Allure results in DIR/allure, the report in REPORT/index.html,
the conformance dashboard in DIR/dashboard.md and REPORT/dashboard.html (and inside the report as
a global attachment). The report is organised from results.json (promises, engines, findings as
failures, grouped skips: report.organise_results); Allure's history is kept in FILE (default
DIR/allure-history.jsonl: restore the previous run's to see trends). With --baseline, the gate's
verdict against that baseline is written to DIR/gate.md and shown as the report's quality gate
(it does not change the exit code: `kvconform gate` is the gate's own command).
The report is generated whatever the checks' outcome. The exit code is pytest's; pytest's 5
(no checks collected) stays a failure. A run whose checks passed but whose report could not be
generated exits 2.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from kvconform.errors import KvconformError
from kvconform.processes import run_child_session

NO_TESTS_COLLECTED = 5


def pytest_command(engines: list[str], results_dir: Path, pytest_args: list[str]) -> list[str]:
    """The pytest command line of the main job (without the interpreter)."""
    cmd = ["-m", "pytest", "--pyargs", "kvconform.suites"]
    for engine in engines:
        cmd += ["--engine", engine]
    cmd += ["--results-dir", str(results_dir), "--alluredir", str(results_dir / "allure")]
    cmd += ["--clean-alluredir", *pytest_args]
    return cmd


HISTORY_NAME = "allure-history.jsonl"


def run_main_job(
    engines: list[str],
    results_dir: str,
    report_dir: str,
    pytest_args: list[str],
    baseline: str | None = None,
    history: str | None = None,
    mutation_matrix: str | None = None,
    proof: str | None = None,
) -> int:
    results = Path(results_dir).resolve()
    report = Path(report_dir).resolve()
    results.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, *pytest_command(engines or ["reference"], results, pytest_args)]
    print(f"kvconform run: {' '.join(cmd)}", flush=True)
    code = run_child_session(cmd)
    assert code is not None  # no timeout given
    if code == NO_TESTS_COLLECTED:
        print("kvconform run: pytest collected no checks (exit 5): treated as a failure", file=sys.stderr)

    allure_dir = results / "allure"
    if not any(allure_dir.glob("*-result.json")):
        if (report / "index.html").is_file():
            shutil.rmtree(report)  # an older run's report must not pass for this run's
        print(f"kvconform run: no Allure results in {allure_dir}: no report generated", file=sys.stderr)
        return code or 2
    try:
        index = build_report(
            allure_dir,
            results,
            report,
            baseline,
            history or str(results / HISTORY_NAME),
            mutation_matrix,
            proof,
        )
    except KvconformError as exc:
        print(f"kvconform run: HTML report not generated: {exc}", file=sys.stderr)
        return code or 2
    merged = results / "results.json"
    if merged.exists():
        print(f"kvconform run: results: {merged}")
        print(f"kvconform run: dashboard: {results / 'dashboard.md'}, {report / 'dashboard.html'}")
    print(f"kvconform run: report: {index}")
    return code


def build_report(
    allure_dir: Path,
    results: Path,
    report: Path,
    baseline: str | None,
    history: str | None,
    mutation_matrix: str | None = None,
    proof: str | None = None,
) -> str:
    """Dashboard (markdown + HTML), gate verdict (with a baseline), then the HTML report (each
    check's page with the faults its measures were seen to kill, given a mutation matrix)."""
    from kvconform import dashboard
    from kvconform.allure_html import generate
    from kvconform.report import load_engine_proofs, load_kills

    html = None
    verdict = None
    if (results / "results.json").is_file():
        dash = dashboard.build(dashboard.load(results))
        (results / dashboard.MARKDOWN_NAME).write_text(dashboard.render_markdown(dash))
        html = dashboard.render_html(dash)
        if baseline:
            from kvconform import gate

            verdict = gate.compare(gate.load(baseline), gate.load(str(results)))
            (results / "gate.md").write_text(gate.render_markdown(verdict) + "\n")
            print(f"kvconform: gate against {baseline}: {'PASS' if verdict.passed else 'FAIL'}")
    index = generate(
        str(allure_dir),
        str(report),
        results_dir=str(results),
        history=history,
        gate=verdict,
        dashboard_html=html,
        kills=load_kills(mutation_matrix) if mutation_matrix else None,
        proofs=load_engine_proofs(proof) if proof else None,
    )
    if html is not None:
        (report / dashboard.HTML_NAME).write_text(html, encoding="utf-8")
    return index
