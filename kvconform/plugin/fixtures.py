"""The fixtures suites ask for: the engine under test, the check's verdict, its prompts."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvconform import report
from kvconform.contract import Capability, EngineAdapter, SelfChecks, facet, has_facet, supported
from kvconform.plugin.collection import check_id, engine_of
from kvconform.plugin.session import KvSession, kv_session, selected_engines
from kvconform.prompts import PromptFactory
from kvconform.results import SELF_CHECK_MEASURE, Verdict

verdict_key = pytest.StashKey[Verdict]()
outcome_key = pytest.StashKey[str]()


def judge_self_checks(checks: SelfChecks, verdict: Verdict, engine: str) -> None:
    """The engine's own invariant checks (e.g. SGLang's idle pool audit) raised no alarm while
    this check ran: a measure of every check on an engine that has such checks."""
    alarms = checks.self_check_alarms() or []
    verdict.equal(
        SELF_CHECK_MEASURE,
        len(alarms),
        0,
        note="; ".join(a[:300] for a in alarms[:3]) or f"engine {engine}'s own invariant checks stayed quiet",
    )


class Fixtures:
    @pytest.fixture(scope="session")
    @staticmethod
    def kvconform_session(request: pytest.FixtureRequest) -> KvSession:
        return kv_session(request.config)

    @pytest.fixture(scope="session")
    @staticmethod
    def engine(engine_name: str, kvconform_session: KvSession) -> Iterator[EngineAdapter]:
        """The engine under test; its processes live for the session (per engine), not per test."""
        adapter = kvconform_session.adapter(engine_name)
        report.environment_property(f"engine.{engine_name}.version", adapter.version)
        yield adapter
        adapter.close()

    @pytest.fixture
    @staticmethod
    def other_engines(engine: EngineAdapter, request: pytest.FixtureRequest) -> list[EngineAdapter]:
        """The session's other selected engines (cross-stack checks), in --engine order."""
        session = kv_session(request.config)
        return [session.adapter(n) for n in selected_engines(request.config) if n != engine.name]

    @pytest.fixture
    @staticmethod
    def verdict(request: pytest.FixtureRequest) -> Iterator[Verdict]:
        """Measurements and expectations of the running check; it must conclude()."""
        name = engine_of(request.node)
        v = Verdict(check_id(request.node), name or "-")
        request.node.stash[verdict_key] = v
        engine = kv_session(request.config).adapter(name) if name else None
        if engine is not None and has_facet(engine, SelfChecks):
            checks = facet(engine, SelfChecks)
            if checks.self_check_alarms(settle=False) is not None:  # drains earlier ones
                v.before_conclude.append(lambda verdict: judge_self_checks(checks, verdict, engine.name))
        yield v
        # no call report: the session was interrupted mid-check (Ctrl-C, SIGTERM), not a pass
        if not v.concluded and request.node.stash.get(outcome_key, None) == "passed":
            raise AssertionError(f"{v.check}: the check never concluded its verdict")

    @pytest.fixture
    @staticmethod
    def prompts(request: pytest.FixtureRequest) -> PromptFactory:
        """Prompts unique to this check (salted by its node id), so caches never cross checks."""
        return PromptFactory(request.node.nodeid + str(time.time_ns()))

    @pytest.fixture
    @staticmethod
    def has(engine: EngineAdapter) -> Callable[[Capability], bool]:
        """has(Capability.X): whether the engine (in this mode) offers an optional extra."""
        return supported(engine).__contains__
