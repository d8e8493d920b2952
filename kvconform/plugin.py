"""The pytest plugin: options, engine parametrization, capability skips, results, findings."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from adapters import ADAPTERS, adapter_class
from adapters.base import AdapterContext, Capability, EngineAdapter
from kvconform import findings, report
from kvconform.checkids import from_nodeid, matches
from kvconform.errors import KvconformError
from kvconform.memory import nvml
from kvconform.processes import stop_all_live
from kvconform.prompts import PromptFactory
from kvconform.results import CheckRecord, RecordWriter, Verdict, merge

RECORD_KEY = "kvconform-record"
_verdict_key = pytest.StashKey[Verdict]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvconform", "KV-cache conformance")
    group.addoption(
        "--engine",
        action="append",
        default=[],
        metavar="NAME",
        help=f"engine to check, repeatable ({', '.join(ADAPTERS)}); default: reference",
    )
    group.addoption(
        "--engine-url",
        default=None,
        metavar="URL",
        help="attach to a server someone else started instead of launching one",
    )
    group.addoption(
        "--engine-env",
        action="append",
        default=[],
        metavar="ENGINE=SPEC",
        help="use another environment spec for an engine (e.g. lmcache=lmcache-0.5.5)",
    )
    group.addoption(
        "--fault",
        action="append",
        default=[],
        metavar="NAME",
        help="inject a reference-engine fault, repeatable (see `kvconform faults`)",
    )
    group.addoption(
        "--churn-cycles",
        type=int,
        default=4,
        metavar="N",
        help="instance churn cycles per memory_reclaim check (default 4)",
    )
    group.addoption(
        "--session-turns",
        type=int,
        default=24,
        metavar="M",
        help="turns of the long-session memory check (default 24)",
    )
    group.addoption(
        "--leak-slope-bytes",
        type=float,
        default=None,
        metavar="B",
        help="leak slope bound in bytes per cycle (default: one KV block of the engine)",
    )
    group.addoption(
        "--memory-tolerance-bytes",
        type=float,
        default=None,
        metavar="B",
        help="final-delta bound vs baseline (default: per measure, see README)",
    )
    group.addoption(
        "--results-dir",
        default="results",
        metavar="DIR",
        help="where check records (results.json) are written (default: results/)",
    )
    group.addoption(
        "--known-failures",
        default=None,
        metavar="FILE",
        help="known-failures manifest (default: ci/known-failures.toml)",
    )
    group.addoption(
        "--check",
        action="append",
        default=[],
        metavar="GLOB",
        help="run only checks whose id (as in results.json) matches, repeatable",
    )
    group.addoption(
        "--engine-start-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="seconds an engine may take to become healthy (default 300)",
    )


def selected_engines(config: pytest.Config) -> list[str]:
    return config.getoption("--engine") or ["reference"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "requires(*capabilities): engine capabilities a check needs")
    config.addinivalue_line("markers", "check(id): stable check id")
    try:
        _validate_options(config)
    except KvconformError as exc:
        raise pytest.UsageError(f"kvconform: {exc}") from None
    config.stash[_session_key] = KvSession(config)


def _validate_options(config: pytest.Config) -> None:
    engines = selected_engines(config)
    unknown_engines = [name for name in engines if name not in ADAPTERS]
    if unknown_engines:
        adapter_class(unknown_engines[0])  # raises the one-line "unknown engine" error
    url = config.getoption("--engine-url")
    if url and len(engines) != 1:
        raise KvconformError("--engine-url attaches to one engine; give exactly one --engine")
    faults = config.getoption("--fault")
    if faults:
        if engines != ["reference"]:
            raise KvconformError("--fault applies to the reference engine only")
        from engines.reference.faults import FAULTS

        unknown = [f for f in faults if f not in FAULTS]
        if unknown:
            raise KvconformError(f"unknown fault(s) {unknown} (known: {', '.join(FAULTS)})")
    for name in engines:
        adapter_class(name)  # imports the adapter (torch for the reference engine): last
    if _is_worker(config):
        return  # the controller already probed engines and URLs
    kv_session_probe = KvSession(config)
    for name in engines:
        kv_session_probe.preflight(name)


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


class KvSession:
    """Per-process state: adapters (one live engine per name), results, platform."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.results_dir = Path(config.getoption("--results-dir")).resolve()
        self.workdir = self.results_dir / "work" / os.environ.get("PYTEST_XDIST_WORKER", "main")
        self.adapters: dict[str, EngineAdapter] = {}
        self.writer: RecordWriter | None = None
        self.started = time.time()
        self.env_overrides = dict(
            item.split("=", 1) for item in config.getoption("--engine-env") if "=" in item
        )

    def context(self, name: str) -> AdapterContext:
        return AdapterContext(
            workdir=self.workdir / name,
            url=self.config.getoption("--engine-url"),
            faults=tuple(self.config.getoption("--fault")),
            start_timeout_s=self.config.getoption("--engine-start-timeout"),
            env_name=self.env_overrides.get(name),
        )

    def preflight(self, name: str) -> None:
        adapter = adapter_class(name)(self.context(name))
        adapter.preflight()

    def adapter(self, name: str) -> EngineAdapter:
        if name not in self.adapters:
            self.adapters[name] = adapter_class(name)(self.context(name))
        return self.adapters[name]

    def platform(self) -> str:
        return nvml().describe()


