"""An engine's own invariant checks judged as a measure of the check during which they fired."""

from __future__ import annotations

import pytest

from kvconform.contract import SelfChecks
from kvconform.plugin.fixtures import judge_self_checks
from kvconform.results import Verdict


class _Engine(SelfChecks):
    def __init__(self, alarms: list[str]) -> None:
        self.alarms = alarms

    def self_check_alarms(self, *, settle: bool = True) -> list[str]:
        out, self.alarms = self.alarms, []
        return out


def test_an_alarm_fails_the_check_it_fired_in() -> None:
    v = Verdict("suite::test_x", "e")
    engine = _Engine(["token_to_kv_pool_allocator memory leak detected! total=4096, available=4080"])
    v.before_conclude.append(lambda verdict: judge_self_checks(engine, verdict, "e"))
    v.equal("hits", 1, 1)
    with pytest.raises(AssertionError, match="engine_self_check_alarms = 1"):
        v.conclude()


def test_quiet_self_checks_pass_and_never_make_a_check_non_vacuous() -> None:
    v = Verdict("suite::test_x", "e")
    v.before_conclude.append(lambda verdict: judge_self_checks(_Engine([]), verdict, "e"))
    v.equal("hits", 1, 1)
    v.conclude()
    assert [m.name for m in v.measures] == ["hits", "engine_self_check_alarms"]
    vacuous = Verdict("suite::test_y", "e")
    vacuous.before_conclude.append(lambda verdict: judge_self_checks(_Engine([]), verdict, "e"))
    with pytest.raises(AssertionError, match="no expectation was checked"):
        vacuous.conclude()
