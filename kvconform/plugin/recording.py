"""Recording: one record per test into results.json (also under xdist, also when a worker
dies), the Allure attachments of each verdict, the session's metadata."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pluggy
import pytest

from kvconform import findings, report, timing
from kvconform.checkids import from_nodeid
from kvconform.contract.adapter import take_relaunch_notes
from kvconform.memory import nvml
from kvconform.plugin.collection import check_id, engine_of
from kvconform.plugin.fixtures import outcome_key, verdict_key
from kvconform.plugin.session import kv_session, results_dir, selected_engines
from kvconform.processes import stop_all_live
from kvconform.results import CheckRecord, Inconclusive, RecordWriter, Verdict, merge

RECORD_KEY = "kvconform-record"
INCONCLUSIVE_KEY = "kvconform-inconclusive"
_results_path_key = pytest.StashKey[Path]()
_inconclusive_key = pytest.StashKey[bool]()
_time_key = pytest.StashKey[dict[str, timing.EngineTime]]()


def _judge_finding(
    item: pytest.Item,
    rep: pytest.TestReport,
    call: pytest.CallInfo[None],
    entry: findings.Finding,
    verdict: Verdict | None,
) -> None:
    """A known finding's strict xfail: xfailed only if the check's verdict failed on exactly
    the finding's measures; a pass is XPASS(strict), anything else a failure saying why."""
    failed = call.excinfo.value if call.excinfo is not None else None
    judged = findings.judge(entry, failed, verdict)
    if judged.expected:
        rep.outcome = "skipped"
        rep.wasxfail = entry.reason()  # pytest's own xfailed status (terminal, allure, records)
        return
    rep.outcome = "failed"
    head = "[XPASS(strict)] " if failed is None else "[finding mismatch] "
    lines = [head + judged.explanation, f"finding: {entry.reason()}"]
    original = rep.longreprtext if failed is not None else ""
    text = "\n".join(f"E   {ln}" for ln in lines)
    rep.longrepr = text + ("\n\n" + original if original else "")


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


class Recording:
    """Hooks of every process of a run (controller and xdist workers)."""

    @staticmethod
    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(item: pytest.Item) -> None:
        item.stash[_time_key] = timing.snapshot()

    @staticmethod
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(
        item: pytest.Item, call: pytest.CallInfo[None]
    ) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
        outcome = yield
        rep: pytest.TestReport = outcome.get_result()
        verdict = item.stash.get(verdict_key, None)
        entry = item.stash.get(findings.ENTRY_KEY, None)
        if rep.when == "call":
            if entry is not None and not rep.skipped:
                _judge_finding(item, rep, call, entry, verdict)
            item.stash[outcome_key] = rep.outcome
            if rep.failed and call.excinfo is not None and isinstance(call.excinfo.value, Inconclusive):
                item.stash[_inconclusive_key] = True
                rep.user_properties.append((INCONCLUSIVE_KEY, "1"))
        name = engine_of(item)
        if rep.failed and name is not None:
            report.attach_failure_context(item, kv_session(item.config).adapters.get(name))
        if rep.when == "teardown":  # every test has one, skipped or not: one record per test
            if verdict is not None:
                report.attach_verdict(verdict)
            adapter = kv_session(item.config).adapters.get(name) if name else None
            payload = {
                "check": check_id(item),
                "engine": name or "-",
                "engine_version": adapter.version if adapter else "-",
                "measures": (verdict.as_dict()["measures"] if verdict else [])
                + (take_relaunch_notes(adapter) if adapter is not None else []),  # a relaunch
                "violated": [m.name for m in verdict.failures] if verdict else [],
            }
            if item.stash.get(_inconclusive_key, False):
                payload["inconclusive"] = True
            if _time_key in item.stash:
                payload["engine_time"] = timing.since(item.stash[_time_key])
            if entry is not None:
                payload["finding"] = entry.reason()
                payload["finding_measures"] = [m.describe() for m in entry.measures]
                payload["finding_class"] = entry.klass
            rep.user_properties.append((RECORD_KEY, json.dumps(payload)))

    @staticmethod
    @pytest.hookimpl(trylast=True)
    def pytest_sessionstart(session: pytest.Session) -> None:
        if not is_worker(session.config):
            out = results_dir(session.config)
            for stale in [*out.glob("records-*.jsonl"), out / "results.json"]:
                stale.unlink(missing_ok=True)  # one session's results per directory
            session.config.pluginmanager.register(RecordCollector(session.config), "kvconform-records")

    @staticmethod
    def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
        stop_all_live()
        if is_worker(session.config):
            return
        kv = kv_session(session.config)
        adapters = {n: kv.adapter(n) for n in selected_engines(session.config)}
        meta = {
            "engines": {n: a.version for n, a in adapters.items()},
            "engine_options": {n: a.ctx.options for n, a in adapters.items() if any(a.ctx.options.values())},
            "platform": kv.platform(),
            "host": platform.node(),
            "started": kv.started,
            "finished": time.time(),
            "exitstatus": int(exitstatus),
            # this process's ledger (without xdist: the whole session, teardowns included)
            "engine_time": timing.since({}),
        }
        mutant = kv.mutant_meta()
        if mutant is not None:
            meta["mutant"] = mutant
        path = merge(kv.results_dir, meta)
        if not meta["engine_time"] and session.config.pluginmanager.hasplugin("dsession"):
            records = json.loads(path.read_text())["records"]
            meta["engine_time"] = timing.summed([r.get("engine_time") or {} for r in records])
            path = merge(kv.results_dir, meta)
        report.write_allure_environment(session.config, meta)
        session.config.stash[_results_path_key] = path

    @staticmethod
    def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        path = config.stash.get(_results_path_key, None)
        if path is not None:
            terminalreporter.write_line(f"kvconform: results written to {path}")
        mutant = kv_session(config).mutant_meta() if config.getoption("--mutant") else None
        if mutant is not None:
            applied = ", ".join(mutant["applied"]) or "NOTHING: the engine never imported the patched modules"
            terminalreporter.write_line(
                f"kvconform: mutant {mutant['name']} of {mutant['engine']} patched {applied}"
            )