_session_key = pytest.StashKey[KvSession]()


def kv_session(config: pytest.Config) -> KvSession:
    return config.stash[_session_key]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "engine_name" in metafunc.fixturenames:
        metafunc.parametrize("engine_name", selected_engines(metafunc.config), scope="session")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = config.getoption("--check")
    if wanted:
        keep = [i for i in items if any(matches(check_id(i), g) for g in wanted)]
        dropped = [i for i in items if i not in keep]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = keep
    manifest = findings.load(config.getoption("--known-failures"))
    url = config.getoption("--engine-url")
    session = kv_session(config)
    for item in items:
        name = _engine_of(item)
        if name is None:
            continue
        adapter = session.adapter(name)
        caps = adapter.effective_capabilities()
        for marker in item.iter_markers("requires"):
            missing = [Capability(c) for c in marker.args if Capability(c) not in caps]
            if missing:
                named = ", ".join(
                    f"{c} (in attach mode)" if url and c in adapter.capabilities else str(c) for c in missing
                )
                item.add_marker(pytest.mark.skip(reason=f"engine {name} lacks capability {named}"))
                break
        entry = manifest.match(name, session.adapter(name).version, check_id(item))
        if entry is not None:
            item.add_marker(pytest.mark.xfail(strict=True, reason=entry.reason()))
            item.stash[findings.ENTRY_KEY] = entry


def _engine_of(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    return callspec.params.get("engine_name")


def check_id(item: pytest.Item) -> str:
    """Suite name + test name + its non-engine parameters: stable across engines and runs."""
    marker = item.get_closest_marker("check")
    if marker:
        return str(marker.args[0])
    path = Path(str(item.path))
    parts = path.parts
    suite = parts[parts.index("suites") + 1] if "suites" in parts else path.stem
    name = getattr(item, "originalname", item.name)
    callspec = getattr(item, "callspec", None)
    if callspec is not None:
        ids = [str(value) for key, value in callspec.params.items() if key != "engine_name"]
        if ids:
            name += "[" + "-".join(ids) + "]"
    return f"{suite}::{name}"


@pytest.fixture(scope="session")
def kvconform_session(request: pytest.FixtureRequest) -> KvSession:
    return kv_session(request.config)


@pytest.fixture(scope="session")
def engine(engine_name: str, kvconform_session: KvSession) -> Iterator[EngineAdapter]:
    """The engine under test; its processes live for the session (per engine), not per test."""
    adapter = kvconform_session.adapter(engine_name)
    report.environment_property(f"engine.{engine_name}.version", adapter.version)
    yield adapter
    adapter.close()


@pytest.fixture
def verdict(request: pytest.FixtureRequest) -> Iterator[Verdict]:
    """Measurements and expectations of the running check; it must conclude()."""
    name = _engine_of(request.node) or "-"
    v = Verdict(check_id(request.node), name)
    request.node.stash[_verdict_key] = v
    yield v
    if not v.concluded and request.node.stash.get(_outcome_key, "passed") == "passed":
        raise AssertionError(f"{v.check}: the check never concluded its verdict")


_outcome_key = pytest.StashKey[str]()


@pytest.fixture
def prompts(request: pytest.FixtureRequest) -> PromptFactory:
    """Prompts unique to this check (salted by its node id), so caches never cross checks."""
    return PromptFactory(request.node.nodeid + str(time.time_ns()))


@pytest.fixture
def has(engine: EngineAdapter) -> Callable[[Capability], bool]:
    """has(Capability.X): whether the engine (in this mode) offers an optional extra."""
    caps = engine.effective_capabilities()
    return lambda capability: capability in caps


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep: pytest.TestReport = outcome.get_result()
    if rep.when == "call":
        item.stash[_outcome_key] = rep.outcome
    verdict = item.stash.get(_verdict_key, None)
    name = _engine_of(item)
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


class _RecordCollector:
    """Runs where reports arrive (the controller under xdist): one record per test."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.writer = RecordWriter(Path(config.getoption("--results-dir")).resolve())
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


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    if not _is_worker(session.config):
        results_dir = Path(session.config.getoption("--results-dir")).resolve()
        for stale in [*results_dir.glob("records-*.jsonl"), results_dir / "results.json"]:
            stale.unlink(missing_ok=True)  # one session's results per directory
        session.config.pluginmanager.register(_RecordCollector(session.config), "kvconform-records")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    stop_all_live()
    if _is_worker(session.config):
        return
    kv = kv_session(session.config)
    meta = {
        "engines": {n: kv.adapter(n).version for n in selected_engines(session.config)},
        "faults": session.config.getoption("--fault"),
        "platform": kv.platform(),
        "host": platform.node(),
        "started": kv.started,
        "finished": time.time(),
        "exitstatus": int(exitstatus),
    }
    path = merge(kv.results_dir, meta)
    report.write_allure_environment(session.config, meta)
    session.config.stash[_results_path_key] = path


_results_path_key = pytest.StashKey[Path]()


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    path = config.stash.get(_results_path_key, None)
    if path is not None:
        terminalreporter.write_line(f"kvconform: results written to {path}")
