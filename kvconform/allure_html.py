"""Allure results -> one self-contained HTML report, with the Allure 3 generator (npm `allure`).

The generator is installed on first use into a cache outside the checkout, keyed by version:
    $KVCONFORM_NODE_ROOT (default ~/.cache/kvconform/node)/allure-<version>/
and runs offline from there afterwards. It needs `node` (and `npm` for that first install).
The report is written as a single index.html (the awesome plugin's singleFile mode): it opens
from disk or from a CI artifact without a web server, and calls nothing outside itself (the
template's analytics tags are removed).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvconform.errors import KvconformError, UsageError

ALLURE_VERSION = os.environ.get("KVCONFORM_ALLURE_VERSION", "3.18.0")
REPORT_NAME = "kvconform"
INSTALL_TIMEOUT_S = 600
GENERATE_TIMEOUT_S = 600
MIN_NODE_MAJOR = 20  # Allure 3's dependencies (chokidar, lru-cache, open...) want Node.js 20+
_MARKER = "kvconform-allure.json"


class ReportError(KvconformError):
    """The HTML report could not be generated."""


def node_root() -> Path:
    default = Path.home() / ".cache" / "kvconform" / "node"
    return Path(os.environ.get("KVCONFORM_NODE_ROOT", default))


def install_dir(version: str = ALLURE_VERSION) -> Path:
    return node_root() / f"allure-{version}"


def allure_cli(version: str = ALLURE_VERSION) -> Path:
    """The installed generator's entry script, installing it first if needed."""
    directory = install_dir(version)
    cli = directory / "node_modules" / "allure" / "cli.js"
    if (directory / _MARKER).is_file() and cli.is_file():
        return cli
    node = _node()
    npm = _require("npm")
    directory.parent.mkdir(parents=True, exist_ok=True)
    with _locked(directory.parent / f".allure-{version}.lock"):
        if (directory / _MARKER).is_file() and cli.is_file():
            return cli  # another process installed it while we waited
        staging = Path(tempfile.mkdtemp(prefix=f".allure-{version}-", dir=directory.parent))
        try:
            cmd = [
                npm,
                "install",
                "--prefix",
                str(staging),
                "--no-audit",
                "--no-fund",
                "--no-update-notifier",
                "--loglevel=error",
                f"allure@{version}",
            ]
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False
                )
            except subprocess.TimeoutExpired:
                raise ReportError(
                    f"npm install allure@{version} took over {INSTALL_TIMEOUT_S}s "
                    "(is the npm registry reachable?)"
                ) from None
            if proc.returncode != 0:
                raise ReportError(
                    f"npm install allure@{version} failed (exit {proc.returncode}; is the npm registry "
                    f"reachable?): {_tail(proc.stderr or proc.stdout)}"
                )
            if not (staging / "node_modules" / "allure" / "cli.js").is_file():
                raise ReportError(f"npm install allure@{version} left no node_modules/allure/cli.js")
            node_version = subprocess.run(
                [node, "--version"], capture_output=True, text=True, check=False
            ).stdout.strip()
            (staging / _MARKER).write_text(
                json.dumps({"allure": version, "node": node_version}, indent=1) + "\n"
            )
            staging.chmod(0o755)  # mkdtemp made it private; the cache may be shared
            if directory.exists():
                shutil.rmtree(directory)  # a broken install (no marker)
            staging.rename(directory)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)
    return cli