class RecordCollector:
    """Runs where reports arrive (the controller under xdist): one record per test."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.writer = RecordWriter(results_dir(config))
        self.partial: dict[str, dict[str, Any]] = {}

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        state = self.partial.setdefault(report.nodeid, {"outcome": "passed", "duration": 0.0, "message": ""})
        state["duration"] += report.duration
        if report.failed:
            state["outcome"] = "failed" if report.when == "call" else "error"
            if report.when == "call" and any(k == INCONCLUSIVE_KEY for k, _ in report.user_properties):
                state["outcome"] = "inconclusive"  # not decided either way: never a pass
            state["message"] = state["message"] or _short_message(report)
        elif report.skipped:
            if hasattr(report, "wasxfail"):
                state["outcome"] = "xfailed"
            elif state["outcome"] == "passed":
                state["outcome"] = "skipped"
            state["message"] = state["message"] or _short_message(report)
        elif report.when == "call" and hasattr(report, "wasxfail"):
            state["outcome"] = "xpassed"
        payload = next((json.loads(str(v)) for k, v in report.user_properties if k == RECORD_KEY), None)
        if payload is None:
            if report.when != "???":  # only the final phase of a test carries the record
                return
            # pytest-xdist: the worker died mid-test; keep the record, nothing is lost.
            check, engine = from_nodeid(report.nodeid, selected_engines(self.config))
            payload = {"check": check, "engine": engine, "engine_version": "-", "measures": []}
        self.partial.pop(report.nodeid, None)
        self.writer.write(
            CheckRecord(
                check=payload["check"],
                nodeid=report.nodeid,
                engine=payload["engine"],
                engine_version=payload["engine_version"],
                platform=nvml().describe(),
                outcome=state["outcome"],
                duration_s=round(state["duration"], 3),
                measures=payload["measures"],
                message=state["message"][:4000],
                finding=payload.get("finding", ""),
                finding_measures=payload.get("finding_measures", []),
                finding_class=payload.get("finding_class", ""),
                violated=payload.get("violated", []),
                engine_time=payload.get("engine_time", {}),
            )
        )


def _short_message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = report.longreprtext or ""
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")]
    return "\n".join(ln[2:].strip() for ln in lines) or text[-2000:]
