"""Recording: one record per test into results.json (also under xdist, also when a worker
dies), the Allure attachments of each verdict, the session's metadata."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconform import findings, report
from kvconform.checkids import from_nodeid
from kvconform.memory import nvml
from kvconform.plugin.collection import check_id, engine_of
from kvconform.plugin.fixtures import outcome_key, verdict_key
from kvconform.plugin.session import kv_session, results_dir, selected_engines
from kvconform.processes import stop_all_live
from kvconform.results import CheckRecord, RecordWriter, merge

RECORD_KEY = "kvconform-record"
_results_path_key = pytest.StashKey[Path]()


def is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


class Recording:
    """Hooks of every process of a run (controller and xdist workers)."""

    @staticmethod
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
        outcome = yield
        rep: pytest.TestReport = outcome.get_result()
        if rep.when == "call":
            item.stash[outcome_key] = rep.outcome
        verdict = item.stash.get(verdict_key, None)
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
                "measures": verdict.as_dict()["measures"] if verdict else [],
            }
            entry = item.stash.get(findings.ENTRY_KEY, None)
            if entry is not None:
                payload["finding"] = entry.reason()
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
        }
        path = merge(kv.results_dir, meta)
        report.write_allure_environment(session.config, meta)
        session.config.stash[_results_path_key] = path

    @staticmethod
    def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
        path = config.stash.get(_results_path_key, None)
        if path is not None:
            terminalreporter.write_line(f"kvconform: results written to {path}")


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
            state["message"] = state["message"] or _short_message(report)
        elif report.skipped:
            if hasattr(report, "wasxfail"):
                state["outcome"] = "xfailed"
            elif state["outcome"] == "passed":
                state["outcome"] = "skipped"
            state["message"] = state["message"] or _short_message(report)
        elif report.when == "call" and hasattr(report, "wasxfail"):
            state["outcome"] = "xpassed"
        payload = next((json.loads(v) for k, v in report.user_properties if k == RECORD_KEY), None)
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
            )
        )


def _short_message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])
    text = report.longreprtext or ""
    lines = [ln for ln in text.splitlines() if ln.startswith("E ")]
    return "\n".join(ln[2:].strip() for ln in lines) or text[-2000:]