def generate(
    allure_results: str,
    out: str,
    results_dir: str | None = None,
    history: str | None = None,
    gate: Any = None,
    dashboard_html: str | None = None,
    kills: dict[str, list[tuple[str, list[str]]]] | None = None,
    proofs: dict[str, dict[str, list[tuple[str, list[str]]]]] | None = None,
) -> str:
    """Generate the HTML report of `allure_results` into `out`; return the index.html path.

    results_dir: the run's results.json (organises the report: promises, engines, findings as
    failures, grouped skips; see report.organise_results). history: Allure's history file
    (JSON lines, read and then appended to: trends across runs). gate: a gate.GateResult shown
    as the report's quality gate. dashboard_html: the conformance dashboard, attached to the
    report as a global attachment."""
    from kvconform import dashboard
    from kvconform import report as kvreport

    results = Path(allure_results).resolve()
    if not results.is_dir():
        raise UsageError(f"no Allure results directory at {results}")
    if not any(results.glob("*-result.json")):
        raise UsageError(f"{results} holds no Allure test results (*-result.json): nothing to report")
    report = Path(out).resolve()
    if report.exists():
        if not report.is_dir():
            raise UsageError(f"report directory {report} is a file")
        if any(report.iterdir()) and not (report / "index.html").exists():
            raise UsageError(f"{report} is not empty and holds no report: refusing to overwrite it")
        shutil.rmtree(report)
    run = dashboard.load(results_dir) if results_dir and Path(results_dir, "results.json").is_file() else None
    node = _node()
    cli = allure_cli()
    with tempfile.TemporaryDirectory(prefix="kvconform-allure-") as tmp:
        organised = Path(tmp) / "results"
        info = kvreport.organise_results(results, organised, run, dashboard_html, kills, proofs)
        name = REPORT_NAME
        if run is not None:
            engines = ", ".join(sorted(run.session.get("engines") or {}))
            name = f"{REPORT_NAME}: {info['headline']}" + (f" ({engines})" if engines else "")
        if gate is not None:
            name += f" · gate {'PASS' if gate.passed else 'FAIL'}"
        awesome = {"singleFile": True, "reportName": name, "groupBy": kvreport.GROUP_BY}
        allurerc: dict[str, Any] = {"name": name, "plugins": {"awesome": {"options": awesome}}}
        if history:
            allurerc["historyPath"] = str(Path(history).resolve())
            Path(history).resolve().parent.mkdir(parents=True, exist_ok=True)
        # an explicit config and a scratch cwd: no allurerc or known-issues file of the caller's
        # working directory leaks into the report
        config = Path(tmp) / "allurerc.json"
        config.write_text(json.dumps(allurerc))
        if gate is not None:
            gate_file = Path(tmp) / "quality-gate.json"
            gate_file.write_text(json.dumps(kvreport.quality_gate_results(gate, info["ids"])))
            script = Path(tmp) / "generate.mjs"
            script.write_text(_GENERATE_WITH_GATE)
            core = cli.parent.parent / "@allurereport" / "core" / "dist" / "index.js"
            cmd = [node, str(script), str(core), str(config), str(organised), str(report), str(gate_file)]
        else:
            cmd = [node, str(cli), "generate", str(organised), "-o", str(report), "--config", str(config)]
            cmd += ["--cwd", tmp]
        env = {**os.environ, "NO_COLOR": "1", "FORCE_COLOR": "0"}
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=GENERATE_TIMEOUT_S, cwd=tmp, env=env, check=False
            )
        except subprocess.TimeoutExpired:
            raise ReportError(f"allure generate took over {GENERATE_TIMEOUT_S}s on {results}") from None
    index = report / "index.html"
    if proc.returncode != 0 or not index.is_file():
        raise ReportError(
            f"allure generate failed (exit {proc.returncode}) on {results}: "
            f"{_tail(proc.stderr or proc.stdout)}"
        )
    _strip_analytics(index)
    return str(index)


# `allure generate` has no way to take quality-gate results from outside (only `allure run`
# validates its own rules): the same steps as its generate command, through the installed
# @allurereport/core, with the kvconform gate's verdict dispatched as the quality gate's results.
_GENERATE_WITH_GATE = """
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";
const [core, configPath, resultsDir, output, gatePath] = process.argv.slice(2);
const { AllureReport, readConfig } = await import(pathToFileURL(core).href);
const config = await readConfig(process.cwd(), configPath, { output });
const report = new AllureReport(config);
await report.start();
await report.readDirectory(resultsDir);
report.realtimeDispatcher.sendQualityGateResults(JSON.parse(readFileSync(gatePath, "utf-8")));
await report.done();
"""


# The generator's page template always embeds Google Analytics (no option turns it off): a report
# of an inference platform must not call out when opened, and on a closed network the pending
# request can hold the page's load event. Both of its tags go.
_ANALYTICS = re.compile(
    r"\s*<script async src=\"https://www\.googletagmanager\.com/gtag/js[^\"]*\"></script>"
    r"(\s*<script>\s*window\.dataLayer\s*=.*?</script>)?",
    re.DOTALL,
)


def _strip_analytics(index: Path) -> None:
    html = index.read_text(encoding="utf-8")
    cleaned = _ANALYTICS.sub("", html, count=1)
    if cleaned != html:
        index.write_text(cleaned, encoding="utf-8")


def _node() -> str:
    node = _require("node")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=False).stdout.strip()
    major = version.lstrip("v").split(".")[0]
    if not major.isdigit() or int(major) < MIN_NODE_MAJOR:
        raise UsageError(
            f"the Allure {ALLURE_VERSION} report generator needs Node.js >= {MIN_NODE_MAJOR}; "
            f"{node} is {version or 'unknown'} (use actions/setup-node, or NodeSource's nodejs package)"
        )
    return node


def _require(program: str) -> str:
    path = shutil.which(program)
    if path is None:
        raise UsageError(
            f"`{program}` not found: the HTML report needs Node.js and npm "
            f"(Node.js >= {MIN_NODE_MAJOR} with npm: actions/setup-node in CI, NodeSource's nodejs on Debian)"
        )
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _tail(text: str, lines: int = 8) -> str:
    kept = [ln for ln in (text or "").strip().splitlines() if ln.strip()][-lines:]
    return " | ".join(kept) or "(no output)"
